//! [`CudaDevice`] and [`CudaQueue`]: graft's [`Device`] over the CUDA driver API (cudarc's `sys` layer), opening a device and delegating each trait method to the module that does it.
//!
//! One device owns one primary-context reference and one non-blocking *runtime stream*
//! (everything graft does is enqueued there, and captured from there), and a *side stream*
//! (`Device::side_queue`, a [`CudaQueue`] bound to it) with two events to fork and join it. Where the work is done: `inner` (the device composed of its parts),
//! `context` (the primary context and runtime stream, entering an operation, the sticky
//! slot), `vmm` (pool memory), `capture` (the capture lifecycle and graphs), `conditional`
//! (conditional nodes), `queue` (the body-facing copies, reads, writes and GEMMs), `side` and
//! `test_hooks` (the `test-support` calls); every driver call goes through the `driver`
//! floor, which turns its result into a typed error (`error`).
//!
//! cudarc's safe layer (`CudaSlice`, `CudaStream`) is deliberately not used: it records events
//! per buffer to order its own streams, and those event waits cross the capture boundary and
//! break captures with isolation errors. Pool memory is plain `CUdeviceptr`s here, in address
//! ranges reserved and mapped with the virtual memory management API (`cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`): one physical allocation per granule, so any granule can be
//! unmapped on its own.

use std::fmt;
use std::sync::Arc;

use graft_core::backend::{CopyEnds, CoreOnly};
use graft_core::{
    CaptureMode, Conditional, Device, DeviceError, DeviceId, DeviceOp, DevicePtr, GraphDifference,
    GraphSummary, UpdateRefusal,
};

use crate::conditional::Conditionals;
use crate::driver::stream::CAPTURE_INVALIDATED;
use crate::driver::{self, device_count};
use crate::error::invalid_argument;
use crate::graph::CudaGraph;
use crate::inner::Inner;

/// graft's CUDA backend: one runtime stream on one device. See the [crate docs](crate).
///
/// Cheap to clone (an `Arc` inside); clones share the streams and the sticky error
/// slot. The device is released when the last clone and the last [`CudaGraph`] are dropped.
///
/// It dereferences to its [`CudaQueue`], so eager code calls the queue's methods on the device.
#[derive(Clone)]
pub struct CudaDevice {
    queue: CudaQueue,
    /// The side stream's queue.
    side: CudaQueue,
}

/// The body-facing handle of a [`CudaDevice`] ([`Device::Queue`]): launches of module kernels
/// and cuBLAS GEMMs, copies, host reads and writes, synchronize, all on the runtime stream.
/// There is no way from it back to the device's capture, mapping, graph or error-slot
/// operations. Cheap to clone.
#[derive(Clone)]
pub struct CudaQueue {
    pub(crate) inner: Arc<Inner>,
    /// Whether this queue enqueues on the side stream (`Device::side_queue`) instead of the
    /// runtime stream.
    pub(crate) side: bool,
}

impl std::ops::Deref for CudaDevice {
    type Target = CudaQueue;

    fn deref(&self) -> &CudaQueue {
        &self.queue
    }
}

impl fmt::Debug for CudaQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaQueue")
            .field("device", &self.inner.id)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("id", &self.queue.inner.id)
            .field("ordinal", &self.queue.inner.ordinal)
            .field("name", &self.queue.inner.name)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: initializes the driver, retains the device's primary context and
    /// makes it current on this thread, and creates the runtime stream (non-blocking, so it
    /// never synchronizes with the legacy default stream).
    ///
    /// Fails (never panics) when there is no driver, no such device, or a driver call fails,
    /// reported with `DeviceOp::Init`.
    pub fn new(ordinal: usize) -> Result<CudaDevice, DeviceError> {
        CudaDevice::open(ordinal, None)
    }

    /// A device whose runtime stream is `stream`, a stream another cudarc user made (for
    /// example candle's `CudaDevice::cuda_stream()`), so that graft and that library order their
    /// work on one stream and graft's captures record the library's launches. The stream must
    /// be one made with `CudaContext::new_stream` on a primary context (candle's
    /// `Device::new_cuda_with_stream`): the legacy and per-thread default streams cannot be
    /// captured. The device keeps `stream` alive and never destroys it. Everything else is as
    /// [`CudaDevice::new`].
    pub fn from_stream(stream: Arc<cudarc::driver::CudaStream>) -> Result<CudaDevice, DeviceError> {
        let raw = stream.cu_stream();
        // 0x1 and 0x2 are CU_STREAM_LEGACY and CU_STREAM_PER_THREAD.
        if raw.is_null() || raw as usize == 0x1 || raw as usize == 0x2 {
            return Err(invalid_argument(
                DeviceOp::Init,
                "the stream to adopt is a default stream, which cannot be captured; make one with new_stream (candle: Device::new_cuda_with_stream)",
            ));
        }
        let ordinal = stream.context().ordinal();
        let owner_ctx = stream.context().cu_ctx();
        let device = CudaDevice::open(ordinal, Some(stream))?;
        if device.queue.inner.ctx != owner_ctx {
            return Err(invalid_argument(
                DeviceOp::Init,
                "the stream to adopt belongs to a non-primary context; make it on the device's primary context (cudarc: CudaContext::new)",
            ));
        }
        Ok(device)
    }

    /// Opens device `ordinal` with a runtime stream of its own, or with `adopted`.
    fn open(
        ordinal: usize,
        adopted: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<CudaDevice, DeviceError> {
        let inner = Arc::new(Inner::open(ordinal, adopted)?);
        Ok(CudaDevice {
            side: CudaQueue {
                inner: Arc::clone(&inner),
                side: true,
            },
            queue: CudaQueue { inner, side: false },
        })
    }

    /// Whether a CUDA driver is installed and reports at least one device. Never panics: on a
    /// machine without libcuda it returns false (see the `driver` module for how).
    pub fn is_available() -> bool {
        matches!(device_count(), Ok(n) if n > 0)
    }

    /// The number of CUDA devices, or why the driver could not be asked.
    pub fn device_count() -> Result<usize, DeviceError> {
        device_count()
    }

    /// The device ordinal this device was opened with.
    pub fn ordinal(&self) -> usize {
        self.queue.inner.ordinal
    }

    /// The device's name as the driver reports it, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> &str {
        &self.queue.inner.name
    }

    /// The device's compute capability, major and minor (9.0 on an H100 or H200): what
    /// [`compile_ptx_for`](crate::compile_ptx_for) compiles for, and whether kernels may be
    /// launched as programmatic dependents (9.0 or later).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.queue.compute_capability()
    }

    /// Gives the device's unused graph memory back (`cuDeviceGraphMemTrim`): what graph
    /// allocation nodes (a framework's stream-ordered allocations captured into graphs) keep
    /// cached after their graphs freed it. Failures are reported with `DeviceOp::GraphDestroy`.
    pub fn trim_graph_memory(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::GraphDestroy;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        driver::device::trim_graph_memory(op, inner.cu_device)
    }

    /// The memory graph allocation nodes hold on this device (`cuDeviceGetGraphMemAttribute`):
    /// what a framework's stream-ordered allocations inside recorded graphs use and keep
    /// reserved. Failures are reported with `DeviceOp::Query`.
    pub fn graph_memory(&self) -> Result<MemoryFigures, DeviceError> {
        let op = DeviceOp::Query;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        driver::device::graph_memory(op, inner.cu_device).map(MemoryFigures::from)
    }

    /// The device's default memory pool (`cuDeviceGetDefaultMemPool`,
    /// `cuMemPoolGetAttribute`): what stream-ordered allocations outside graphs use and keep
    /// reserved. Failures are reported with `DeviceOp::Query`.
    pub fn default_pool_memory(&self) -> Result<MemoryFigures, DeviceError> {
        let op = DeviceOp::Query;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        let pool = driver::device::default_pool(op, inner.cu_device)?;
        driver::device::pool_memory(op, pool).map(MemoryFigures::from)
    }

    /// Resets the high-water marks of [`CudaDevice::graph_memory`], so the next figures
    /// describe what follows. Failures are reported with `DeviceOp::Query`.
    pub fn reset_graph_memory_high(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Query;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        driver::device::reset_graph_memory_high(op, inner.cu_device)
    }

    /// Resets the high-water marks of [`CudaDevice::default_pool_memory`] to what is in use
    /// now. Failures are reported with `DeviceOp::Query`.
    pub fn reset_default_pool_high(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Query;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        let pool = driver::device::default_pool(op, inner.cu_device)?;
        driver::device::reset_pool_high(op, pool)
    }

    /// Enqueues a copy of `bytes` from device address `src` to `dst` on the runtime stream
    /// (`cuMemcpyDtoDAsync`; inside a capture, a memcpy node). For code that owns raw device
    /// memory beside graft (a hand-made graph in a benchmark); graft's own copies go through
    /// its buffers. Failures are reported with `DeviceOp::Copy`.
    ///
    /// # Safety
    /// `dst` and `src` must be `bytes` long ranges of live memory of this device that do not
    /// overlap, both kept allocated until the stream has run the copy, and nothing else may
    /// read `dst` or write either range in between: the driver cannot tell a range that
    /// belongs to someone else from one that belongs to the caller.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        let op = DeviceOp::Copy;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        driver::memory::copy_dtod_async(op, dst, src, bytes, inner.stream)
    }

    /// Whether the runtime stream's capture has been invalidated (`cuStreamIsCapturing`
    /// reports `CU_STREAM_CAPTURE_STATUS_INVALIDATED`): a capture is underway but a call inside
    /// it broke it, and ending it will fail. False when no capture is underway or it is
    /// active. Legal during a capture; failures are reported with `DeviceOp::Query`.
    pub fn capture_invalidated(&self) -> Result<bool, DeviceError> {
        let op = DeviceOp::Query;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        Ok(inner.capture_status(op)? == CAPTURE_INVALIDATED)
    }
}

/// Memory figures of the device's graph memory or of a memory pool, in bytes: in use now and
/// at the high-water mark, reserved from the device now and at its high-water mark.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct MemoryFigures {
    /// In use now.
    pub used_current: u64,
    /// In use at the high-water mark.
    pub used_high: u64,
    /// Reserved (mapped) now.
    pub reserved_current: u64,
    /// Reserved at the high-water mark.
    pub reserved_high: u64,
}

impl From<[u64; 4]> for MemoryFigures {
    fn from([used_current, used_high, reserved_current, reserved_high]: [u64; 4]) -> Self {
        MemoryFigures {
            used_current,
            used_high,
            reserved_current,
            reserved_high,
        }
    }
}

/// Every method makes the device's context current on the calling thread first. Errors from
/// `Drop` (graph destruction) wait in the sticky slot until core takes them with
/// `take_sticky_error` (one atomic load when there is none); no other method returns them.
impl Device for CudaDevice {
    type Graph = CudaGraph;
    type Queue = CudaQueue;

    fn queue(&self) -> &CudaQueue {
        &self.queue
    }

    fn side_queue(&self) -> Option<&CudaQueue> {
        Some(&self.side)
    }

    /// `cuEventRecord` on the runtime stream, `cuStreamWaitEvent` on the side stream.
    fn fork(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.enter(DeviceOp::Fork)?;
        inner.side.fork(&inner.context).map(|_| ())
    }

    /// `cuEventRecord` on the side stream, `cuStreamWaitEvent` on the runtime stream.
    fn join(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.enter(DeviceOp::Fork)?;
        inner.side.join(&inner.context)
    }

    fn id(&self) -> DeviceId {
        self.queue.inner.id
    }

    fn describe(&self) -> String {
        format!(
            "{} (cuda:{})",
            self.queue.inner.name, self.queue.inner.ordinal
        )
    }

    /// The driver's recommended granularity for pinned device memory (2 MiB on an H100).
    fn granularity(&self) -> usize {
        self.queue.inner.vmm.granularity()
    }

    fn reserve(&self, _: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let inner = &self.queue.inner;
        inner.vmm.reserve(&inner.context, bytes)
    }

    fn release_reservation(
        &self,
        _: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.vmm.release_reservation(&inner.context, addr, bytes)
    }

    fn map(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.vmm.map(&inner.context, addr, bytes)
    }

    fn unmap(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        self.queue.inner.unmap(addr, bytes)
    }

    fn copy(
        &self,
        _: &CoreOnly,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.queue.copy_raw(dst, src, bytes)
    }

    fn write(&self, _: &CoreOnly, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.queue.write_raw(dst, src)
    }

    fn read(&self, _: &CoreOnly, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.queue.read_raw(src, dst)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.queue.synchronize()
    }

    fn begin_capture(&self, _: &CoreOnly, mode: CaptureMode) -> Result<(), DeviceError> {
        self.queue.inner.begin_capture(mode)
    }

    fn end_capture(&self, _: &CoreOnly) -> Result<CudaGraph, DeviceError> {
        self.queue.inner.end_capture()
    }

    fn end_capture_to_compare(&self, _: &CoreOnly) -> Result<CudaGraph, DeviceError> {
        self.queue.inner.end_capture_to_compare()
    }

    fn prepare_launch(&self, _: &CoreOnly, graph: &mut CudaGraph) -> Result<(), DeviceError> {
        self.queue.inner.prepare_launch(graph)
    }

    fn end_capture_into(
        &self,
        _: &CoreOnly,
        target: &mut CudaGraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        self.queue.inner.end_capture_into(target)
    }

    fn abort_capture(&self, _: &CoreOnly) -> Result<bool, DeviceError> {
        self.queue.inner.abort_capture()
    }

    /// CUDA 12.8 drivers and later (every kind of conditional node).
    fn supports_conditionals(&self) -> bool {
        Conditionals::supported()
    }

    fn begin_conditional(
        &self,
        _: &CoreOnly,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.conditionals.begin(&inner.context, kind, selector)
    }

    fn next_branch(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.conditionals.next_branch(&inner.context)
    }

    fn end_conditional(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.conditionals.end(&inner.context)
    }

    fn launch(&self, _: &CoreOnly, graph: &CudaGraph) -> Result<(), DeviceError> {
        self.queue.inner.launch(graph)
    }

    fn repoint_copy(
        &self,
        _: &CoreOnly,
        graph: &mut CudaGraph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        self.queue.inner.repoint_copy(graph, recorded, now)
    }

    /// Patches the executable's kernel nodes (see the `patch` module).
    fn redirect(
        &self,
        _: &CoreOnly,
        graph: &mut CudaGraph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        self.queue.inner.redirect(graph, from, len, copy, to)
    }

    fn compare(
        &self,
        recorded: &CudaGraph,
        now: &CudaGraph,
    ) -> Result<Option<Vec<GraphDifference>>, DeviceError> {
        self.queue.inner.compare(recorded, now)
    }

    fn summarize(&self, graph: &CudaGraph) -> Result<GraphSummary, DeviceError> {
        self.queue.inner.summarize(graph)
    }

    fn take_sticky_error(&self, _: &CoreOnly) -> Option<DeviceError> {
        self.queue.inner.take_sticky()
    }

    fn record_sticky_error(&self, _: &CoreOnly, error: DeviceError) {
        self.queue.inner.record_sticky(error);
    }
}
