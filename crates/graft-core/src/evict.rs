//! The graph budget: evicting recorded graphs, least recently used first, and the replacement
//! of a node by its re-recording.

use crate::device::{Device, DevicePtr};
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
        let per_function = self.functions[function.0].spec.max_graphs;
        let overall = self.config.max_graphs;
        if per_function.is_none() && overall.is_none() {
            return Ok(None);
        }
        let path = self.path_nodes(parent);
        let mut reuse = None;
        loop {
            let of_function = self
                .nodes
                .values()
                .filter(|n| n.function == function)
                .count();
            let over_function = per_function.filter(|&l| of_function >= l);
            let over_all = overall.filter(|&l| self.nodes.len() >= l);
            let Some(limit) = over_all.or(over_function) else {
                return Ok(reuse);
            };
            // Over the overall budget any graph may go; over the function's only its own.
            let victim = self
                .nodes
                .iter()
                .filter(|(k, n)| {
                    !path.contains(k) && (over_all.is_some() || n.function == function)
                })
                .min_by_key(|(_, n)| n.last_used)
                .map(|(k, _)| k);
            let Some(k) = victim else {
                return Err(limit);
            };
            let same = self.nodes[k].function == function;
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
        let function = self.nodes[key].function;
        let _span = tracing::debug_span!(
            "evict",
            function = %self.functions[function.0].name,
            node = %key.id(),
            %why
        )
        .entered();
        let mut doomed = vec![key];
        let mut i = 0;
        while let Some(&k) = doomed.get(i) {
            doomed.extend_from_slice(&self.nodes[k].children);
            i += 1;
        }
        // Unlink the subtree's root from its parent; the rest go with it.
        let parent = self.nodes[key].parent;
        match parent {
            Some(p) => self.nodes[p].children.retain(|&c| c != key),
            None => self.roots[function.0].retain(|&c| c != key),
        }
        let mut graph = None;
        for &k in &doomed {
            let Some(node) = self.nodes.remove(k) else {
                continue;
            };
            let slot = (node.parent, node.function, node.sig);
            if let Some(v) = self.slots.get_mut(&slot) {
                v.retain(|&c| c != k);
                if v.is_empty() {
                    self.slots.remove(&slot);
                }
            }
            if matches!(why, EvictReason::Budget { .. }) {
                let s = &mut self.functions[node.function.0].sigs[node.sig];
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
        let pins: Vec<(DevicePtr, usize)> = self
            .nodes
            .values()
            .flat_map(|n| n.footprint.iter())
            .map(|&(s, e)| (DevicePtr(s), (e - s) as usize))
            .collect();
        lock(&self.graph_pool).repin(&pins);
        self.stats.evictions += doomed.len() as u64;
        tracing::debug!(nodes = doomed.len(), "evicted");
        self.log(
            function,
            parent,
            Decision::Evict {
                nodes: doomed.len(),
                why,
            },
        );
        graph
    }
}
