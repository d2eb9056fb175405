//! Admission to the graph budget: how often each signature and each graph is used (counts
//! that age), and whether a new signature may take the place of the least used graph.
//!
//! Every call is counted exactly once, without adding anything to the replay path: a replay
//! by its node's `replays` (which the replay path increments anyway), any other call
//! (warmup, recording, eager run) by its signature's `calls`, here. Both raw counts only grow;
//! [`Uses`] keeps the aged estimate next to them, and ages them all together once per
//! [`Config::budget_window`](crate::Config::budget_window) calls, on a call that does not
//! replay.

use crate::device::Device;
use crate::error::FunctionId;
use crate::graft::Graft;
use crate::signature::Signature;
use crate::tree::Node;

/// How often a graph or a signature was used recently: the calls counted since the last
/// aging at full weight, and those before halved once per window since. The raw count it ages
/// lives with its owner and only grows.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct Uses {
    /// The aged count as of the last aging.
    aged: u64,
    /// The raw count at the last aging.
    seen: u64,
}

impl Uses {
    /// The aged count now, given the raw count `raw`.
    pub(crate) fn estimate(self, raw: u64) -> u64 {
        self.aged + (raw - self.seen)
    }

    /// Ages the count by `windows` (at least one) windows that passed since the last aging.
    /// The calls counted since then are taken as spread evenly over those windows (replays
    /// between two calls that do not replay are not told apart in time): each window's share
    /// is halved once for every window that ended after it, so a graph replayed steadily
    /// through a long stretch without other calls keeps the estimate of its rate.
    pub(crate) fn age(&mut self, raw: u64, windows: u64) {
        let halvings = windows.min(63) as u32;
        let share = (raw - self.seen) / windows;
        self.aged = (self.aged >> halvings) + share - (share >> halvings);
        self.seen = raw;
    }

    /// Adds aged calls: those an evicted graph served, handed back to its signature.
    pub(crate) fn add(&mut self, calls: u64) {
        self.aged += calls;
    }
}

/// Whether a signature used `candidate` times (aged) may take the place of a graph used
/// `resident` times: only if it is used clearly more often, by a quarter more and by at least
/// two calls, so that two signatures used about equally never evict each other in turn.
pub(crate) fn admits(candidate: u64, resident: u64) -> bool {
    candidate >= resident + (resident / 4).max(2)
}

/// When the counts were last aged, and the calls that did not replay (the replays are
/// `Stats::replays`): together, the runtime's calls.
#[derive(Default, Debug)]
pub(crate) struct Ages {
    off_replay: u64,
    aged_at: u64,
}

/// How often calls of a graph's signature use it: the replays it served, and the calls of its
/// signature that no graph served (those it would serve at its place in the tree).
pub(crate) fn node_uses<G, M>(node: &Node<G, M>, sig: &Signature) -> u64 {
    node.uses.estimate(node.replays) + sig.uses_now()
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// Counts a call of `function` with signature `sig` that does not replay (and stamps it:
    /// `Function::touch`), first aging every count if a window ended: O(graphs +
    /// signatures), at most once per window.
    pub(crate) fn count_off_replay(&mut self, function: FunctionId, sig: usize) {
        self.ages.off_replay += 1;
        let now = self.stats.replays + self.ages.off_replay;
        let window = self.config.budget_window.max(1);
        let windows = (now - self.ages.aged_at) / window;
        if windows > 0 {
            self.ages.aged_at += windows * window;
            for f in self.functions.iter_mut() {
                f.sigs.iter_mut().for_each(|s| s.age(windows));
            }
            for n in self.tree.values_mut() {
                n.uses.age(n.replays, windows);
            }
            tracing::trace!(windows, "aged the graph budget's use counts");
        }
        self.functions[function].touch(sig);
    }
}

#[cfg(test)]
mod tests {
    //! The aged counts and the admission margin, without a runtime.

    use super::*;

    #[test]
    fn counts_halve_once_per_window() {
        let mut u = Uses::default();
        assert_eq!(u.estimate(10), 10);
        u.age(10, 1);
        assert_eq!(u.estimate(10), 5);
        assert_eq!(u.estimate(16), 11, "new calls count in full");
        u.age(16, 1);
        assert_eq!(u.estimate(16), 5, "(5 + 6) / 2");
        u.age(16, 3);
        assert_eq!(u.estimate(16), 0);
        u.add(7);
        assert_eq!(u.estimate(16), 7);
    }

    #[test]
    fn a_steady_rate_keeps_its_estimate_however_late_the_aging() {
        // 100 calls per window, aged every window or after 8 windows at once.
        let (mut each, mut late) = (Uses::default(), Uses::default());
        for w in 1..=32u64 {
            each.age(100 * w, 1);
            if w % 8 == 0 {
                late.age(100 * w, 8);
            }
        }
        assert_eq!(each.estimate(3200), 99);
        assert!((95..=100).contains(&late.estimate(3200)), "{late:?}");
    }

    #[test]
    fn admission_needs_a_margin() {
        assert!(admits(2, 0));
        assert!(!admits(1, 0));
        assert!(!admits(10, 9) && admits(11, 9));
        assert!(!admits(124, 100) && admits(125, 100));
    }
}
