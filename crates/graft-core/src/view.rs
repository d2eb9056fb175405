//! What the planner may read of the runtime: no device, nothing mutable.

use crate::config::Config;
use crate::lifecycle::Phase;
use crate::policy::Policy;
use crate::signature::Functions;
use crate::tree::Tree;

/// A read-only view of the runtime's state, for `plan.rs` and `admit.rs`.
pub(crate) struct View<'a, G, M> {
    pub(crate) phase: Phase,
    pub(crate) config: &'a Config,
    pub(crate) functions: &'a Functions,
    pub(crate) tree: &'a Tree<G, M>,
    pub(crate) policy: &'a Policy,
    pub(crate) backward_pending: bool,
    /// The current generation (`Graft::generation`).
    pub(crate) generation: u64,
    /// The replays so far (`Stats::replays`): with the policy's count of the other calls,
    /// when the use counts age next.
    pub(crate) replays: u64,
}
