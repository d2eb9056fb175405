//! Evicting: carrying out the graph budget's decision for a recording (made by the planner:
//! see `admit.rs`), and what evicting a node means for the runtime (held outputs kept as
//! loose memory, pins, counters); the tree itself unlinks the nodes (`Tree::remove`).

use crate::device::Device;
use crate::error::FunctionId;
use crate::graft::Graft;
use crate::pools::lock;
use crate::reason::{Decision, EvictReason};
use crate::tree::{NodeKey, OutputSlot};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Before a recording of `function`: evicts the nodes the plan chose (see
    /// `admit::room`), in order. Returns the graph of the first evicted node of `function`,
    /// for the recording to update in place.
    pub(crate) fn make_room(
        &mut self,
        function: FunctionId,
        evicts: &[(NodeKey, EvictReason)],
    ) -> Option<D::Graph> {
        let mut reuse = None;
        for &(k, why) in evicts {
            let same = self.tree.get(k).is_some_and(|n| n.function == function);
            let graph = self.evict(k, why);
            if same && reuse.is_none() {
                reuse = graph;
            }
        }
        reuse
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
            self.policy.forget(k);
            for o in node.outputs {
                if let OutputSlot::Tracked { cell, spares } = o.slot {
                    self.pools.keep_loose(std::iter::once(cell).chain(spares));
                }
            }
            if k == key {
                graph = Some(node.graph);
            }
        }
        lock(self.pools.graph()).repin(&self.tree.pins());
        self.stats.evictions += count as u64;
        tracing::debug!(nodes = count, "evicted");
        self.log(function, parent, Decision::Evict { nodes: count, why });
        graph
    }
}
