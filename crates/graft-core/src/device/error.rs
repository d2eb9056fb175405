//! What a backend reports: `DeviceError`, with the operation that failed (`DeviceOp`) and CUDA's capture violations (`CaptureViolation`).

use std::fmt;

use crate::buffer_error::BufferError;

use super::types::DevicePtr;

/// The device operation that failed, for errors and capture-failure reasons.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum DeviceOp {
    /// Loading and initializing the driver, or opening a device on it (its context, runtime
    /// stream and allocation granularity).
    Init,
    /// Reserving address space for a pool.
    Reserve,
    /// Mapping physical memory into a reservation.
    Map,
    /// Unmapping physical memory from a reservation and releasing it.
    Unmap,
    /// Giving a reservation's address space back.
    ReleaseReservation,
    /// A raw device allocation made outside graft's pool.
    RawAlloc,
    /// A device-to-device copy on the runtime stream.
    Copy,
    /// A host-to-device write.
    Write,
    /// A device-to-host read.
    Read,
    /// A kernel launch.
    KernelLaunch,
    /// A stream or device synchronize.
    Synchronize,
    /// Querying whether work has finished (a stream or event query).
    Query,
    /// Work enqueued on a stream other than the runtime stream.
    OtherStream,
    /// Recording or waiting on an event.
    Event,
    /// Beginning a capture.
    BeginCapture,
    /// Ending a capture.
    EndCapture,
    /// Instantiating a captured graph.
    Instantiate,
    /// Uploading an instantiated graph.
    Upload,
    /// Launching an instantiated graph.
    GraphLaunch,
    /// Updating a node of an instantiated graph.
    GraphUpdate,
    /// Destroying a graph.
    GraphDestroy,
    /// Loading or compiling a kernel module.
    ModuleLoad,
    /// A collective among the devices of a group (an all-reduce), or making its communicator.
    Collective,
    /// Opening, switching or closing a conditional node (a device-side loop or branch).
    Conditional,
    /// Forking work onto the device's side stream or joining it back (`Ctx::fork`).
    Fork,
}

impl DeviceOp {
    /// A short lowercase name for messages.
    pub fn name(self) -> &'static str {
        match self {
            DeviceOp::Init => "driver initialization",
            DeviceOp::Reserve => "address reservation",
            DeviceOp::Map => "memory map",
            DeviceOp::Unmap => "memory unmap",
            DeviceOp::ReleaseReservation => "address reservation release",
            DeviceOp::RawAlloc => "raw device allocation",
            DeviceOp::Copy => "device-to-device copy",
            DeviceOp::Write => "host-to-device write",
            DeviceOp::Read => "device-to-host read",
            DeviceOp::KernelLaunch => "kernel launch",
            DeviceOp::Synchronize => "synchronize",
            DeviceOp::Query => "stream or event query",
            DeviceOp::OtherStream => "work on another stream",
            DeviceOp::Event => "event record or wait",
            DeviceOp::BeginCapture => "begin capture",
            DeviceOp::EndCapture => "end capture",
            DeviceOp::Instantiate => "graph instantiate",
            DeviceOp::Upload => "graph upload",
            DeviceOp::GraphLaunch => "graph launch",
            DeviceOp::GraphUpdate => "graph update",
            DeviceOp::GraphDestroy => "graph destroy",
            DeviceOp::ModuleLoad => "module load",
            DeviceOp::Collective => "collective",
            DeviceOp::Conditional => "conditional node",
            DeviceOp::Fork => "fork or join of the side stream",
        }
    }
}

impl fmt::Display for DeviceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why CUDA refused an operation during a capture (the `CUDA_ERROR_STREAM_CAPTURE_*` family).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum CaptureViolation {
    /// The operation is not permitted while capturing (`_UNSUPPORTED`).
    Unsupported,
    /// The capture was invalidated by an earlier error (`_INVALIDATED`).
    Invalidated,
    /// The capture would merge two independent captures (`_MERGE`).
    Merge,
    /// A dependency crossed the capture boundary (`_ISOLATION`).
    Isolation,
    /// Work forked from the capture stream was not joined back before the end (`_UNJOINED`).
    Unjoined,
    /// The legacy default stream was used implicitly (`_IMPLICIT`).
    Implicit,
    /// An event recorded in a capture was used outside it (`CUDA_ERROR_CAPTURED_EVENT`).
    CapturedEvent,
    /// The capture was ended from another thread (`_WRONG_THREAD`).
    WrongThread,
}

impl CaptureViolation {
    /// What the user should do about it.
    pub fn advice(self) -> &'static str {
        match self {
            CaptureViolation::Unsupported => {
                "remove host synchronization, host reads and raw allocations from the function, or register it eager-only"
            }
            CaptureViolation::Invalidated => {
                "an earlier operation in the body broke the capture; fix that operation first"
            }
            CaptureViolation::Merge | CaptureViolation::Isolation => {
                "do not make captured work wait on events or streams from outside the capture"
            }
            CaptureViolation::Unjoined => {
                "join every side stream back into the runtime stream before the body returns"
            }
            CaptureViolation::Implicit => {
                "launch on graft's runtime stream, not the legacy default stream"
            }
            CaptureViolation::CapturedEvent => {
                "do not query or synchronize on events recorded inside the body"
            }
            CaptureViolation::WrongThread => "return from the body on the thread that called graft",
        }
    }
}

impl fmt::Display for CaptureViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            CaptureViolation::Unsupported => "not permitted during capture",
            CaptureViolation::Invalidated => "capture already invalidated",
            CaptureViolation::Merge => "captures would merge",
            CaptureViolation::Isolation => "dependency crosses the capture boundary",
            CaptureViolation::Unjoined => "forked work not joined",
            CaptureViolation::Implicit => "implicit use of the legacy stream",
            CaptureViolation::CapturedEvent => "captured event used outside the capture",
            CaptureViolation::WrongThread => "capture ended on another thread",
        };
        f.write_str(s)
    }
}

/// What a conditional node's body may not hold (CUDA refuses these in a conditional body at
/// instantiation; graft refuses them when the body enqueues them, or when the body ends).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ConditionalRule {
    /// A stream-ordered allocation the body does not free before it ends (a memory node that
    /// would outlive an iteration).
    Allocation,
    /// An event record or wait node, or work forked to another stream.
    Event,
    /// A collective (NCCL records event nodes of its own, which conditional bodies refuse).
    Collective,
    /// Another kind of node a conditional body cannot hold (a host callback, a semaphore, a
    /// child graph, ...).
    Node,
    /// A conditional opened inside another's body (CUDA's bodies are captured as graphs of
    /// their own, and a graph holding a conditional node cannot be placed in another body).
    Nested,
}

impl ConditionalRule {
    /// What the user should do about it.
    pub fn advice(self) -> &'static str {
        match self {
            ConditionalRule::Allocation => {
                "allocate what must outlive an iteration before the loop (ctx.alloc), and drop every tensor made inside it"
            }
            ConditionalRule::Event => "keep the body on the runtime stream, with no events",
            ConditionalRule::Collective => {
                "run the collective outside the loop, or loop on the host (one replay per step)"
            }
            ConditionalRule::Node => "keep the body to kernels and device copies",
            ConditionalRule::Nested => {
                "keep one level of device conditionals: move the inner loop or branch out of the body, or run it as straight-line work"
            }
        }
    }
}

impl fmt::Display for ConditionalRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConditionalRule::Allocation => "an allocation that outlives the body",
            ConditionalRule::Event => "an event or another stream",
            ConditionalRule::Collective => "a collective",
            ConditionalRule::Node => "a node of a kind conditional bodies cannot hold",
            ConditionalRule::Nested => "a conditional inside another conditional's body",
        })
    }
}

/// Where a fork of the side stream is refused (`Ctx::fork`, [`Device::fork`](super::Device::fork)).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ForkRule {
    /// A fork opened while another is open (forks do not nest).
    Nested,
    /// A fork opened inside a conditional body (conditional bodies hold no events or other
    /// streams), or a conditional opened inside a fork.
    InConditional,
    /// A join with no fork open.
    NotForked,
    /// The side stream's queue used while no fork is open during a capture: the work would
    /// not be captured (CUDA leaves it out of the graph, or fails the capture).
    SideOutsideFork,
}

impl ForkRule {
    /// What the user should do about it.
    pub fn advice(self) -> &'static str {
        match self {
            ForkRule::Nested => {
                "fork once at a time: put all side-stream work of the region into one ctx.fork"
            }
            ForkRule::InConditional => {
                "fork outside device-side loops and branches, or keep the conditional's body on the runtime stream"
            }
            ForkRule::NotForked => "join only after a fork; use ctx.fork, which pairs them",
            ForkRule::SideOutsideFork => "use the side queue only inside ctx.fork's side closure",
        }
    }
}

impl fmt::Display for ForkRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ForkRule::Nested => "a fork inside another fork",
            ForkRule::InConditional => "a fork and a conditional nested in each other",
            ForkRule::NotForked => "a join with no fork open",
            ForkRule::SideOutsideFork => "side-stream work outside a fork",
        })
    }
}

/// An error reported by a backend. Every variant names the operation that failed.
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum DeviceError {
    /// The device has no memory for the request.
    #[error(
        "{op} of {bytes} bytes failed: out of device memory; free buffers you hold or lower the batch size"
    )]
    OutOfMemory {
        /// The failing operation.
        op: DeviceOp,
        /// Bytes requested.
        bytes: usize,
    },
    /// The operation is illegal while a graph is being captured.
    #[error("{op} during graph capture failed ({violation}); {}", violation.advice())]
    Capture {
        /// The failing operation.
        op: DeviceOp,
        /// CUDA's reason.
        violation: CaptureViolation,
    },
    /// A fault injected on purpose by a test backend.
    #[error("{op} failed: fault injected by the simulator for testing")]
    Injected {
        /// The failing operation.
        op: DeviceOp,
    },
    /// An operation touched memory that is not allocated on this device.
    #[error(
        "{op} touched {addr}+{len} bytes, which is not allocated device memory; a buffer was used after it was freed or out of bounds"
    )]
    InvalidAddress {
        /// The failing operation.
        op: DeviceOp,
        /// First address touched.
        addr: DevicePtr,
        /// Bytes touched.
        len: usize,
    },
    /// A device copy whose source and destination overlap (undefined in CUDA).
    #[error(
        "{op} of {len} bytes from {src} to {dst} overlaps itself, which CUDA leaves undefined; copy through a separate buffer"
    )]
    OverlappingCopy {
        /// The failing operation.
        op: DeviceOp,
        /// Destination.
        dst: DevicePtr,
        /// Source.
        src: DevicePtr,
        /// Bytes.
        len: usize,
    },
    /// The arguments of a call break the device layer's rules, checked before the driver sees
    /// them: for memory (see the module's Memory section) an unaligned or empty range, one
    /// outside a reservation, mapping memory twice, unmapping memory that is not mapped; for
    /// launches a kernel index out of range, arguments that do not match the kernel's
    /// parameters, a zero grid, a dimension too large, a NUL in a name, a graph, module or
    /// buffer of another device.
    #[error("{op} refused: {what}; this is a bug in the caller of the device layer")]
    InvalidArgument {
        /// The failing operation.
        op: DeviceOp,
        /// What was wrong, lowercase.
        what: &'static str,
    },
    /// A buffer passed to a typed launch can no longer be used: graft reused or freed its
    /// memory. The buffer error says what happened and what to do.
    #[error("{op} refused a buffer argument: {source}")]
    InvalidBuffer {
        /// The failing operation.
        op: DeviceOp,
        /// Why the buffer can no longer be used.
        source: BufferError,
    },
    /// A conditional node's body holds what conditional bodies cannot (see
    /// [`ConditionalRule`]). The capture is invalidated: graft runs the call eagerly (the
    /// loop on the host) from then on.
    #[error("{op} refused: a conditional body holds {rule}; {}", rule.advice())]
    Conditional {
        /// The failing operation.
        op: DeviceOp,
        /// What the body held.
        rule: ConditionalRule,
    },
    /// A fork or join of the side stream broke the rules of forks (see [`ForkRule`]). During a
    /// capture it invalidates the capture.
    #[error("{op} refused: {rule}; {}", rule.advice())]
    Fork {
        /// The failing operation.
        op: DeviceOp,
        /// The rule broken.
        rule: ForkRule,
    },
    /// Between a fork and its join, one stream wrote bytes the other stream read or wrote: the
    /// two streams run concurrently, so the result depends on timing. Reported by the
    /// simulator at the join (eager) or when the graph holding the fork runs.
    #[error(
        "{op} found a race between the runtime and side streams of a fork: both touch {addr}+{len} bytes before the join and at least one writes them; give each stream its own buffers, or move the dependent work after the join"
    )]
    StreamRace {
        /// The failing operation.
        op: DeviceOp,
        /// First byte both streams touch.
        addr: DevicePtr,
        /// Bytes of the overlap.
        len: usize,
    },
    /// A kernel launched as a programmatic dependent touched, before its wait, bytes that a
    /// kernel it may overlap (the one before it, or one still running further up its chain
    /// of dependents) writes, or wrote bytes that kernel reads: the result depends on timing.
    /// Reported by the simulator when the dependent reaches its wait.
    #[error(
        "{op} found a race in a programmatic launch: kernel {dependent} touches {addr}+{len} bytes before its wait while kernel {predecessor}, which may still run, touches them and one of the two writes; move the access after the wait (griddepcontrol.wait), or launch {dependent} plainly"
    )]
    ProgrammaticRace {
        /// The failing operation.
        op: DeviceOp,
        /// The dependent kernel.
        dependent: &'static str,
        /// The kernel it may overlap.
        predecessor: &'static str,
        /// First byte both touch.
        addr: DevicePtr,
        /// Bytes of the overlap.
        len: usize,
    },
    /// A capture call made in the wrong state (ending with none begun, beginning twice).
    #[error("{op} called while {state}; this is a bug in the caller of the device layer")]
    CaptureState {
        /// The failing operation.
        op: DeviceOp,
        /// The state the stream was in.
        state: &'static str,
    },
    /// A library or driver entry point the operation needs is missing: libcuda, libcublas,
    /// libnvrtc or libnccl cannot be loaded, the driver is too old to export a function, or
    /// the library is configured in a way graft cannot run safely (NCCL's lazy connection).
    #[error("{op} failed: {what}")]
    Unavailable {
        /// The failing operation.
        op: DeviceOp,
        /// What is missing and what to install, lowercase.
        what: &'static str,
    },
    /// Kernel source did not compile (NVRTC); the log says why.
    #[error(
        "{op} failed: the kernel source did not compile; fix the source. The compiler's log:\n{log}"
    )]
    Compile {
        /// The failing operation.
        op: DeviceOp,
        /// The compiler's log.
        log: std::sync::Arc<str>,
    },
    /// A CUDA library (cuBLAS) returned an error status, with the library's code and name.
    #[error(
        "{op} failed with {library} status {name} ({code}); check the call's sizes and the device's state"
    )]
    Library {
        /// The failing operation.
        op: DeviceOp,
        /// The library, e.g. "cuBLAS".
        library: &'static str,
        /// The library's numeric status.
        code: u32,
        /// The status's name, e.g. "CUBLAS_STATUS_INVALID_VALUE".
        name: &'static str,
    },
    /// A collective waited past its timeout for ranks that never joined it: the simulator's
    /// stand-in for what would be a hang on GPUs.
    #[error(
        "{op} on rank {rank} waited {waited:?} for ranks {missing:?}, which never joined it; a rank skipped work that the others ran: drive every rank with the same calls (the communicator is now aborted)"
    )]
    CollectiveTimeout {
        /// The failing operation.
        op: DeviceOp,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: std::time::Duration,
        /// The ranks that did not join.
        missing: Vec<usize>,
    },
    /// A collective (or a communicator's setup) waited past its deadline for peers the
    /// library cannot name (NCCL reports only that the operation has not completed); the
    /// communicator was aborted.
    #[error(
        "{op} on rank {rank} waited {waited:?} for its peers, and not all came (the library cannot tell which ranks are missing); the communicator is now aborted: drive every rank with the same calls, then make new communicators (and new processes where ranks are processes)"
    )]
    CollectiveUnanswered {
        /// The failing operation.
        op: DeviceOp,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// A collective lost its connection to another rank (its process ended, or the network
    /// failed); the communicator was aborted.
    #[error(
        "{op} on rank {rank} lost rank {peer}: its process ended or the network failed; the communicator is now aborted: make new communicators (and new processes)"
    )]
    CollectivePeerLost {
        /// The failing operation.
        op: DeviceOp,
        /// The rank that noticed.
        rank: usize,
        /// The rank it lost.
        peer: usize,
    },
    /// The communicator was aborted after an earlier failure; no collective runs on it again.
    #[error("{op} refused: the communicator was aborted after an earlier failure; make a new one")]
    CollectiveAborted {
        /// The failing operation.
        op: DeviceOp,
    },
    /// An error `CUresult` from the CUDA driver, with its code and name (the simulator reports
    /// the driver's code for the same failures).
    #[error(
        "{op} failed with driver error {name} ({code}); check the device's state and driver logs"
    )]
    Driver {
        /// The failing operation.
        op: DeviceOp,
        /// The numeric driver error code.
        code: u32,
        /// The driver error's name.
        name: &'static str,
    },
}

impl DeviceError {
    /// The operation that failed.
    pub fn op(&self) -> DeviceOp {
        match self {
            DeviceError::OutOfMemory { op, .. }
            | DeviceError::Capture { op, .. }
            | DeviceError::Injected { op }
            | DeviceError::InvalidAddress { op, .. }
            | DeviceError::OverlappingCopy { op, .. }
            | DeviceError::CaptureState { op, .. }
            | DeviceError::Conditional { op, .. }
            | DeviceError::Fork { op, .. }
            | DeviceError::StreamRace { op, .. }
            | DeviceError::ProgrammaticRace { op, .. }
            | DeviceError::InvalidArgument { op, .. }
            | DeviceError::InvalidBuffer { op, .. }
            | DeviceError::Unavailable { op, .. }
            | DeviceError::Compile { op, .. }
            | DeviceError::Library { op, .. }
            | DeviceError::CollectiveTimeout { op, .. }
            | DeviceError::CollectiveUnanswered { op, .. }
            | DeviceError::CollectivePeerLost { op, .. }
            | DeviceError::CollectiveAborted { op }
            | DeviceError::Driver { op, .. } => *op,
        }
    }
}
