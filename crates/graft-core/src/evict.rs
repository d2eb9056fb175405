//! The graph budget: making room for a recording (the least used graph first, if the
//! recording is admitted: see `admit.rs`), and what evicting a node means for the runtime
//! (held outputs kept as loose memory, pins, counters); the tree itself unlinks the nodes
//! (`Tree::remove`).

use crate::admit::{admits, node_uses};
use crate::device::Device;
use crate::error::FunctionId;
use crate::graft::{Graft, lock};
use crate::reason::{Decision, EagerReason, EvictReason};
use crate::tree::{NodeKey, OutputSlot};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Before recording a node of `function` with signature `sig` under `parent`: evicts the
    /// least used graphs (ties: the least recently used) until the function's and the tree's
    /// budgets have room for one more. Nodes on the path to `parent` are never evicted (the
    /// recording continues from them). With `admission` (a new signature at this place), each
    /// graph is evicted only if the signature is used clearly more often (see
    /// [`admits`]). Returns the graph of the first evicted node of `function`, for the
    /// recording to update in place, or why the call runs eagerly instead: only path nodes
    /// are left, or the signature is not admitted. O(graphs) per evicted graph.
    pub(crate) fn make_room(
        &mut self,
        function: FunctionId,
        sig: usize,
        parent: Option<NodeKey>,
        admission: bool,
    ) -> Result<Option<D::Graph>, EagerReason> {
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
            let functions = &self.functions;
            let victim = self
                .tree
                .iter()
                .filter(|(k, n)| {
                    !path.contains(k) && (over_all.is_some() || n.function == function)
                })
                .map(|(k, n)| (k, node_uses(n, &functions[n.function].sigs[n.sig]), n))
                .min_by_key(|&(_, uses, n)| (uses, n.last_used))
                .map(|(k, uses, _)| (k, uses));
            let Some((k, resident)) = victim else {
                return Err(EagerReason::GraphBudget { limit });
            };
            let uses = functions[function].sigs[sig].uses_now();
            if admission && !admits(uses, resident) {
                return Err(EagerReason::NotAdmitted {
                    limit,
                    uses,
                    resident,
                });
            }
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
            // The calls the graph served are its signature's again: a signature evicted for
            // a more used one keeps its count when it competes to come back.
            let served = node.uses.estimate(node.replays);
            self.functions[node.function].sigs[node.sig]
                .uses
                .add(served);
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
