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
//!    its state and discards the partial graph, and says whether an operation capture forbids
//!    had invalidated it; after it the stream is usable eagerly again.
//!
//!    Inside step 2 the body may open conditional nodes (device-side loops and branches,
//!    [`Conditional`]): [`Device::begin_conditional`] ends the work captured so far at a
//!    conditional node whose selector is read from device memory, and captures what follows
//!    into its first body; [`Device::next_branch`] moves to its next body;
//!    [`Device::end_conditional`] closes the node (for a loop, after re-reading the selector at
//!    the end of the body), and capture goes on after it. They nest. Core calls them only
//!    during a capture, `next_branch` exactly `branches() - 1` times, and
//!    `end_conditional` once per `begin_conditional` unless the capture is aborted, which
//!    discards open conditionals with the rest.
//!    Inside step 2 the body may also fork work onto the device's side stream
//!    ([`Device::side_queue`]): [`Device::fork`] records an event on the runtime stream and
//!    makes the side stream wait for it, which during a capture pulls the side stream into the
//!    capture; work enqueued on the side queue afterwards runs after everything the runtime
//!    stream had before the fork, concurrently with what follows on the runtime stream.
//!    [`Device::join`] records an event on the side stream and makes the runtime stream wait for
//!    it. Core calls them in pairs (`Ctx::fork`), one fork at a time (no nesting), never inside a
//!    conditional body and never opening a conditional while forked. The same pair works
//!    eagerly (outside a capture). [`Device::end_capture`] with a fork still open fails with
//!    [`CaptureViolation::Unjoined`] (CUDA's `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`), and
//!    [`Device::abort_capture`] closes an open fork with the rest of the capture. A recorded
//!    graph holding a fork is one graph: it replays with one [`Device::launch`].
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
//!
//! # Sealed methods
//!
//! See [`Device`]: most methods take a [`CoreOnly`] token, which only core makes.

mod difference;
mod error;
mod seal;
mod sticky;
mod types;

pub use difference::GraphDifference;
pub use error::{CaptureViolation, ConditionalRule, DeviceError, DeviceOp, ForkRule};
pub(crate) use seal::CORE;
pub use seal::CoreOnly;
pub use sticky::StickyError;
pub use types::{
    CaptureMode, Conditional, CopyEnds, DeviceId, DevicePtr, GraphSummary, UpdateRefusal,
};

/// The hardware layer core is written against.
///
/// A backend owns one runtime stream on one device. All methods enqueue on that stream in call
/// order; "synchronous" methods also wait for it. Methods take `&self`: backends use interior
/// mutability and must be callable from the thread that drives graft while buffers are dropped
/// on others.
///
/// Every method that changes capture, memory mapping, graphs or the sticky error slot, or
/// touches memory at raw addresses, takes a [`CoreOnly`] token first, and only graft-core can
/// make one: framework code and bodies may hold the device (or its queue) and bound types by
/// this trait, but can call only `queue`, `side_queue`, `id`, `describe`, `granularity`,
/// `synchronize` and `summarize`. Backends ignore the token.
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
    fn reserve(&self, core: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError>;

    /// Gives back a whole reservation made by [`Device::reserve`] (`addr` and `bytes` as it
    /// was made). Every byte of it must be unmapped first. Never called during a capture.
    fn release_reservation(
        &self,
        core: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError>;

    /// Maps new physical memory, readable and writable by the device, at the granularity-aligned,
    /// currently unmapped range `addr..addr+bytes` inside one reservation. Must be legal during a
    /// capture (step 2 of the capture lifecycle). If it fails, nothing of the range is mapped.
    fn map(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Waits for stream work that may use the memory, then unmaps the mapped,
    /// granularity-aligned range `addr..addr+bytes` and releases its physical memory. Any
    /// granule-aligned sub-range of earlier maps may be unmapped. Never called during a capture.
    fn unmap(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;

    /// Enqueues a device-to-device copy of `bytes` on the runtime stream (captured when capturing).
    /// Overlapping ranges are an error, never undefined.
    fn copy(
        &self,
        core: &CoreOnly,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError>;

    /// Copies host bytes to the device, synchronously with respect to the runtime stream.
    /// Fails during a capture.
    fn write(&self, core: &CoreOnly, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError>;

    /// Copies device bytes to the host after the runtime stream's earlier work. Fails during a
    /// capture.
    fn read(&self, core: &CoreOnly, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Waits until all work on the runtime stream has finished. Fails during a capture.
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Step 1 of the capture lifecycle.
    fn begin_capture(&self, core: &CoreOnly, mode: CaptureMode) -> Result<(), DeviceError>;

    /// Step 3: ends the capture, instantiates and uploads the graph. The capture is over
    /// whether this succeeds or fails (as with `cuStreamEndCapture`): do not abort after it.
    fn end_capture(&self, core: &CoreOnly) -> Result<Self::Graph, DeviceError>;

    /// Step 3 for a capture made to be compared with a recording (a guard's): ends the capture
    /// as [`Device::end_capture`] does but neither instantiates nor uploads it, so that a
    /// capture equal to its recording, which is dropped, costs neither (nor the memory an
    /// upload maps for its allocations). Such a graph can be compared and summarized; it
    /// launches, is patched or updated only after [`Device::prepare_launch`]. The default
    /// ends the capture as `end_capture` does.
    fn end_capture_to_compare(&self, core: &CoreOnly) -> Result<Self::Graph, DeviceError> {
        self.end_capture(core)
    }

    /// Instantiates and uploads a graph [`Device::end_capture_to_compare`] ended, so that it
    /// can launch; nothing for a graph that already can. On error the graph is unchanged and
    /// still cannot launch. The default does nothing.
    fn prepare_launch(&self, core: &CoreOnly, graph: &mut Self::Graph) -> Result<(), DeviceError> {
        let _ = (core, graph);
        Ok(())
    }

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
        core: &CoreOnly,
        graph: &mut Self::Graph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        *graph = self.end_capture(core)?;
        Ok(Some(UpdateRefusal::NotSupported))
    }

    /// Whether captures may hold conditional nodes ([`Device::begin_conditional`]). A
    /// framework asks before choosing a device-side loop over one replay per step.
    fn supports_conditionals(&self) -> bool {
        false
    }

    /// Opens a conditional node of kind `kind` at this point of the capture, whose selector is
    /// the `u32` at `selector` (read on the device when the node runs), and starts capturing
    /// its first body (see the module's capture lifecycle). The default refuses: the device
    /// has no conditional nodes.
    fn begin_conditional(
        &self,
        core: &CoreOnly,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        let _ = (core, kind, selector);
        Err(DeviceError::Unavailable {
            op: DeviceOp::Conditional,
            what: "this device has no conditional graph nodes (CUDA 12.4 or later has them); loop on the host instead",
        })
    }

    /// Ends the body being captured and starts capturing the next body of the open
    /// conditional node.
    fn next_branch(&self, core: &CoreOnly) -> Result<(), DeviceError> {
        let _ = core;
        Err(DeviceError::CaptureState {
            op: DeviceOp::Conditional,
            state: "no conditional node is open",
        })
    }

    /// Ends the last body of the open conditional node (a loop's re-reads the selector as its
    /// last work) and goes on capturing after the node. Refuses a body that holds what
    /// conditional bodies cannot ([`DeviceError::Conditional`]).
    fn end_conditional(&self, core: &CoreOnly) -> Result<(), DeviceError> {
        let _ = core;
        Err(DeviceError::CaptureState {
            op: DeviceOp::Conditional,
            state: "no conditional node is open",
        })
    }

    /// The body-facing queue of the device's side stream: the same [`Device::Queue`] type,
    /// enqueuing on the side stream. Bodies reach it only through `Ctx::fork`. The default has
    /// none.
    fn side_queue(&self) -> Option<&Self::Queue> {
        None
    }

    /// Forks the side stream off the runtime stream (see the module's capture lifecycle):
    /// records an event on the runtime stream and makes the side stream wait for it (CUDA:
    /// `cuEventRecord` on the runtime stream, `cuStreamWaitEvent` on the side stream). Legal
    /// eagerly and during a capture, outside conditional bodies. A fork while forked is
    /// [`DeviceError::Fork`]. The default refuses: the device has no side stream.
    fn fork(&self, core: &CoreOnly) -> Result<(), DeviceError> {
        let _ = core;
        Err(DeviceError::Unavailable {
            op: DeviceOp::Fork,
            what: "this device has no side stream; enqueue the work on the runtime stream (ctx.queue())",
        })
    }

    /// Joins the side stream back: records an event on the side stream and makes the runtime
    /// stream wait for it. A join with no fork open is [`DeviceError::Fork`]. The default
    /// refuses, as [`Device::fork`] does.
    fn join(&self, core: &CoreOnly) -> Result<(), DeviceError> {
        let _ = core;
        Err(DeviceError::Unavailable {
            op: DeviceOp::Fork,
            what: "this device has no side stream; enqueue the work on the runtime stream (ctx.queue())",
        })
    }

    /// Step 3 on failure: ends the capture in whatever state it is and discards it. Returns
    /// whether an operation the capture forbids had invalidated it (so core can tell a
    /// capture violation from a body's own error, however the body wrapped the former).
    fn abort_capture(&self, core: &CoreOnly) -> Result<bool, DeviceError>;

    /// Step 4: launches the graph on the runtime stream.
    fn launch(&self, core: &CoreOnly, graph: &Self::Graph) -> Result<(), DeviceError>;

    /// Re-points a copy the capture recorded with [`Device::copy`]: the copy whose ends are
    /// `recorded` (as recorded, or as last re-pointed) copies between the ends of `now` from the
    /// next launch on, with the same length. Graft records each copied input as a copy into its
    /// placeholder at the start of the graph (and, for an input the body writes, a copy back at
    /// the end) and re-points them when the caller's buffer moves. Fails if the graph has no
    /// copy with these ends.
    fn repoint_copy(
        &self,
        core: &CoreOnly,
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
        core: &CoreOnly,
        graph: &mut Self::Graph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        let _ = (core, graph, from, len, copy);
        Ok(to.is_none())
    }

    /// Compares a recorded graph with a new capture of the same body node by node (a
    /// guard: see `Config::guards`) and returns every difference, raw: kernel functions,
    /// launch configurations, the bytes of every kernel argument, copy and memset
    /// parameters. Addresses are reported as they are; core knows which ones it expects to
    /// differ. `Ok(None)` means the backend cannot compare: core then turns guards off for
    /// the graph and says so. It changes nothing.
    ///
    /// The default cannot compare.
    fn compare(
        &self,
        recorded: &Self::Graph,
        now: &Self::Graph,
    ) -> Result<Option<Vec<GraphDifference>>, DeviceError> {
        let _ = (recorded, now);
        Ok(None)
    }

    /// Counts the nodes of a graph by kind.
    fn summarize(&self, graph: &Self::Graph) -> Result<GraphSummary, DeviceError>;

    /// Takes the first error recorded by a `Drop` since the last call, if any. Called on
    /// every graft call: keep it to an atomic load when there is none.
    fn take_sticky_error(&self, core: &CoreOnly) -> Option<DeviceError>;

    /// Records an error that could not be returned (it happened in a `Drop`).
    fn record_sticky_error(&self, core: &CoreOnly, error: DeviceError);
}
