//! The tree's structural invariant check, for tests: the links and the candidate lookup agree
//! with the arena.

use super::Tree;
use crate::buffer::NodeId;
use crate::error::FunctionId;

/// A broken link of the tree, found by [`Tree::check_links`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
// Public through `testing` with the test-support feature; crate-internal in unit tests.
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub enum TreeViolation {
    /// A node is missing from its parent's children or its function's roots.
    #[error("node {node} is not linked under its parent; a tree change bypassed Tree's methods")]
    Unlinked {
        /// The node.
        node: NodeId,
    },
    /// A node's parent, a listed child or a listed root is not in the arena, or is listed
    /// where it does not belong.
    #[error("node {node} is listed where it does not sit; a tree change bypassed Tree's methods")]
    Misplaced {
        /// The node.
        node: NodeId,
    },
    /// The candidate lookup does not list every node exactly once, at its own slot.
    #[error("the candidate lookup and node {node} disagree; a tree change bypassed Tree's methods")]
    Lookup {
        /// The node.
        node: NodeId,
    },
}

impl<G, M> Tree<G, M> {
    /// Checks that the links and the lookup agree with the arena: every node sits in its
    /// parent's children (or its function's roots) and at its own lookup slot, exactly once,
    /// and nothing else is listed. For tests; it walks the whole tree.
    pub(crate) fn check_links(&self) -> Result<(), TreeViolation> {
        let mut listed = 0;
        for (key, e) in &self.nodes {
            let node = key.id();
            let siblings = match e.parent {
                Some(p) => match self.nodes.get(p) {
                    Some(pe) => &pe.children,
                    None => return Err(TreeViolation::Misplaced { node }),
                },
                None => match self.roots.get(e.node.function.0) {
                    Some(r) => r,
                    None => return Err(TreeViolation::Misplaced { node }),
                },
            };
            if siblings.iter().filter(|&&c| c == key).count() != 1 {
                return Err(TreeViolation::Unlinked { node });
            }
            for &c in &e.children {
                if self.nodes.get(c).is_none_or(|ce| ce.parent != Some(key)) {
                    return Err(TreeViolation::Misplaced { node: c.id() });
                }
            }
            let at = self.candidates(e.parent, e.node.function, e.node.sig);
            if at.iter().filter(|&&c| c == key).count() != 1 {
                return Err(TreeViolation::Lookup { node });
            }
            listed += 1;
        }
        for (f, roots) in self.roots.iter().enumerate() {
            for &r in roots {
                let fits = self
                    .nodes
                    .get(r)
                    .is_some_and(|e| e.parent.is_none() && e.node.function == FunctionId(f));
                if !fits {
                    return Err(TreeViolation::Misplaced { node: r.id() });
                }
            }
        }
        let in_lookup: usize = self.slots.values().map(Vec::len).sum();
        if in_lookup != listed {
            let stray = self
                .slots
                .values()
                .flatten()
                .find(|&&k| !self.nodes.contains_key(k));
            let node = stray.map_or(NodeId(0), |k| k.id());
            return Err(TreeViolation::Lookup { node });
        }
        Ok(())
    }
}
