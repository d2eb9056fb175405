//! Configuration: runtime-wide defaults and per-function specs.

use crate::bucket::Buckets;
use crate::device::CaptureMode;
use crate::guard::Guards;

/// What a registered function computes, which decides when generations start.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Mode {
    /// Inference: calling a root-level function when the path cannot continue starts a new
    /// generation, so a plain loop needs no `mark_step_begin`.
    #[default]
    Inference,
    /// A training forward: with no backward pending it begins a step (a new generation when
    /// the path cannot continue), wherever it was first called; its outputs need a backward,
    /// so no generation starts implicitly until a `Backward` function runs or
    /// `mark_step_begin` is called.
    Forward,
    /// A training backward: clears the pending-backward state.
    Backward,
}

/// How one function is treated.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct FunctionSpec {
    /// Input positions whose buffers have stable addresses (weights, KV caches): used in
    /// place, never copied; a changed address records a sibling node.
    pub static_inputs: Vec<usize>,
    /// Inference, forward or backward.
    pub mode: Mode,
    /// Overrides [`Config::warmups`] for this function.
    pub warmups: Option<u32>,
    /// Overrides [`Config::rerecord_limit`] for this function.
    pub rerecord_limit: Option<u32>,
    /// Never graph this function: always run it eagerly, outside the graph pool.
    pub eager_only: bool,
    /// The sizes this function is recorded at: every call passes its bucket as `keys[0]`
    /// (see [`Buckets`]).
    pub buckets: Option<Buckets>,
    /// At most this many recorded graphs of this function. When they are all there, a new
    /// signature of the function records only if it is used clearly more often than the least
    /// used of them, which it then evicts; otherwise it runs eagerly (see
    /// [`Config::max_graphs`]).
    pub max_graphs: Option<usize>,
    /// The body reads its inputs through handles of its own (a framework's tensors over the
    /// caller's buffers), not through [`Ctx::input`](crate::Ctx::input): an in-place input
    /// whose every use the graph cannot follow is then never copied into a placeholder
    /// (which the body would not read, replaying the recorded call's buffer); each move to
    /// an address no recording has records again instead, and a move on every call is named
    /// ([`Churn::InPlaceAddress`](crate::Churn::InPlaceAddress)). graft-candle sets it.
    pub never_copy_inputs: bool,
}

impl FunctionSpec {
    /// An inference function with the given static input positions.
    pub fn inference(static_inputs: impl Into<Vec<usize>>) -> FunctionSpec {
        FunctionSpec {
            static_inputs: static_inputs.into(),
            ..FunctionSpec::default()
        }
    }

    /// Sets the mode.
    pub fn mode(mut self, mode: Mode) -> FunctionSpec {
        self.mode = mode;
        self
    }

    /// Sets the warmup count.
    pub fn warmups(mut self, warmups: u32) -> FunctionSpec {
        self.warmups = Some(warmups);
        self
    }

    /// Sets the re-record limit.
    pub fn rerecord_limit(mut self, limit: u32) -> FunctionSpec {
        self.rerecord_limit = Some(limit);
        self
    }

    /// The body reads its inputs through handles of its own (see
    /// [`FunctionSpec::never_copy_inputs`]).
    pub fn never_copy_inputs(mut self) -> FunctionSpec {
        self.never_copy_inputs = true;
        self
    }

    /// Sets the buckets: calls pass their bucket as `keys[0]`.
    pub fn buckets(mut self, buckets: Buckets) -> FunctionSpec {
        self.buckets = Some(buckets);
        self
    }

    /// Limits the recorded graphs of this function.
    pub fn max_graphs(mut self, limit: usize) -> FunctionSpec {
        self.max_graphs = Some(limit);
        self
    }
}

/// One entry of the allow-list: a function name, and optionally the exact integer keys of
/// the signatures to graph.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AllowEntry {
    /// Function name as registered.
    pub function: String,
    /// Keys that must match exactly; `None` allows every signature of the function.
    pub keys: Option<Vec<u64>>,
}

/// Runtime-wide settings. `Config::default()` gives the documented defaults.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Config {
    /// Eager warmup runs per function and signature before it is recorded (default 1; 0
    /// records on the first call).
    pub warmups: u32,
    /// Unexpected re-recordings allowed per (parent node, function) before the pair runs
    /// eagerly for good (default 128).
    pub rerecord_limit: u32,
    /// Distinct signatures per function before graft warns once (default 8).
    pub signature_warn_limit: usize,
    /// Signatures per function that never recorded a graph (default 64; for a function with
    /// buckets, at least its number of buckets): a new one past this many takes the slot of
    /// the least recently used of them, so a key that changes on every call cannot grow a
    /// function's signatures without bound. A signature that recorded, or that learned it must
    /// run eagerly (a failed capture), is never recycled; nor is the one called last, so
    /// values below 2 act as 2. A recycled signature called again is new: it warms up again,
    /// so shapes that take turns in a cycle longer than this never finish their warmups:
    /// raise the bound, or bucket them.
    pub max_unrecorded_signatures: usize,
    /// Capture mode (default thread-local).
    pub capture_mode: CaptureMode,
    /// Copied inputs larger than this warn once per input (default 1 MiB).
    pub large_copy_warn_bytes: usize,
    /// When set, only these functions and signatures are graphed; others run eagerly.
    pub allow_list: Option<Vec<AllowEntry>>,
    /// Verify every replay against an eager run of the body from the same starting state
    /// (slow; for debugging). The inputs' bytes are snapshotted before the replay and
    /// written back before the eager run, so a body that updates its inputs in place (a
    /// training step) applies its update once; the caller keeps the eager run's result.
    pub verify_replays: bool,
    /// How many non-replay decisions `Graft::explain` keeps (default 64).
    pub decision_log: usize,
    /// Bytes of address space each of graft's two pools reserves (default 256 GiB). Address
    /// space costs no device memory; physical memory is mapped into it only as needed. It
    /// bounds the pool's live memory: raise it if an allocation reports the range exhausted.
    pub pool_reservation: usize,
    /// At most this many recorded graphs in the whole tree (default: no limit). Graft counts
    /// how often each signature and each graph is used, with counts that age (halved every
    /// [`Config::budget_window`] calls). When the budget is full, a new signature records
    /// only if it was used clearly more often (by a quarter, and by at least two calls) than
    /// the least used graph not on the current path (ties: the least recently used); it
    /// evicts that graph, with the graphs recorded under it: their executables are destroyed
    /// and their pool memory returns to the pool. Otherwise the call runs eagerly
    /// (`EagerReason::NotAdmitted`) and counts toward its signature's admission. Outputs a
    /// caller still holds stay readable until graft reuses their memory, and are invalidated
    /// before it does. A re-recording of a graph that is there (a static input moved) is not
    /// refused: it evicts the least used graph.
    pub max_graphs: Option<usize>,
    /// Calls of the runtime (replays included) after which the graph budget's use counts are
    /// halved (default 1024): how far back the budget remembers. A longer window tells close
    /// frequencies apart more surely; a shorter one follows a changing workload sooner.
    pub budget_window: u64,
    /// When a static input moved, the re-recording replaces the node recorded with the old
    /// address, updating its executable in place (`cuGraphExecUpdate`; instantiating when
    /// the device refuses), instead of recording a sibling next to it (default off: a
    /// sibling, so that both addresses keep replaying). Turn it on when static buffers move
    /// for good (weights reloaded, caches reallocated). Independently of this, a recording
    /// that the graph budget makes room for reuses the executable it evicted the same way.
    pub replace_moved_static: bool,
    /// Copied inputs of at least this many bytes that the graph only reads are not copied:
    /// the graph's kernels are patched to read the caller's buffer (default 64 KiB; `None`
    /// turns patching off). Smaller inputs keep their copy node, which costs little.
    pub patch_inputs_from: Option<usize>,
    /// Guards against host values baked into a recording (default on: `Guards::default()`;
    /// `None` turns them off). A recording's calls at the [`Guards`] schedule (calls 1, 2,
    /// 4, ... after it, then every `max_interval` calls) capture the body again instead of replaying and compare the
    /// capture with the recording node by node: kernels, launch configurations, every kernel
    /// argument's bytes (addresses as graft expects them to move), copies. Equal: the
    /// recording replays and the capture is dropped. Different: the call runs the new
    /// capture in the recording's place, the difference is reported once (a warning and
    /// `Graft::guard_findings`), and every later call of the signature runs eagerly
    /// (`EagerReason::HostValueBaked`). The
    /// body's host code runs once per guarded call, as on any call that records. A guarded
    /// call costs a capture and the compare (the capture is instantiated only where it differs);
    /// the others nothing but a counter compare. Guards are
    /// off in a group (`Graft::join`), in verify mode (every replay is verified instead), and
    /// on a device that cannot compare graphs (`Device::compare`). A replacement evicts the
    /// recordings made under the replaced one. `Graft::guard_next_call` guards one call on
    /// demand.
    pub guards: Option<Guards>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            warmups: 1,
            rerecord_limit: 128,
            signature_warn_limit: 8,
            max_unrecorded_signatures: 64,
            capture_mode: CaptureMode::ThreadLocal,
            large_copy_warn_bytes: 1 << 20,
            allow_list: None,
            verify_replays: false,
            decision_log: 64,
            pool_reservation: 256 << 30,
            max_graphs: None,
            budget_window: 1024,
            replace_moved_static: false,
            patch_inputs_from: Some(64 << 10),
            guards: Some(Guards::default()),
        }
    }
}
