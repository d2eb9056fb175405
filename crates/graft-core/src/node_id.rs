//! Node identities as errors, dumps and statistics name them: `NodeId` and `NodeLabel` (a leaf: imports nothing of the crate).

use std::fmt;

/// Identifies a node of the graph tree in errors, dumps and statistics.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The low 32 bits of a slotmap key are the slot index; show that, it is what dumps show.
        write!(f, "n{}", self.0 & 0xffff_ffff)
    }
}

/// A node id, or none (`-`) for memory made by a warmup or eager run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct NodeLabel(pub Option<NodeId>);

impl fmt::Display for NodeLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("-"),
        }
    }
}
