//! Counters graft keeps about its decisions and its pools.

use crate::pool::PoolStats;
use crate::reason::RecordReason;

/// Re-recordings by reason.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RerecordCounts {
    /// Same function, new input sizes or keys.
    pub new_signature: u64,
    /// A static input moved.
    pub static_address_changed: u64,
    /// A managed input moved.
    pub managed_address_changed: u64,
    /// An output the candidate expected dead was held.
    pub expected_dead_alive: u64,
    /// A copied input overlapped a placeholder the replay writes first.
    pub input_overlaps_placeholder: u64,
    /// A candidate recorded before its body was known to write a copied input.
    pub input_mutated: u64,
    /// A written input lay in memory the candidate's graph writes.
    pub mutated_input_overlaps_footprint: u64,
    /// An in-place input moved where the graph could not follow it.
    pub in_place_input_moved: u64,
    /// An in-place input overlapping another input at another offset moved.
    pub overlapping_input_moved: u64,
    /// A copied input overlapped another input the candidate recorded apart from it.
    pub inputs_overlap: u64,
    /// An in-place input lay in memory the candidate's graph writes.
    pub in_place_input_overlaps_footprint: u64,
    /// Inputs recorded as one buffer were passed as two.
    pub aliases_parted: u64,
    /// A guard found a host value baked into the recording (see `Config::guards`).
    pub host_value_changed: u64,
}

impl RerecordCounts {
    /// Counts a recording made for `reason` (first recordings are not re-recordings).
    pub(crate) fn count(&mut self, reason: &RecordReason) {
        let counter = match reason {
            RecordReason::FirstRecording => return,
            RecordReason::NewSignature => &mut self.new_signature,
            RecordReason::StaticAddressChanged { .. } => &mut self.static_address_changed,
            RecordReason::ManagedAddressChanged { .. } => &mut self.managed_address_changed,
            RecordReason::ExpectedDeadAlive { .. } => &mut self.expected_dead_alive,
            RecordReason::InputOverlapsPlaceholder { .. } => &mut self.input_overlaps_placeholder,
            RecordReason::InputMutated { .. } => &mut self.input_mutated,
            RecordReason::MutatedInputOverlapsFootprint { .. } => {
                &mut self.mutated_input_overlaps_footprint
            }
            RecordReason::InPlaceInputMoved { .. } => &mut self.in_place_input_moved,
            RecordReason::OverlappingInputMoved { .. } => &mut self.overlapping_input_moved,
            RecordReason::InputsOverlap { .. } => &mut self.inputs_overlap,
            RecordReason::AliasesParted { .. } => &mut self.aliases_parted,
            RecordReason::InPlaceInputOverlapsFootprint { .. } => {
                &mut self.in_place_input_overlaps_footprint
            }
            RecordReason::HostValueChanged => &mut self.host_value_changed,
        };
        *counter += 1;
    }
}

/// A snapshot of graft's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Stats {
    /// Eager runs from the graph pool.
    pub warmups: u64,
    /// Graphs recorded (first recordings and re-recordings).
    pub recordings: u64,
    /// Graph replays.
    pub replays: u64,
    /// Inputs copied into placeholders by replays (by the graph's own copy nodes).
    pub copied_inputs: u64,
    /// Inputs whose every use the device redirects to the caller's buffer of each call: copied
    /// inputs that recordings made copy-free, and in-place inputs the graph follows.
    pub patched_inputs: u64,
    /// Replays that re-pointed a copy node (or re-patched a copy-free or in-place input)
    /// because the caller's buffer moved.
    pub copy_sources_updated: u64,
    /// Recordings whose outcome was agreed with the other ranks of a group.
    pub agreements: u64,
    /// Re-recordings by reason.
    pub rerecords: RerecordCounts,
    /// Eager runs outside the graph pool (eager-only functions and fallbacks).
    pub eager_runs: u64,
    /// Functions, (parent, function) pairs or signatures that fell back to eager for good.
    pub fallbacks: u64,
    /// Calls that would have recorded but ran eagerly because the graph budget was full
    /// (`EagerReason::GraphBudget` and `EagerReason::NotAdmitted`); also in `eager_runs`.
    pub over_budget: u64,
    /// Copied inputs found written by their body (each is copied back from then on).
    pub mutated_inputs: u64,
    /// Captures that failed.
    pub capture_failures: u64,
    /// Pool restores before a warmup or recording that followed replays.
    pub restores: u64,
    /// Generations started.
    pub generations: u64,
    /// Nodes in the tree.
    pub nodes: usize,
    /// Recorded graphs evicted (by the graph budget, or replaced by their re-recording).
    pub evictions: u64,
    /// Re-recordings that updated the replaced node's executable in place.
    pub updates_in_place: u64,
    /// Re-recordings whose in-place update the device refused (instantiated instead).
    pub update_refusals: u64,
    /// Guarded calls: captures compared with their recording (see `Config::guards`).
    pub guards: u64,
    /// Guarded calls that found a difference (their capture replaced the recording).
    pub guard_differences: u64,
    /// Buffers invalidated because their memory was reused.
    pub invalidations: u64,
    /// The graph pool.
    pub pool: PoolStats,
    /// The eager pool (memory outside graphs).
    pub eager_pool: PoolStats,
}
