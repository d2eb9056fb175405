//! Typed reasons for every decision other than a replay. They hold plain data; text is
//! formatted only when someone displays them, never on the call path.

use std::fmt;

use crate::device::{CaptureViolation, DeviceError, DeviceOp, DevicePtr, UpdateRefusal};
use crate::guard::GuardFinding;
use crate::node_id::NodeId;

/// Why a call recorded a new node instead of replaying one.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum RecordReason {
    /// The function and signature finished their warmups and have no node here yet.
    FirstRecording,
    /// The function has nodes here, but none with this signature (input sizes or keys).
    NewSignature,
    /// A static input's address differs from the one every candidate recorded.
    StaticAddressChanged {
        /// Input position.
        position: usize,
        /// Address the candidate recorded.
        recorded: DevicePtr,
        /// Address passed now.
        now: DevicePtr,
    },
    /// A managed input (an output of the current path) is at another address.
    ManagedAddressChanged {
        /// Input position.
        position: usize,
        /// Address the candidate recorded.
        recorded: DevicePtr,
        /// Address passed now.
        now: DevicePtr,
    },
    /// An output of the path that was dead when the candidate was recorded is alive now, so
    /// the candidate's graph may overwrite it.
    ExpectedDeadAlive {
        /// The node that produced the output.
        node: NodeId,
        /// Output index.
        output: usize,
    },
    /// A copied input overlaps a placeholder the replay writes before reading that input
    /// (memory of an earlier step that now sits where the candidate copies its inputs).
    InputOverlapsPlaceholder {
        /// Input position.
        position: usize,
    },
    /// The candidate was recorded before graft learned that its body writes this copied
    /// input; it never replays, and a sibling that copies the input back is recorded instead.
    InputMutated {
        /// Input position.
        position: usize,
    },
    /// A copied input the body writes lies in memory the candidate's graph writes, so copying
    /// the result back could overwrite the graph's own outputs.
    MutatedInputOverlapsFootprint {
        /// Input position.
        position: usize,
    },
    /// An in-place input moved, and the candidate's graph uses it in a way the device cannot
    /// redirect (a copy or memset node touches it, a kernel whose parameters cannot be read),
    /// so it replays only at the address it was recorded with. The signature's recordings copy
    /// the input into a placeholder from then on, so one more recording replays wherever the
    /// caller's buffer is; unless the function's body reads its inputs through handles of its
    /// own (`FunctionSpec::never_copy_inputs`), whose recordings each serve one address.
    InPlaceInputMoved {
        /// Input position.
        position: usize,
        /// Address the candidate recorded.
        recorded: DevicePtr,
        /// Address passed now.
        now: DevicePtr,
    },
    /// An in-place input that overlaps another input at another offset (a tensor and a view
    /// into it) moved. Inputs that partly overlap are neither followed (a use in the graph
    /// could be either's) nor copied (a copy of one would hide the body's writes through the
    /// other), so a recording replays only at the addresses it was recorded with.
    OverlappingInputMoved {
        /// Input position.
        position: usize,
        /// Position of an input it overlapped in the candidate.
        other: usize,
        /// Address the candidate recorded.
        recorded: DevicePtr,
        /// Address passed now.
        now: DevicePtr,
    },
    /// A copied input overlaps another copied or in-place input, where the candidate recorded
    /// them apart: a placeholder copy would hide the body's writes through the other, so the
    /// recording uses both in place.
    InputsOverlap {
        /// Position of the copied input.
        position: usize,
        /// Position of the input it overlaps.
        other: usize,
    },
    /// Two in-place inputs the candidate recorded as one buffer (the same address and length,
    /// the graph following both) are apart now: a use in the graph could be either's.
    AliasesParted {
        /// Position of the later input.
        position: usize,
        /// Position of the earlier input it was recorded as.
        other: usize,
    },
    /// An in-place input lies in memory the candidate's graph writes.
    InPlaceInputOverlapsFootprint {
        /// Input position.
        position: usize,
    },
    /// A guard's new capture of the body differed from the recording (a host value baked
    /// into it changed: see `Config::guards`); the capture replaced the recording.
    HostValueChanged,
}

impl RecordReason {
    /// Whether this re-recording counts toward the re-record limit (it was not caused by a
    /// new shape, but by addresses or liveness that changed).
    pub fn is_unexpected(&self) -> bool {
        !matches!(
            self,
            RecordReason::FirstRecording
                | RecordReason::NewSignature
                | RecordReason::InputMutated { .. }
                | RecordReason::HostValueChanged
        )
    }

    /// A short stable name for statistics.
    pub fn name(&self) -> &'static str {
        match self {
            RecordReason::FirstRecording => "first recording",
            RecordReason::NewSignature => "new signature",
            RecordReason::StaticAddressChanged { .. } => "static input address changed",
            RecordReason::ManagedAddressChanged { .. } => "managed input address changed",
            RecordReason::ExpectedDeadAlive { .. } => "expected-dead output alive",
            RecordReason::InputOverlapsPlaceholder { .. } => "copied input overlaps a placeholder",
            RecordReason::InputMutated { .. } => "copied input written by the body",
            RecordReason::MutatedInputOverlapsFootprint { .. } => {
                "written input overlaps the graph's memory"
            }
            RecordReason::InPlaceInputMoved { .. } => "in-place input moved",
            RecordReason::OverlappingInputMoved { .. } => "overlapping input moved",
            RecordReason::InputsOverlap { .. } => "inputs overlap",
            RecordReason::AliasesParted { .. } => "aliased inputs came apart",
            RecordReason::InPlaceInputOverlapsFootprint { .. } => {
                "in-place input overlaps the graph's memory"
            }
            RecordReason::HostValueChanged => "a guard found a host value baked in",
        }
    }
}

impl fmt::Display for RecordReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordReason::FirstRecording
            | RecordReason::NewSignature
            | RecordReason::HostValueChanged => f.write_str(self.name()),
            RecordReason::StaticAddressChanged {
                position,
                recorded,
                now,
            } => write!(
                f,
                "static input address changed: input {position} was recorded at {recorded}, now at {now}"
            ),
            RecordReason::ManagedAddressChanged {
                position,
                recorded,
                now,
            } => write!(
                f,
                "managed input address changed: input {position} was recorded at {recorded}, now at {now}"
            ),
            RecordReason::InputOverlapsPlaceholder { position } => write!(
                f,
                "copied input overlaps a placeholder: input {position} lies where the candidate copies its inputs"
            ),
            RecordReason::InputMutated { position } => write!(
                f,
                "copied input written by the body: input {position} is updated in place, so the graph now copies it back to the caller's buffer"
            ),
            RecordReason::MutatedInputOverlapsFootprint { position } => write!(
                f,
                "written input overlaps the graph's memory: input {position} lies where the candidate's graph writes, so its update cannot be copied back"
            ),
            RecordReason::InPlaceInputMoved {
                position,
                recorded,
                now,
            } => write!(
                f,
                "in-place input moved: input {position} was recorded at {recorded}, now at {now}, and the device cannot redirect every use of it in the graph (a copy or memset touches it, or a kernel whose parameters it cannot read, such as NCCL's); graft records again, with the input copied into the graph from now on unless the function reads its inputs outside the context (FunctionSpec::never_copy_inputs), whose recordings each serve one address"
            ),
            RecordReason::OverlappingInputMoved {
                position,
                other,
                recorded,
                now,
            } => write!(
                f,
                "overlapping input moved: input {position} overlaps input {other} at another offset and was recorded at {recorded}, now at {now}; graft can neither follow inputs that partly overlap nor copy one of them (the copy would hide the body's writes through the other), so this call records again: pass them as one buffer (the same address and length) or keep them where they are"
            ),
            RecordReason::InputsOverlap { position, other } => write!(
                f,
                "inputs overlap: copied input {position} now overlaps input {other}, which the candidate recorded apart; graft records again with both used in place, so that the body's writes through one reach the other as they do eagerly"
            ),
            RecordReason::AliasesParted { position, other } => write!(
                f,
                "aliased inputs came apart: inputs {other} and {position} were one buffer when the candidate was recorded, so the graph's uses of it could be either's, and are two buffers now; graft records again for them as they are"
            ),
            RecordReason::InPlaceInputOverlapsFootprint { position } => write!(
                f,
                "in-place input overlaps the graph's memory: input {position} lies where the candidate's graph writes"
            ),
            RecordReason::ExpectedDeadAlive { node, output } => write!(
                f,
                "expected-dead output alive: output {output} of node {node} was dead when the candidate was recorded and is held now"
            ),
        }
    }
}

/// Why a call ran eagerly outside the graph pool.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum EagerReason {
    /// The function was registered eager-only.
    Registered,
    /// The allow-list does not name this function and signature.
    NotAllowListed,
    /// Capturing the body failed: it did something CUDA forbids during capture.
    CaptureFailed {
        /// The operation that broke the capture.
        op: DeviceOp,
        /// CUDA's reason.
        violation: CaptureViolation,
    },
    /// The capture could not begin: another capture is underway on the device (for example a
    /// call into a second runtime from inside the body of another runtime's recording).
    BeginCaptureFailed {
        /// The device's error.
        error: DeviceError,
    },
    /// The captured graph could not be instantiated.
    InstantiateFailed {
        /// The device's error.
        error: DeviceError,
    },
    /// The body opened a conditional node (a device-side loop or branch) that the device
    /// cannot record: it has no conditional nodes (`DeviceError::Unavailable`), or the body
    /// holds what a conditional body cannot (`DeviceError::Conditional`). The call runs
    /// eagerly, its loops and branches decided on the host.
    ConditionalRefused {
        /// The device's error.
        error: DeviceError,
    },
    /// Another rank of the group could not capture this call (it falls back for one of the
    /// reasons above), so every rank runs it eagerly from now on.
    PeerCaptureFailed {
        /// The lowest rank whose capture failed.
        rank: usize,
    },
    /// The call's bucket (`keys[0]`) is above the function's largest bucket.
    AboveLargestBucket {
        /// The size called with.
        size: u64,
        /// The largest bucket.
        largest: usize,
    },
    /// Recording would exceed the graph budget and every recorded graph is on the current
    /// path (none can be evicted). Not permanent: a later call records when room is made.
    GraphBudget {
        /// The limit that is full.
        limit: usize,
    },
    /// The graph budget is full and this new signature was not used clearly more often than
    /// the least used graph it could evict (see [`crate::Config::max_graphs`]). Not
    /// permanent: each such call counts, and the signature records once it is used more.
    NotAdmitted {
        /// The limit that is full.
        limit: usize,
        /// The signature's recent calls (aged).
        uses: u64,
        /// The recent uses (aged) of the least used graph it could evict.
        resident: u64,
    },
    /// The recorded graph launches kernels of a random-number library whose state lives on
    /// the host (see [`crate::GraphSummary::host_random`]): a replay would repeat or skip its
    /// numbers. The recording's one launch drew as an eager call does; every later call runs
    /// eagerly, so the numbers never depend on how a step ran.
    HostRandom {
        /// How many such kernels the graph held.
        kernels: usize,
    },
    /// A guard found a host value baked into the recording (see [`crate::Config::guards`]):
    /// the call that found it ran its new capture. Where the device cannot patch what
    /// differs (the graph's shape, a kernel, a launch configuration), every later call runs
    /// eagerly; a changed value it can patch is [`EagerReason::HostValueChanging`] instead.
    HostValueBaked {
        /// The first difference the guard found (all of them are in
        /// `Graft::guard_findings`).
        finding: Box<GuardFinding>,
    },
    /// A host value baked into the recording changed (see `Graft::guard_findings`): the node
    /// is guarded on every call, and this call ran eagerly, which took less time than
    /// capturing it. Not the signature's for good: captures now and then look whether the
    /// value settled, and it replays again once it has.
    HostValueChanging,
    /// This (parent, function) pair re-recorded more often than the limit allows.
    RerecordLimit {
        /// The limit in force.
        limit: u32,
        /// The reason of the re-recording that went over it.
        last: RecordReason,
    },
}

impl fmt::Display for EagerReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerReason::Registered => f.write_str("registered eager-only"),
            EagerReason::NotAllowListed => {
                f.write_str("not on the allow-list; add the function or signature to Config::allow_list to graph it")
            }
            EagerReason::CaptureFailed { op, violation } => write!(
                f,
                "capture failed: {op} is not allowed during capture ({violation}); {}",
                violation.advice()
            ),
            EagerReason::BeginCaptureFailed { error } => write!(
                f,
                "capture could not begin: {error}; a call made inside another runtime's recording runs eagerly and is recorded as part of that graph"
            ),
            EagerReason::InstantiateFailed { error } => write!(f, "graph instantiation failed: {error}"),
            EagerReason::ConditionalRefused { error } => write!(
                f,
                "a device-side loop or branch cannot be recorded ({error}); it runs on the host, one step at a time"
            ),
            EagerReason::PeerCaptureFailed { rank } => write!(
                f,
                "rank {rank} of the group could not capture this call (see its log), so every rank runs it eagerly"
            ),
            EagerReason::AboveLargestBucket { size, largest } => write!(
                f,
                "size {size} is above the largest bucket ({largest}); it runs eagerly: add a larger bucket to graph it"
            ),
            EagerReason::GraphBudget { limit } => write!(
                f,
                "the graph budget ({limit}) is full and every recorded graph is on the current path; raise Config::max_graphs or FunctionSpec::max_graphs"
            ),
            EagerReason::NotAdmitted {
                limit,
                uses,
                resident,
            } => write!(
                f,
                "the graph budget ({limit}) is full of graphs used more often: this signature had {uses} recent calls, the least used graph {resident}; it runs eagerly until it is used clearly more often; raise Config::max_graphs or FunctionSpec::max_graphs to graph it too"
            ),
            EagerReason::HostRandom { kernels } => write!(
                f,
                "the graph launches {kernels} kernels of a random generator whose state is on the host (cuRAND, candle's rand and randn), which a replay cannot advance; draw from a generator whose seed and offset are on the device (graft_candle::random::DeviceRng) to graph it"
            ),
            EagerReason::HostValueBaked { finding } => write!(f, "{finding}"),
            EagerReason::HostValueChanging => f.write_str(
                "a host value baked into the recording changes from call to call (see guard_findings): this call ran eagerly, which took less time than capturing it; hold the value in a device tensor to replay",
            ),
            EagerReason::RerecordLimit { limit, last } => write!(
                f,
                "re-record limit reached ({limit}): {last}; make the input static with a stable address, or drop outputs consistently"
            ),
        }
    }
}

/// Why recorded graphs were evicted.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EvictReason {
    /// The graph budget was full; this was the least used graph off the current path (of
    /// those used least, the least recently used), evicted for a recording.
    Budget {
        /// The limit that was full (per function or overall).
        limit: usize,
    },
    /// The node was re-recorded (an address it baked in changed) and its executable updated
    /// in place for the new recording.
    Replaced,
    /// Its first launch found that the body writes the copied input at this position: the
    /// node never replays, so it is freed at once.
    InputMutated {
        /// The input position.
        position: usize,
    },
    /// Its graph draws from a host-side random generator ([`EagerReason::HostRandom`]): it
    /// never replays, so it is freed after its first launch.
    HostRandom,
    /// A guard's capture that found a host value baked in ([`EagerReason::HostValueBaked`]):
    /// it ran once in the recording's place, and its signature runs eagerly from then on.
    HostValueBaked,
}

impl fmt::Display for EvictReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictReason::Budget { limit } => write!(
                f,
                "graph budget of {limit} full, least used first; raise the budget if this repeats"
            ),
            EvictReason::Replaced => f.write_str("replaced by its re-recording"),
            EvictReason::InputMutated { position } => write!(
                f,
                "the body writes input {position}: the recording never replays; the next one copies the input back"
            ),
            EvictReason::HostRandom => {
                f.write_str("the graph draws from a host-side random generator: it never replays")
            }
            EvictReason::HostValueBaked => f.write_str(
                "a host value is baked into the graph: its signature runs eagerly from now on",
            ),
        }
    }
}

/// Why a call warmed up (ran eagerly, allocating from the graph pool).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WarmupReason {
    /// The function and signature have run fewer warmups than configured.
    FirstCalls {
        /// Warmups done before this one.
        done: u32,
        /// Warmups required.
        needed: u32,
    },
    /// An earlier call of this generation warmed up, so addresses differ from any recording.
    PathWarmingUp,
}

impl fmt::Display for WarmupReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WarmupReason::FirstCalls { done, needed } => {
                write!(f, "warmup {} of {needed}", done + 1)
            }
            WarmupReason::PathWarmingUp => f.write_str(
                "an earlier call of this step warmed up, so the rest of the step runs eagerly",
            ),
        }
    }
}

/// A decision other than a plain replay.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Decision {
    /// Ran eagerly from the graph pool.
    Warmup(WarmupReason),
    /// Recorded a new node.
    Record(RecordReason),
    /// Ran eagerly outside the graph pool.
    Eager(EagerReason),
    /// A recording found that its body writes a copied input (the placeholder differed from
    /// the caller's buffer after the first launch): the caller's buffer was updated, and the
    /// function's later recordings copy that input back inside the graph.
    InputMutated {
        /// Input position.
        position: usize,
    },
    /// Removed recorded graphs from the tree (a node and the nodes recorded under it).
    Evict {
        /// Nodes removed.
        nodes: usize,
        /// Why.
        why: EvictReason,
    },
    /// A re-recording asked the device to update the replaced node's executable in place and
    /// the device refused: the new graph was instantiated instead.
    UpdateRefused {
        /// The device's reason.
        reason: UpdateRefusal,
    },
    /// Restored the pool bookkeeping before a warmup or recording that followed replays.
    Restore {
        /// Buffers kept because callers still hold them.
        kept: usize,
        /// Buffers invalidated because their memory could not be kept.
        invalidated: usize,
    },
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Warmup(r) => write!(f, "warmup: {r}"),
            Decision::Record(r) => write!(f, "record: {r}"),
            Decision::Eager(r) => write!(f, "eager: {r}"),
            Decision::InputMutated { position } => write!(
                f,
                "input {position} is written by the body: copied back to the caller's buffer inside the graph from now on"
            ),
            Decision::Evict { nodes, why } => write!(f, "evicted {nodes} recorded graphs: {why}"),
            Decision::UpdateRefused { reason } => write!(
                f,
                "in-place update refused ({reason}); the new graph was instantiated instead"
            ),
            Decision::Restore { kept, invalidated } => write!(
                f,
                "restore pool checkpoint: kept {kept} held buffers, invalidated {invalidated}"
            ),
        }
    }
}

/// One entry of the decision log (see `Graft::explain`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DecisionRecord {
    /// Generation in which it happened.
    pub generation: u64,
    /// Function called.
    pub function: std::sync::Arc<str>,
    /// Node recorded, or the tip the decision was made at.
    pub node: Option<NodeId>,
    /// What was decided and why.
    pub decision: Decision,
}

impl fmt::Display for DecisionRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[gen {}] {}", self.generation, self.function)?;
        if let Some(n) = self.node {
            write!(f, " @{n}")?;
        }
        write!(f, ": {}", self.decision)
    }
}
