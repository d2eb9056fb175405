//! Test introspection: what a call would replay, and per-node facts, without running anything.

use crate::buffer::Buffer;
use crate::device::Device;
use crate::error::{CallError, FunctionId};
use crate::graft::Graft;
use crate::node_id::NodeId;
use crate::plan;
use crate::tree::{NodeKey, TreeViolation, key_of};

impl<D: Device, M: Clone> Graft<D, M> {
    /// The node a call with these inputs would replay at the current tip, running the same
    /// invariant check as a call but nothing else (no launch, no state change).
    pub fn probe(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
    ) -> Result<Option<NodeId>, CallError> {
        let Some(f) = self.functions.get(function) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        let mut addrs = Vec::with_capacity(inputs.len());
        for (position, b) in inputs.iter().enumerate() {
            let addr = b.addr().map_err(|source| CallError::InvalidInput {
                function: f.name.clone(),
                position,
                source,
            })?;
            addrs.push(addr);
        }
        let Some(sig) = f.sigs.iter().position(|s| s.matches(inputs, keys)) else {
            return Ok(None);
        };
        let tip = self.phase.tip().map(key_of);
        Ok(
            plan::candidate(&self.view(), tip, function, sig, &addrs, true)
                .ok()
                .map(NodeKey::id),
        )
    }

    /// How many signatures `function` holds (those that recorded, and at most
    /// `Config::max_unrecorded_signatures` that did not).
    pub fn signatures(&self, function: FunctionId) -> Option<usize> {
        self.functions.get(function).map(|f| f.sigs.len())
    }

    /// How often a node has been replayed.
    pub fn node_replays(&self, node: NodeId) -> Option<u64> {
        self.tree.get(key_of(node)).map(|n| n.replays)
    }

    /// The nodes of the tree, in arena order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.tree.iter().map(|(k, _)| k.id()).collect()
    }

    /// The function a node records.
    pub fn node_function(&self, node: NodeId) -> Option<FunctionId> {
        self.tree.get(key_of(node)).map(|n| n.function)
    }

    /// A node's parent.
    pub fn node_parent(&self, node: NodeId) -> Option<NodeId> {
        let key = key_of(node);
        self.tree.get(key)?;
        self.tree.parent(key).map(NodeKey::id)
    }

    /// Checks that the tree's links and candidate lookup agree with its nodes.
    pub fn check_tree(&self) -> Result<(), TreeViolation> {
        self.tree.check_links()
    }
}
