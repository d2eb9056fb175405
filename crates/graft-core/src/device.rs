//! The hardware layer: the small trait every backend implements. Backends execute; they decide nothing.
//!
//! # Capture lifecycle
//!
//! Core drives a capture in these steps, and a backend must accept exactly this order:
//!
//! 1. [`Device::begin_capture`] puts the runtime stream into capture mode. From here on, work
//!    enqueued on the runtime stream (kernels, [`Device::copy`]) is recorded, not run.
//! 2. The registered function's body enqueues its work. Pool growth may call
//!    [`Device::reserve`] and [`Device::map`] during the capture; a backend must make that legal
//!    (CUDA: switch the calling thread to relaxed capture mode around the driver calls, as
//!    PyTorch's allocator does).
//!    Anything the body does that CUDA forbids during capture (a synchronize, a read to the host,
//!    a raw allocation, work on another stream left unjoined) fails with
//!    [`DeviceError::Capture`] and leaves the capture invalidated.
//! 3. On success core calls [`Device::end_capture`], which ends the capture, instantiates the
//!    graph and uploads it, returning a [`Device::Graph`] ready to launch.
//!    On failure core calls [`Device::abort_capture`] instead, which ends the capture whatever
//!    its state and discards the partial graph; after it the stream is usable eagerly again.
//! 4. [`Device::launch`] replays the graph on the runtime stream: every operation runs again at
//!    the addresses it was recorded with. Dropping the graph destroys it; errors from that go to
//!    the sticky error slot.
//!
//! # Memory
//!
//! Graft's pools hold device memory through virtual memory management (CUDA VMM): each pool
//! reserves one large range of address space and maps physical memory into it and out of it
//! on demand, in units of [`Device::granularity`] bytes. A backend implements four calls with
//! these rules:
//!
//! - [`Device::reserve`] takes `bytes` (a positive multiple of the granularity) of address space
//!   only, aligned to the granularity. It is legal during a capture.
//! - [`Device::map`] backs a granularity-aligned, currently unmapped range inside a reservation
//!   with new physical memory, readable and writable by the device. Its contents are
//!   unspecified (the simulator poisons them). It is legal during a capture. The backend keeps one
//!   physical allocation per granule, so any granule-aligned sub-range can be unmapped later.
//! - [`Device::unmap`] waits for stream work that may use the memory, then unmaps a mapped,
//!   granularity-aligned range and releases its physical memory. Never called during a capture.
//! - [`Device::release_reservation`] gives back a whole reservation, every byte of which must
//!   be unmapped first. Never called during a capture.
//!
//! Misuse (a range that is unaligned, empty, outside a reservation, mapped twice, or unmapped
//! while not mapped) is [`DeviceError::InvalidArgument`], never undefined behaviour. Once
//! mapped, an address stays valid until it is unmapped, so a recorded graph may keep using it.

use std::fmt;

use crate::buffer::BufferError;

/// A device address. Plain integer arithmetic on it is meaningful: ranges, overlap, offsets.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` past this one.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Identifies one device instance, so that core can reject a buffer of another device.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct DeviceId(pub u64);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device#{}", self.0)
    }
}

/// How a capture treats potentially unsafe API calls made by other threads (CUDA's
/// `CUstreamCaptureMode`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum CaptureMode {
    /// Unsafe calls from any thread fail while the capture is underway.
    Global,
    /// Unsafe calls fail only on the capturing thread (the default: a data-loading thread can keep working).
    #[default]
    ThreadLocal,
    /// Nothing is checked; the caller promises to make no unsafe call.
    Relaxed,
}

/// The device operation that failed, for errors and capture-failure reasons.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum DeviceOp {
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
}

impl DeviceOp {
    /// A short lowercase name for messages.
    pub fn name(self) -> &'static str {
        match self {
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
            | DeviceError::InvalidArgument { op, .. }
            | DeviceError::InvalidBuffer { op, .. }
            | DeviceError::Unavailable { op, .. }
            | DeviceError::Compile { op, .. }
            | DeviceError::Library { op, .. }
            | DeviceError::CollectiveTimeout { op, .. }
            | DeviceError::CollectiveAborted { op }
            | DeviceError::Driver { op, .. } => *op,
        }
    }
}

/// Why a device refused to update an executable graph in place (CUDA's
/// `CUgraphExecUpdateResult`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum UpdateRefusal {
    /// Nodes were added or removed, or their dependencies changed.
    TopologyChanged,
    /// A node has another kind (kernel, copy, ...).
    NodeTypeChanged,
    /// A kernel node runs another function.
    FunctionChanged,
    /// A parameter that cannot change in place changed (a copy's length, ...).
    ParametersChanged,
    /// The device cannot update in place at all, or not this kind of node.
    NotSupported,
    /// An attribute of a node changed.
    AttributesChanged,
    /// The driver reported another reason.
    Other,
}

impl fmt::Display for UpdateRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UpdateRefusal::TopologyChanged => "the graph's topology changed",
            UpdateRefusal::NodeTypeChanged => "a node changed kind",
            UpdateRefusal::FunctionChanged => "a kernel node runs another function",
            UpdateRefusal::ParametersChanged => "a parameter changed that cannot change in place",
            UpdateRefusal::NotSupported => "the device does not update this graph in place",
            UpdateRefusal::AttributesChanged => "a node's attributes changed",
            UpdateRefusal::Other => "the driver refused for another reason",
        })
    }
}

/// The two ends of a device-to-device copy recorded in a graph (see [`Device::repoint_copy`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CopyEnds {
    /// Where the copy writes.
    pub dst: DevicePtr,
    /// Where it reads.
    pub src: DevicePtr,
}

/// How many nodes of each kind a captured graph holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct GraphSummary {
    /// Kernel nodes.
    pub kernels: usize,
    /// Memory copy nodes.
    pub copies: usize,
    /// Memset nodes.
    pub memsets: usize,
    /// Every other node kind.
    pub other: usize,
}

/// The hardware layer core is written against.
///
/// A backend owns one runtime stream on one device. All methods enqueue on that stream in call
/// order; "synchronous" methods also wait for it. Methods take `&self`: backends use interior
/// mutability and must be callable from the thread that drives graft while buffers are dropped
/// on others.
pub trait Device: Send + Sync + 'static {
    /// An instantiated, uploaded, executable graph. Dropping it destroys it; a failure there
    /// goes to the sticky error slot.
    type Graph: Send + Sync + 'static;

    /// The body-facing handle: what a registered function's body gets from
    /// [`Ctx::queue`](crate::Ctx::queue). It enqueues work on the runtime stream (kernels,
    /// library calls, copies) and reads and writes memory, and it offers no way back to the
    /// device: nothing on it changes capture, memory mapping, graphs or the sticky error slot,
    /// which core alone drives through this trait.
    type Queue: Send + Sync + 'static;

    /// The body-facing handle of this device (see [`Device::Queue`]).
    fn queue(&self) -> &Self::Queue;

    /// This device instance's identity.
    fn id(&self) -> DeviceId;

    /// A human-readable description, e.g. "NVIDIA H100 80GB HBM3 (cuda:0)" or "host simulator".
    fn describe(&self) -> String;

    /// The physical mapping granularity in bytes: a power of two, a multiple of 512 (CUDA: the
    /// recommended granularity, 2 MiB on an H100). Constant for the device's life.
    fn granularity(&self) -> usize;

    /// Reserves `bytes` of address space, with no memory behind it (see the module's Memory
    /// section). `bytes` must be a positive multiple of [`Device::granularity`]; the result is
    /// aligned to it. Legal during a capture.
    fn reserve(&self, bytes: usize) -> Result<DevicePtr, DeviceError>;

    /// Gives back a whole reservation made by [`Device::reserve`] (`addr` and `bytes` as it
    /// was made). Every byte of it must be unmapped first. Never called during a capture.
    fn release_reservation(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Maps new physical memory, readable and writable by the device, at the granularity-aligned,
    /// currently unmapped range `addr..addr+bytes` inside one reservation. Must be legal during a
    /// capture (step 2 of the capture lifecycle). If it fails, nothing of the range is mapped.
    fn map(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Waits for stream work that may use the memory, then unmaps the mapped,
    /// granularity-aligned range `addr..addr+bytes` and releases its physical memory. Any
    /// granule-aligned sub-range of earlier maps may be unmapped. Never called during a capture.
    fn unmap(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Enqueues a device-to-device copy of `bytes` on the runtime stream (captured when capturing).
    /// Overlapping ranges are an error, never undefined.
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Copies host bytes to the device, synchronously with respect to the runtime stream.
    /// Fails during a capture.
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError>;

    /// Copies device bytes to the host after the runtime stream's earlier work. Fails during a
    /// capture.
    fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Waits until all work on the runtime stream has finished. Fails during a capture.
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Step 1 of the capture lifecycle.
    fn begin_capture(&self, mode: CaptureMode) -> Result<(), DeviceError>;

    /// Step 3: ends the capture, instantiates and uploads the graph. The capture is over
    /// whether this succeeds or fails (as with `cuStreamEndCapture`): do not abort after it.
    fn end_capture(&self) -> Result<Self::Graph, DeviceError>;

    /// Step 3 for a re-recording that replaces `graph`: ends the capture and makes `graph` run
    /// the captured work. When the capture has the topology `graph` was made from (the same
    /// nodes in the same order, only addresses and scalar arguments changed) the backend
    /// updates `graph`'s executable in place (CUDA: `cuGraphExecUpdate`), far cheaper than an
    /// instantiation, and returns `None`. Otherwise it instantiates the capture as
    /// [`Device::end_capture`] does, replaces `graph` with it and returns why the update was
    /// refused. On error `graph` is unchanged and the capture is over.
    ///
    /// The default refuses every update.
    fn end_capture_into(
        &self,
        graph: &mut Self::Graph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        *graph = self.end_capture()?;
        Ok(Some(UpdateRefusal::NotSupported))
    }

    /// Step 3 on failure: ends the capture in whatever state it is and discards it.
    fn abort_capture(&self) -> Result<(), DeviceError>;

    /// Step 4: launches the graph on the runtime stream.
    fn launch(&self, graph: &Self::Graph) -> Result<(), DeviceError>;

    /// Re-points a copy the capture recorded with [`Device::copy`]: the copy whose ends are
    /// `recorded` (as recorded, or as last re-pointed) copies between the ends of `now` from the
    /// next launch on, with the same length. Graft records each copied input as a copy into its
    /// placeholder at the start of the graph (and, for an input the body writes, a copy back at
    /// the end) and re-points them when the caller's buffer moves. Fails if the graph has no
    /// copy with these ends.
    fn repoint_copy(
        &self,
        graph: &mut Self::Graph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError>;

    /// Moves a range the graph uses to other memory, from the next launch on: every node that
    /// reads or writes the `len` bytes at `from` (as recorded) uses the same offsets at `to`
    /// instead; `to = None` undoes it. Two uses:
    ///
    /// - copy-free inputs: `from` is a copied input's placeholder and `copy` the copy that
    ///   fills it at the start of the graph (its ends as last re-pointed), which is turned off
    ///   while the redirect is in force. Graft asks only for inputs the graph does not write,
    ///   with `to` outside the memory the graph writes;
    /// - in-place inputs: `from` is the caller's buffer as it was when the graph was recorded
    ///   (the body used it directly), `copy` is `None`, and `to` is the caller's buffer of
    ///   this call. Graft first asks with `to = Some(from)` right after the recording, to learn
    ///   whether the backend can follow every use; then on each call whose buffer moved.
    ///
    /// Returns `false`, changing nothing, when the backend cannot find and move every use of
    /// the range (a graph that then keeps copying, or replays only at the recorded address).
    ///
    /// The default moves nothing.
    fn redirect(
        &self,
        graph: &mut Self::Graph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        let _ = (graph, from, len, copy);
        Ok(to.is_none())
    }

    /// Counts the nodes of a graph by kind.
    fn summarize(&self, graph: &Self::Graph) -> Result<GraphSummary, DeviceError>;

    /// Takes the first error recorded by a `Drop` since the last call, if any. Called on
    /// every graft call: keep it to an atomic load when there is none.
    fn take_sticky_error(&self) -> Option<DeviceError>;

    /// Records an error that could not be returned (it happened in a `Drop`).
    fn record_sticky_error(&self, error: DeviceError);
}

/// The sticky per-device error slot: `Drop` impls, which cannot return errors, put them here,
/// and the next fallible call on the device returns the first one. Backends embed one.
#[derive(Debug, Default)]
pub struct StickyError(std::sync::Mutex<Option<DeviceError>>);

impl StickyError {
    /// Records `err` unless an earlier error is still waiting to be taken.
    pub fn record(&self, err: DeviceError) {
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        slot.get_or_insert(err);
    }

    /// Takes the waiting error, if any.
    pub fn take(&self) -> Option<DeviceError> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}
