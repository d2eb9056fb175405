//! What the runtime learned about its calls beyond the tree and the signatures: re-recordings
//! per place, the places that fall back to eager for good, when the graph budget's counts
//! were last aged, and the decision log. Changed only through its methods.

use std::collections::{HashMap, VecDeque};

use crate::error::FunctionId;
use crate::reason::{DecisionRecord, EagerReason};
use crate::tree::NodeKey;

/// A place of the tree: a function called under a node (at the roots when none).
type Place = (Option<NodeKey>, FunctionId);

/// The runtime's policy state. Invariant: no entry names a node that left the tree
/// ([`Policy::forget`] runs for every evicted node).
#[derive(Debug)]
pub(crate) struct Policy {
    /// Unexpected re-recordings per place: the re-record limit counts these.
    rerecords: HashMap<Place, u32>,
    /// Places that run eagerly for good (their re-record limit was exceeded).
    eager_pairs: HashMap<Place, EagerReason>,
    /// The calls that did not replay (the replays are `Stats::replays`), and when the use
    /// counts were last aged (see `admit.rs`): together, the runtime's calls.
    off_replay: u64,
    aged_at: u64,
    /// The last non-replay decisions, oldest first, at most `capacity`.
    decisions: VecDeque<DecisionRecord>,
    capacity: usize,
}

impl Policy {
    /// Nothing learned yet; the log keeps at most `decision_log` decisions.
    pub(crate) fn new(decision_log: usize) -> Policy {
        Policy {
            rerecords: HashMap::new(),
            eager_pairs: HashMap::new(),
            off_replay: 0,
            aged_at: 0,
            decisions: VecDeque::new(),
            capacity: decision_log,
        }
    }

    /// Unexpected re-recordings of `function` under `parent` so far.
    pub(crate) fn rerecords(&self, parent: Option<NodeKey>, function: FunctionId) -> u32 {
        self.rerecords
            .get(&(parent, function))
            .copied()
            .unwrap_or(0)
    }

    /// Why `function` runs eagerly for good under `parent`, if it does.
    pub(crate) fn eager_pair(
        &self,
        parent: Option<NodeKey>,
        function: FunctionId,
    ) -> Option<&EagerReason> {
        self.eager_pairs.get(&(parent, function))
    }

    /// Counts an unexpected re-recording of `function` under `parent`.
    pub(crate) fn count_rerecord(&mut self, parent: Option<NodeKey>, function: FunctionId) {
        *self.rerecords.entry((parent, function)).or_insert(0) += 1;
    }

    /// `function` runs eagerly for good under `parent`.
    pub(crate) fn fall_back(
        &mut self,
        parent: Option<NodeKey>,
        function: FunctionId,
        why: EagerReason,
    ) {
        self.eager_pairs.insert((parent, function), why);
    }

    /// `node` left the tree: forgets the places under it.
    pub(crate) fn forget(&mut self, node: NodeKey) {
        self.rerecords.retain(|(p, _), _| *p != Some(node));
        self.eager_pairs.retain(|(p, _), _| *p != Some(node));
    }

    /// The tree was cleared: forgets every place (the log and the counts' ages stay).
    pub(crate) fn clear_places(&mut self) {
        self.rerecords.clear();
        self.eager_pairs.clear();
    }

    /// How many windows of `window` calls the next call that does not replay ends, with
    /// `replays` replays so far: the agings it does (see [`Policy::count_off_replay`]).
    pub(crate) fn windows_due(&self, replays: u64, window: u64) -> u64 {
        let window = window.max(1);
        (replays + self.off_replay + 1 - self.aged_at) / window
    }

    /// Counts a call that does not replay; returns how many windows ended (the caller ages
    /// every use count by that many; none usually).
    pub(crate) fn count_off_replay(&mut self, replays: u64, window: u64) -> u64 {
        let windows = self.windows_due(replays, window);
        self.off_replay += 1;
        self.aged_at += windows * window.max(1);
        windows
    }

    /// Whether the log keeps decisions (callers skip building one otherwise).
    pub(crate) fn logs(&self) -> bool {
        self.capacity > 0
    }

    /// Logs a decision, dropping the oldest when full.
    pub(crate) fn log(&mut self, record: DecisionRecord) {
        if self.capacity == 0 {
            return;
        }
        if self.decisions.len() == self.capacity {
            self.decisions.pop_front();
        }
        self.decisions.push_back(record);
    }

    /// The logged decisions, oldest first.
    pub(crate) fn decisions(&self) -> impl Iterator<Item = &DecisionRecord> {
        self.decisions.iter()
    }
}
