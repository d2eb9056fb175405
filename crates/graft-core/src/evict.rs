//! The graph budget: evicting recorded graphs, least recently used first, and what evicting
//! a node means for the runtime (held outputs kept as loose memory, pins, counters); the tree
//! itself unlinks the nodes (`Tree::remove`).

use crate::device::Device;
use crate::error::FunctionId;
use crate::graft::{Graft, lock};
use crate::reason::{Decision, EvictReason};
use crate::tree::{NodeKey, OutputSlot};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Before recording a node of `function` under `parent`: evicts the least recently used
    /// graphs until the function's and the tree's budgets have room for one more. Nodes on
    /// the path to `parent` are never evicted (the recording continues from them). Returns
    /// the graph of the first evicted node of `function`, for the recording to update in
    /// place, or the limit that cannot be met when only path nodes are left.
    pub(crate) fn make_room(
        &mut self,
        function: FunctionId,
        parent: Option<NodeKey>,
    ) -> Result<Option<D::Graph>, usize> {
        let per_function = self.functions[function].spec.max_graphs;
        let overall = self.config.max_graphs;
        if per_function.is_none() && overall.is_none() {
            return Ok(None);
        }
        let path = self.tree.path_nodes(parent);
        let mut reuse = None;
        loop {
            let of_function = self
                .tree
                .values()
                .filter(|n| n.function == function)
                .count();
            let over_function = per_function.filter(|&l| of_function >= l);
            let over_all = overall.filter(|&l| self.tree.len() >= l);
            let Some(limit) = over_all.or(over_function) else {
                return Ok(reuse);
            };
            // Over the overall budget any graph may go; over the function's only its own.
            let victim = self
                .tree
                .iter()
                .filter(|(k, n)| {
                    !path.contains(k) && (over_all.is_some() || n.function == function)
                })
                .min_by_key(|(_, n)| n.last_used)
                .map(|(k, _)| k);
            let Some(k) = victim else {
                return Err(limit);
            };
            let same = self.tree[k].function == function;
            let graph = self.evict(k, EvictReason::Budget { limit });
            if same && reuse.is_none() {
                reuse = graph;
            }
        }
    }

    /// Removes `key` and every node recorded under it from the tree and returns the graph of
    /// `key` (the others are destroyed; `None` if `key` is not in the tree). Outputs a caller still holds become loose memory:
    /// readable until graft reuses it, invalidated before. What the removed graphs alone
    /// pinned may be unmapped from then on.
    pub(crate) fn evict(&mut self, key: NodeKey, why: EvictReason) -> Option<D::Graph> {
        let function = self.tree.get(key)?.function;
        let _span = tracing::debug_span!(
            "evict",
            function = %self.functions[function].name,
            node = %key.id(),
            %why
        )
        .entered();
        let parent = self.tree.parent(key);
        let removed = self.tree.remove(key);
        let count = removed.len();
        let mut graph = None;
        for (k, node) in removed {
            if matches!(why, EvictReason::Budget { .. }) {
                let s = &mut self.functions[node.function].sigs[node.sig];
                s.evictions = s.evictions.saturating_add(1);
                s.warmups_done = 0;
            }
            self.rerecords.retain(|(p, _), _| *p != Some(k));
            self.eager_pairs.retain(|(p, _), _| *p != Some(k));
            for o in node.outputs {
                if let OutputSlot::Tracked { cell, spares } = o.slot {
                    self.loose.extend(std::iter::once(cell).chain(spares));
                }
            }
            if k == key {
                graph = Some(node.graph);
            }
        }
        lock(&self.graph_pool).repin(&self.tree.pins());
        self.stats.evictions += count as u64;
        tracing::debug!(nodes = count, "evicted");
        self.log(function, parent, Decision::Evict { nodes: count, why });
        graph
    }
}
