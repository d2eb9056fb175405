//! [`CudaDevice`]: graft's [`Device`] over the CUDA driver API (cudarc's `sys` layer).
//!
//! One device owns one primary-context reference, one non-blocking *runtime stream* (everything
//! graft does is enqueued there, and captured from there), one *side stream* (for tests that
//! model work on another stream), and two events to fork and join them.
//!
//! cudarc's safe layer (`CudaSlice`, `CudaStream`) is deliberately not used: it records events
//! per buffer to order its own streams, and those event waits cross the capture boundary and
//! break captures with isolation errors. Pool memory is plain `CUdeviceptr`s here, in address
//! ranges reserved and mapped with the virtual memory management API (`cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`): one physical allocation per granule, so any granule can be
//! unmapped on its own.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;
use graft_core::backend::{CopyEnds, CoreOnly, StickyError};
use graft_core::{
    Buffer, CaptureMode, Device, DeviceError, DeviceId, DeviceOp, DevicePtr, GraphSummary,
    UpdateRefusal,
};

use crate::blas::Blas;
use crate::driver::{device_count, driver_ready};
use crate::error::{INSPECT_OP, check, check_alloc, is_capture_error, map};
use crate::graph::{self, CudaGraph};

#[cfg(feature = "test-support")]
const F32_BYTES: usize = std::mem::size_of::<f32>();

const CAPTURE_NONE: u32 = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;

/// graft's CUDA backend: one runtime stream on one device. See the [crate docs](crate).
///
/// Cheap to clone (an `Arc` inside); clones share the streams and the sticky error
/// slot. The device is released when the last clone and the last [`CudaGraph`] are dropped.
///
/// It dereferences to its [`CudaQueue`], so eager code calls the queue's methods on the device.
#[derive(Clone)]
pub struct CudaDevice {
    queue: CudaQueue,
}

/// The body-facing handle of a [`CudaDevice`] ([`Device::Queue`]): launches of module kernels
/// and cuBLAS GEMMs, copies, host reads and writes, synchronize, all on the runtime stream.
/// There is no way from it back to the device's capture, mapping, graph or error-slot
/// operations. Cheap to clone.
#[derive(Clone)]
pub struct CudaQueue {
    pub(crate) inner: Arc<Inner>,
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

/// The shared state of a device. Handles are null until created, so a partly built `Inner`
/// (a failing [`CudaDevice::new`]) releases exactly what it got.
pub(crate) struct Inner {
    pub(crate) id: DeviceId,
    ordinal: usize,
    name: String,
    cu_device: sys::CUdevice,
    /// The device's primary context; non-null once retained (and then released in `Drop`).
    pub(crate) ctx: sys::CUcontext,
    /// The runtime stream: all work and all captures.
    pub(crate) stream: sys::CUstream,
    /// The cudarc stream `stream` was adopted from ([`CudaDevice::from_stream`]): kept alive
    /// while the device lives, and never destroyed here (its owner does that).
    adopted: Option<Arc<cudarc::driver::CudaStream>>,
    /// A second stream, forked from the runtime stream by `fork_event` (test-support's
    /// side-stream launches).
    side_stream: sys::CUstream,
    fork_event: sys::CUevent,
    join_event: sys::CUevent,
    /// The cuBLAS handle and its workspace, made once (see the `blas` module).
    pub(crate) blas: OnceLock<Blas>,
    /// Serializes the handle's creation.
    pub(crate) blas_init: Mutex<()>,
    sticky: StickyError,
    /// Set whenever `sticky` may hold an error, so the fast path checks an atomic, not a mutex.
    sticky_pending: AtomicBool,
    /// The physical mapping granularity (the driver's recommended granularity for this device).
    granularity: usize,
    /// Reservations and mapped granules, for validation and teardown.
    vmm: Mutex<Vmm>,
}

/// What the device has reserved and mapped for graft's pools.
#[derive(Default)]
struct Vmm {
    /// Base -> size of each live reservation.
    reservations: BTreeMap<u64, usize>,
    /// Address of each mapped granule -> its physical allocation.
    handles: HashMap<u64, sys::CUmemGenericAllocationHandle>,
}

impl Vmm {
    /// Whether `[addr, addr+bytes)` lies inside one reservation.
    fn inside_reservation(&self, addr: u64, bytes: usize) -> bool {
        self.reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &size)| {
                addr.checked_add(bytes as u64)
                    .is_some_and(|end| end <= base + size as u64)
            })
    }
}

/// The properties of graft's physical allocations on device `cu_device`: pinned device memory,
/// no exportable handle.
fn alloc_prop(cu_device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: cu_device,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// What a launch or update of another device's graph is refused with.
const FOREIGN_GRAPH: &str = "the graph was captured on another device";

pub(crate) fn invalid_argument(op: DeviceOp, what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument { op, what }
}

// SAFETY: the raw handles in `Inner` (context, streams, events, module, functions, the cuBLAS
// handle) are CUDA driver or library handles, which may be used from any thread once the
// owning context is current on it; every method makes the context current first
// (`make_current`). The cuBLAS handle is created once (under `blas_init`) and only read after,
// and cuBLAS allows one handle to be used from several host threads. Streams and events are
// internally synchronized by the driver. The remaining fields are Send + Sync (Mutex, atomics,
// String). Handles are created in `new` and destroyed only in `Drop`, with exclusive access.
unsafe impl Send for Inner {}
// SAFETY: see the `Send` impl: shared use only passes the handles to driver calls, which are
// thread-safe for contexts, streams, events and launched functions; graph handles, which are
// not, live in `CudaGraph` behind a mutex.
unsafe impl Sync for Inner {}

impl Inner {
    /// Makes this device's context current on the calling thread. Called unconditionally
    /// (a thread-local store in the driver) rather than cached: a cached "already current"
    /// would go stale when another library, or a dropped device, changes the thread's context.
    #[inline]
    pub(crate) fn make_current(&self, op: DeviceOp) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is the primary context retained in `CudaDevice::new` and released only
        // in `Drop`, which cannot run while `&self` is alive.
        check(op, unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Puts `err` in the sticky slot (unless one is already waiting).
    pub(crate) fn record_sticky(&self, err: DeviceError) {
        self.sticky.record(err);
        self.sticky_pending.store(true, Ordering::Release);
    }

    /// Takes the waiting sticky error, if any: one atomic load when there is none.
    #[inline]
    fn take_sticky(&self) -> Option<DeviceError> {
        if !self.sticky_pending.load(Ordering::Acquire) {
            return None;
        }
        self.sticky_pending.store(false, Ordering::Release);
        self.sticky.take()
    }

    /// Entry of every operation: makes the context current. (Sticky errors are not checked
    /// here: core polls `take_sticky_error` on every graft call.)
    #[inline]
    fn enter(&self, op: DeviceOp) -> Result<(), DeviceError> {
        self.make_current(op)
    }

    /// The runtime stream's capture status (`CU_STREAM_CAPTURE_STATUS_*` as a number).
    fn capture_status(&self, op: DeviceOp) -> Result<u32, DeviceError> {
        let mut status: u32 = CAPTURE_NONE;
        // SAFETY: `stream` is the live runtime stream (created in `new`, destroyed in `Drop`);
        // `status` is a valid, aligned out-pointer for the 4-byte repr(u32) status enum, read as
        // a plain number so an unexpected value is not undefined behaviour.
        check(op, unsafe {
            sys::cuStreamIsCapturing(
                self.stream,
                (&raw mut status).cast::<sys::CUstreamCaptureStatus>(),
            )
        })?;
        Ok(status)
    }

    /// Makes the context current for `op` and checks that a capture is underway on the runtime
    /// stream (active or invalidated): what ending or aborting one needs first.
    fn enter_capture(&self, op: DeviceOp) -> Result<(), DeviceError> {
        self.enter(op)?;
        if self.capture_status(op)? == CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "no capture is underway on the runtime stream",
            });
        }
        Ok(())
    }

    /// Ends the runtime stream's capture, whatever its state, and destroys any graph it returns.
    /// Returns the raw result of `cuStreamEndCapture`.
    fn end_and_discard(&self) -> sys::CUresult {
        let mut graph: sys::CUgraph = ptr::null_mut();
        // SAFETY: `stream` is the live runtime stream, and this thread began its capture (core
        // drives the lifecycle from one thread); `graph` is a valid out-pointer.
        let result = unsafe { sys::cuStreamEndCapture(self.stream, &mut graph) };
        graph::destroy_orphan(self, graph, ptr::null_mut());
        result
    }

    /// Runs `f` with the calling thread switched to relaxed capture mode, as PyTorch's caching
    /// allocator does: in global or thread-local mode CUDA refuses allocation and mapping calls
    /// during a capture, but the pool must be able to grow inside one.
    fn with_relaxed<T>(
        &self,
        op: DeviceOp,
        f: impl FnOnce() -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's capture mode with a valid enum value; the previous mode
        // is written back into `mode` and restored below.
        check(op, unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        let result = f();
        // SAFETY: restores the mode saved by the first exchange.
        let restored = check(op, unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
        let value = result?;
        restored?;
        Ok(value)
    }

    /// `cuMemAlloc` in relaxed capture mode (legal during a capture), for the backend's own
    /// memory (the cuBLAS workspace).
    pub(crate) fn alloc_relaxed(&self, op: DeviceOp, bytes: usize) -> Result<u64, DeviceError> {
        self.with_relaxed(op, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: the context is current (callers `enter` first); `ptr` is a valid
            // out-pointer. The caller owns the memory and frees it once.
            check_alloc(op, unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, bytes)?;
            Ok(ptr)
        })
    }

    /// Unmaps granule `addr` and releases its physical allocation `handle`.
    fn unmap_granule(
        &self,
        op: DeviceOp,
        addr: u64,
        handle: sys::CUmemGenericAllocationHandle,
    ) -> Result<(), DeviceError> {
        // SAFETY: `addr` is a granule this device mapped with `cuMemMap` (a key of
        // `Vmm::handles`, whose entry the caller removes), `granularity` bytes long, so the
        // range is exactly one mapping; work that could use it was synchronized or never ran.
        check(op, unsafe { sys::cuMemUnmap(addr, self.granularity) })?;
        // SAFETY: `handle` came from `cuMemCreate` for this granule and is released once, after
        // its only mapping is gone.
        check(op, unsafe { sys::cuMemRelease(handle) })
    }

    /// Makes the side stream wait for the runtime stream's work so far (an event recorded on
    /// the runtime stream, waited on by the side stream) and returns it. During a capture this
    /// pulls the side stream into the capture.
    #[cfg(feature = "test-support")]
    pub(crate) fn fork_side_stream(&self) -> Result<sys::CUstream, DeviceError> {
        // SAFETY: `fork_event` and both streams are live handles of this device's context,
        // which is current (callers `enter` first).
        check(DeviceOp::Event, unsafe {
            sys::cuEventRecord(self.fork_event, self.stream)
        })?;
        // SAFETY: as above; flags 0 is CU_EVENT_WAIT_DEFAULT.
        check(DeviceOp::Event, unsafe {
            sys::cuStreamWaitEvent(self.side_stream, self.fork_event, 0)
        })?;
        Ok(self.side_stream)
    }

    /// Synchronizes `stream`, mapping a failure to `op`.
    fn sync(&self, op: DeviceOp, stream: sys::CUstream) -> Result<(), DeviceError> {
        // SAFETY: `stream` is one of this device's live streams.
        check(op, unsafe { sys::cuStreamSynchronize(stream) })
    }
}

impl Drop for Inner {
    /// Releases what `new` created, in reverse order. Errors here have nowhere to go (the sticky
    /// slot dies with the device, and every graph, which holds an `Arc` to it, is already gone),
    /// so they are ignored: teardown continues so that the context is still released.
    fn drop(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        let _ = self.make_current(DeviceOp::GraphDestroy);
        if !self.stream.is_null() {
            // A capture left open (a panic inside a body) would make every later call fail.
            if matches!(self.capture_status(DeviceOp::EndCapture), Ok(s) if s != CAPTURE_NONE) {
                let _ = self.end_and_discard();
            }
            let _ = self.sync(DeviceOp::Synchronize, self.stream);
        }
        if !self.side_stream.is_null() {
            let _ = self.sync(DeviceOp::Synchronize, self.side_stream);
        }
        if let Some(mut blas) = self.blas.take() {
            // The stream is synchronized above, so no GEMM still uses the workspace.
            let _ = blas.destroy();
        }
        // Memory pools did not give back (a runtime leaked, or a test stopped early).
        let vmm = std::mem::take(self.vmm.get_mut().unwrap_or_else(PoisonError::into_inner));
        for (addr, handle) in vmm.handles {
            let _ = self.unmap_granule(DeviceOp::Unmap, addr, handle);
        }
        for (base, size) in vmm.reservations {
            // SAFETY: a reservation made by cuMemAddressReserve in `reserve`, never released
            // (it is still listed), with every granule unmapped just above; freed once.
            let _ = unsafe { sys::cuMemAddressFree(base, size) };
        }
        for event in [&mut self.fork_event, &mut self.join_event] {
            let event = std::mem::replace(event, ptr::null_mut());
            if !event.is_null() {
                // SAFETY: created by cuEventCreate in `new`, destroyed exactly once (swapped out).
                let _ = unsafe { sys::cuEventDestroy_v2(event) };
            }
        }
        if self.adopted.is_some() {
            // Not ours to destroy: the adopted stream's owner (cudarc) does that.
            self.stream = ptr::null_mut();
        }
        for stream in [&mut self.side_stream, &mut self.stream] {
            let stream = std::mem::replace(stream, ptr::null_mut());
            if !stream.is_null() {
                // SAFETY: created by cuStreamCreate in `new`, synchronized above, destroyed
                // exactly once (swapped out).
                let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
            }
        }
        // SAFETY: the primary context of `cu_device` was retained once in `new` (ctx non-null)
        // and is released once here. Nothing of this device uses it afterwards.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
        self.ctx = ptr::null_mut();
    }
}

impl CudaDevice {
    /// `cuStreamEndCapture` on the runtime stream: the captured graph. If the end fails (an
    /// invalidated capture, unjoined work), the partial graph is destroyed and the error
    /// returned; the stream is out of capture mode either way.
    fn end_stream_capture(&self) -> Result<sys::CUgraph, DeviceError> {
        let op = DeviceOp::EndCapture;
        let inner = &self.queue.inner;
        inner.enter_capture(op)?;
        let mut graph: sys::CUgraph = ptr::null_mut();
        // SAFETY: the runtime stream is live and capturing (checked above), begun by this
        // thread; `graph` is a valid out-pointer.
        let ended = unsafe { sys::cuStreamEndCapture(inner.stream, &mut graph) };
        if ended != sys::CUresult::CUDA_SUCCESS {
            graph::destroy_orphan(inner, graph, ptr::null_mut());
            // CUDA ends the capture even when it reports an error; make sure of it.
            if matches!(inner.capture_status(op), Ok(s) if s != CAPTURE_NONE) {
                let _ = inner.end_and_discard();
            }
            return Err(map(op, ended, 0));
        }
        Ok(graph)
    }

    /// Instantiates (flags 0) and uploads `graph`, taking ownership of it: on failure it is
    /// destroyed.
    fn instantiate(&self, graph: sys::CUgraph) -> Result<CudaGraph, DeviceError> {
        let inner = &self.queue.inner;
        let mut exec: sys::CUgraphExec = ptr::null_mut();
        // SAFETY: `graph` is a live graph returned by cuStreamEndCapture and owned by this
        // call; `exec` is a valid out-pointer; flags 0 requests a plain instantiation.
        let instantiated = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(err) = check(DeviceOp::Instantiate, instantiated) {
            graph::destroy_orphan(inner, graph, ptr::null_mut());
            return Err(err);
        }
        // SAFETY: `exec` was just instantiated in this context; the runtime stream is live.
        let uploaded = unsafe { sys::cuGraphUpload(exec, inner.stream) };
        if let Err(err) = check(DeviceOp::Upload, uploaded) {
            graph::destroy_orphan(inner, graph, exec);
            return Err(err);
        }
        Ok(CudaGraph::new(Arc::clone(inner), graph, exec))
    }

    /// Opens device `ordinal`: initializes the driver, retains the device's primary context and
    /// makes it current on this thread, creates the runtime stream (non-blocking, so it never
    /// synchronizes with the legacy default stream), and a side stream and its fork/join events.
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
    /// captured. The device keeps `stream` alive and never destroys it; its side stream and
    /// events are graft's own. Everything else is as [`CudaDevice::new`].
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
        driver_ready()?;
        let ordinal_c = c_int::try_from(ordinal)
            .map_err(|_| invalid_argument(DeviceOp::Init, "the device ordinal exceeds i32::MAX"))?;
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: the driver is initialized (driver_ready); `cu_device` is a valid out-pointer.
        check(DeviceOp::Init, unsafe {
            sys::cuDeviceGet(&mut cu_device, ordinal_c)
        })?;

        let mut name_buf: [c_char; 256] = [0; 256];
        // SAFETY: `name_buf` has room for the 256 bytes passed as its length.
        check(DeviceOp::Init, unsafe {
            sys::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as c_int, cu_device)
        })?;
        name_buf[name_buf.len() - 1] = 0;
        // SAFETY: `name_buf` is NUL-terminated (its last byte was just set to 0).
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();

        let mut inner = Inner {
            id: DeviceId::fresh(),
            ordinal,
            name,
            cu_device,
            ctx: ptr::null_mut(),
            stream: ptr::null_mut(),
            adopted: None,
            side_stream: ptr::null_mut(),
            fork_event: ptr::null_mut(),
            join_event: ptr::null_mut(),
            blas: OnceLock::new(),
            blas_init: Mutex::new(()),
            sticky: StickyError::default(),
            sticky_pending: AtomicBool::new(false),
            granularity: 0,
            vmm: Mutex::new(Vmm::default()),
        };
        // From here on, an early return drops `inner`, which releases what was created.
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `cu_device` is a valid device; `ctx` is a valid out-pointer. The reference is
        // released once in `Inner::drop` (which runs only if `inner.ctx` is set, below).
        check(DeviceOp::Init, unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, cu_device)
        })?;
        inner.ctx = ctx;
        inner.make_current(DeviceOp::Init)?;
        let prop = alloc_prop(cu_device);
        let mut granularity: usize = 0;
        // SAFETY: `granularity` is a valid out-pointer; `prop` is a fully initialized property
        // struct for this device that outlives the call.
        check(DeviceOp::Init, unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        // The driver's granularity is a power of two; the trait promises a multiple of 512.
        inner.granularity = granularity.max(512);

        let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        let own_streams = if let Some(stream) = adopted {
            inner.stream = stream.cu_stream();
            inner.adopted = Some(stream);
            vec![&mut inner.side_stream]
        } else {
            vec![&mut inner.stream, &mut inner.side_stream]
        };
        for slot in own_streams {
            let mut stream: sys::CUstream = ptr::null_mut();
            // SAFETY: the context is current; `stream` is a valid out-pointer. Destroyed once in
            // `Inner::drop`.
            check(DeviceOp::Init, unsafe {
                sys::cuStreamCreate(&mut stream, non_blocking)
            })?;
            *slot = stream;
        }
        let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        for slot in [&mut inner.fork_event, &mut inner.join_event] {
            let mut event: sys::CUevent = ptr::null_mut();
            // SAFETY: the context is current; `event` is a valid out-pointer. Destroyed once in
            // `Inner::drop`.
            check(DeviceOp::Init, unsafe {
                sys::cuEventCreate(&mut event, no_timing)
            })?;
            *slot = event;
        }
        Ok(CudaDevice {
            queue: CudaQueue {
                inner: Arc::new(inner),
            },
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
}

impl CudaQueue {
    /// The identity of the device this queue belongs to.
    pub fn device_id(&self) -> DeviceId {
        self.inner.id
    }

    /// How many handles share this device: clones of the device and of its queue, loaded
    /// modules, graphs. The device (its context, streams, cuBLAS handle and memory) is
    /// released when the last one is dropped; a count that stays above one after a program
    /// dropped its modules and graphs means something still holds the device.
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Whether the runtime stream is capturing (an invalidated capture counts: it must still be
    /// ended). Legal during a capture.
    pub fn is_capturing(&self) -> Result<bool, DeviceError> {
        self.inner.enter(DeviceOp::Query)?;
        Ok(self.inner.capture_status(DeviceOp::Query)? != CAPTURE_NONE)
    }

    /// A raw `cuMemAlloc`, as framework code that calls cudaMalloc directly would make.
    /// Unlike [`Device::map`] it is *not* switched to relaxed capture mode, so during
    /// a capture it fails as CUDA fails it (`Capture { op: RawAlloc, .. }`).
    #[cfg(feature = "test-support")]
    pub fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out-pointer. The caller owns the
        // memory and returns it with `raw_free`.
        check_alloc(op, unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, bytes)?;
        Ok(DevicePtr(ptr))
    }

    /// Frees memory from [`CudaQueue::raw_alloc`] (reported as `DeviceOp::RawAlloc`: core has
    /// no raw-free operation). Like `cuMemFree`, it fails during a capture.
    #[cfg(feature = "test-support")]
    pub fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        // SAFETY: the caller passes a pointer from `raw_alloc` that it has not freed; the driver
        // validates the address and reports an error for anything it did not allocate.
        check(op, unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    /// Whether all work enqueued on the runtime stream has finished (`cuStreamQuery`). Fails
    /// during a capture, as CUDA forbids querying a capturing stream.
    #[cfg(feature = "test-support")]
    pub fn query(&self) -> Result<bool, DeviceError> {
        let op = DeviceOp::Query;
        self.inner.enter(op)?;
        // SAFETY: `stream` is the live runtime stream.
        match unsafe { sys::cuStreamQuery(self.inner.stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map(op, other, 0)),
        }
    }

    /// Reads `n` f32s from the device, synchronously (a [`Device::read`]). Same signature as
    /// the simulator's, so tests run on both.
    #[cfg(feature = "test-support")]
    pub fn read_f32(&self, src: DevicePtr, n: usize) -> Result<Vec<f32>, DeviceError> {
        let bytes = n
            .checked_mul(F32_BYTES)
            .ok_or(DeviceError::InvalidAddress {
                op: DeviceOp::Read,
                addr: src,
                len: usize::MAX,
            })?;
        let mut raw = vec![0u8; bytes];
        self.read_raw(src, &mut raw)?;
        Ok(raw
            .chunks_exact(F32_BYTES)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Writes `values` to the device as f32s, synchronously (a [`Device::write`]).
    #[cfg(feature = "test-support")]
    pub fn write_f32(&self, dst: DevicePtr, values: &[f32]) -> Result<(), DeviceError> {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.write_raw(dst, &raw)
    }

    /// Joins the side stream back: the runtime stream waits for the side stream's work so far
    /// (an event recorded on the side stream, waited on by the runtime stream). Inside a capture
    /// this is what makes forked work ([`CudaQueue::launch_function_on_side_stream`]) legal.
    #[cfg(feature = "test-support")]
    pub fn join_side_stream(&self) -> Result<(), DeviceError> {
        let inner = &self.inner;
        inner.enter(DeviceOp::Event)?;
        // SAFETY: `join_event` and both streams are live handles of this device's context.
        check(DeviceOp::Event, unsafe {
            sys::cuEventRecord(inner.join_event, inner.side_stream)
        })?;
        // SAFETY: as above; flags 0 is CU_EVENT_WAIT_DEFAULT.
        check(DeviceOp::Event, unsafe {
            sys::cuStreamWaitEvent(inner.stream, inner.join_event, 0)
        })
    }

    /// Copies the first `bytes` of `src` to the start of `dst` on the runtime stream (recorded
    /// when capturing), like [`Device::copy`] but on graft buffers: both are checked to be
    /// this device's, still valid and at least `bytes` long ([`Buffer::device_addr`]) before
    /// anything is enqueued (`InvalidArgument`, `InvalidBuffer`); overlapping ranges fail with
    /// `OverlappingCopy`.
    pub fn copy(&self, dst: &Buffer, src: &Buffer, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Copy;
        let dst = dst.device_addr(op, self.inner.id, 0, bytes)?;
        let src = src.device_addr(op, self.inner.id, 0, bytes)?;
        self.copy_raw(dst, src, bytes)
    }

    /// Writes `src` to the start of `dst`, synchronously, like [`Device::write`] but on a
    /// graft buffer, checked as [`Self::copy`] checks its buffers. Fails during a capture.
    pub fn write(&self, dst: &Buffer, src: &[u8]) -> Result<(), DeviceError> {
        let dst = dst.device_addr(DeviceOp::Write, self.inner.id, 0, src.len())?;
        self.write_raw(dst, src)
    }

    /// Reads the first `dst.len()` bytes of `src` into `dst`, synchronously, like
    /// [`Device::read`] but on a graft buffer, checked as [`Self::copy`] checks its buffers.
    /// Fails during a capture.
    pub fn read(&self, src: &Buffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        let src = src.device_addr(DeviceOp::Read, self.inner.id, 0, dst.len())?;
        self.read_raw(src, dst)
    }

    /// `cuMemcpyDtoDAsync` on the runtime stream. Overlapping ranges are rejected before CUDA
    /// sees them; a zero-byte copy does nothing. Callers: [`Device::copy`] (core's own pool
    /// addresses) and [`CudaQueue::copy`] (checked graft buffers).
    fn copy_raw(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Copy;
        self.inner.enter(op)?;
        if bytes == 0 {
            return Ok(());
        }
        let len = bytes as u64;
        if dst.0 < src.0.saturating_add(len) && src.0 < dst.0.saturating_add(len) {
            return Err(DeviceError::OverlappingCopy {
                op,
                dst,
                src,
                len: bytes,
            });
        }
        // SAFETY: the ranges do not overlap (checked above); the addresses are device memory
        // of this device that the caller holds (core's pool addresses, or checked graft
        // buffers); an invalid one is an error the driver reports, not host UB; the runtime
        // stream is live.
        check(op, unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, self.inner.stream)
        })
    }

    /// `cuMemcpyHtoDAsync` on the runtime stream, then `cuStreamSynchronize`. During a capture
    /// CUDA refuses one or the other, and the error is returned as it comes.
    fn write_raw(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        let op = DeviceOp::Write;
        let inner = &self.inner;
        inner.enter(op)?;
        if !src.is_empty() {
            // SAFETY: `src` is a live host slice of `src.len()` bytes, borrowed until the stream
            // synchronize below returns (so the driver's read of it has finished); `dst` is device
            // memory the caller holds (core's pool addresses, a checked graft buffer, or a test's
            // raw address); an invalid one is a driver error, not host UB.
            check(op, unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.0,
                    src.as_ptr().cast::<c_void>(),
                    src.len(),
                    inner.stream,
                )
            })?;
        }
        inner.sync(op, inner.stream)
    }

    /// `cuMemcpyDtoHAsync` on the runtime stream (after its earlier work), then
    /// `cuStreamSynchronize`. Fails during a capture, as CUDA does.
    fn read_raw(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        let op = DeviceOp::Read;
        let inner = &self.inner;
        inner.enter(op)?;
        if !dst.is_empty() {
            // SAFETY: `dst` is a live, exclusively borrowed host buffer of `dst.len()` bytes,
            // borrowed until the stream synchronize below returns (so the driver's write to it
            // has finished); `src` is device memory the caller holds (as for `write_raw`).
            check(op, unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast::<c_void>(),
                    src.0,
                    dst.len(),
                    inner.stream,
                )
            })?;
        }
        inner.sync(op, inner.stream)
    }

    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Synchronize;
        self.inner.enter(op)?;
        self.inner.sync(op, self.inner.stream)
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

/// The granules of `addr..addr+bytes`, which must be a non-empty range aligned to `gran`.
fn granules(
    op: DeviceOp,
    addr: DevicePtr,
    bytes: usize,
    gran: usize,
) -> Result<Vec<u64>, DeviceError> {
    if bytes == 0 || !bytes.is_multiple_of(gran) || !addr.0.is_multiple_of(gran as u64) {
        return Err(invalid_argument(
            op,
            "the range is empty or not aligned to the granularity",
        ));
    }
    Ok((0..bytes / gran)
        .map(|i| addr.0 + (i * gran) as u64)
        .collect())
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
        self.queue.inner.granularity
    }

    /// `cuMemAddressReserve`, aligned to the granularity, in relaxed capture mode (legal during
    /// a capture).
    fn reserve(&self, _: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::Reserve;
        let inner = &self.queue.inner;
        if bytes == 0 || !bytes.is_multiple_of(inner.granularity) {
            return Err(invalid_argument(
                op,
                "the size is not a positive multiple of the granularity",
            ));
        }
        inner.enter(op)?;
        let mut vmm = inner.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        let ptr = inner.with_relaxed(op, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: the context is current; `ptr` is a valid out-pointer; a zero requested
            // address and flags ask for any suitably aligned range. Freed once, in
            // `release_reservation` or `Inner::drop`.
            let r = unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, inner.granularity, 0, 0) };
            check_alloc(op, r, bytes)?;
            Ok(ptr)
        })?;
        vmm.reservations.insert(ptr, bytes);
        tracing::debug!(addr = %DevicePtr(ptr), bytes, "address range reserved");
        Ok(DevicePtr(ptr))
    }

    /// `cuMemAddressFree` of a whole reservation with nothing mapped in it.
    fn release_reservation(
        &self,
        _: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::ReleaseReservation;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        let mut vmm = inner.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if vmm.reservations.get(&addr.0) != Some(&bytes) {
            return Err(invalid_argument(
                op,
                "the range is not a reservation of this device",
            ));
        }
        let end = addr.0 + bytes as u64;
        if vmm.handles.keys().any(|&g| g >= addr.0 && g < end) {
            return Err(invalid_argument(
                op,
                "part of the reservation is still mapped",
            ));
        }
        // SAFETY: `addr`/`bytes` are exactly a live reservation of this device (checked above)
        // with nothing mapped in it; it is removed from the list below, so freed once.
        check(op, unsafe { sys::cuMemAddressFree(addr.0, bytes) })?;
        vmm.reservations.remove(&addr.0);
        tracing::debug!(%addr, bytes, "address range released");
        Ok(())
    }

    /// Per granule `cuMemCreate` and `cuMemMap`, then one `cuMemSetAccess` (read/write for this
    /// device) over the range, all in relaxed capture mode (legal during a capture). On failure
    /// what this call mapped is unmapped and released again.
    fn map(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Map;
        let inner = &self.queue.inner;
        let gran = inner.granularity;
        let granules = granules(op, addr, bytes, gran)?;
        let mut vmm = inner.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if !vmm.inside_reservation(addr.0, bytes) {
            return Err(invalid_argument(
                op,
                "the range is not inside one reservation",
            ));
        }
        if granules.iter().any(|g| vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is already mapped"));
        }
        inner.enter(op)?;
        let prop = alloc_prop(inner.cu_device);
        let mut done: Vec<(u64, sys::CUmemGenericAllocationHandle)> =
            Vec::with_capacity(granules.len());
        let result = inner.with_relaxed(op, || {
            for &g in &granules {
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: `handle` is a valid out-pointer; `prop` is a fully initialized
                // property struct that outlives the call; flags must be 0.
                let created = unsafe { sys::cuMemCreate(&mut handle, gran, &prop, 0) };
                check_alloc(op, created, bytes)?;
                // SAFETY: `g` is a granule-aligned, unmapped granule inside a live reservation
                // of this device (checked above, under the lock held across the calls);
                // `handle` is the `gran`-byte allocation just created; offset and flags 0.
                if let Err(e) = check(op, unsafe { sys::cuMemMap(g, gran, 0, handle, 0) }) {
                    // SAFETY: `handle` was just created and never mapped; released once.
                    let _ = unsafe { sys::cuMemRelease(handle) };
                    return Err(e);
                }
                done.push((g, handle));
            }
            let desc = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: every granule of `addr..addr+bytes` was just mapped above; `desc` is one
            // valid access descriptor that outlives the call, matching the count of 1.
            check(op, unsafe { sys::cuMemSetAccess(addr.0, bytes, &desc, 1) })
        });
        match result {
            Ok(()) => {
                vmm.handles.extend(done);
                tracing::debug!(%addr, bytes, "memory mapped");
                Ok(())
            }
            Err(e) => {
                for (g, handle) in done {
                    if let Err(undo) = inner.unmap_granule(op, g, handle) {
                        // Keep what could not be undone listed, so teardown retries it.
                        tracing::debug!(error = %undo, granule = %DevicePtr(g), "undoing a map failed");
                        vmm.handles.insert(g, handle);
                    }
                }
                Err(e)
            }
        }
    }

    /// Synchronizes the runtime and side streams (work that may still use the memory), then
    /// `cuMemUnmap` and `cuMemRelease` per granule. Every granule is attempted; the first error
    /// is returned after all of them, and a granule that failed stays mapped.
    fn unmap(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Unmap;
        let inner = &self.queue.inner;
        let gran = inner.granularity;
        let granules = granules(op, addr, bytes, gran)?;
        let mut vmm = inner.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if granules.iter().any(|g| !vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is not mapped"));
        }
        inner.enter(op)?;
        inner.sync(op, inner.stream)?;
        inner.sync(op, inner.side_stream)?;
        let mut first = Ok(());
        for g in granules {
            let Some(handle) = vmm.handles.remove(&g) else {
                continue;
            };
            if let Err(e) = inner.unmap_granule(op, g, handle) {
                vmm.handles.insert(g, handle);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        tracing::debug!(%addr, bytes, "memory unmapped");
        first
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

    /// `cuStreamBeginCapture_v2` on the runtime stream with the matching `CUstreamCaptureMode`.
    fn begin_capture(&self, _: &CoreOnly, mode: CaptureMode) -> Result<(), DeviceError> {
        let op = DeviceOp::BeginCapture;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        if inner.capture_status(op)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "a capture is already underway on the runtime stream",
            });
        }
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: the runtime stream is live and not capturing (checked above).
        check(op, unsafe {
            sys::cuStreamBeginCapture_v2(inner.stream, mode)
        })
    }

    /// `cuStreamEndCapture`, `cuGraphInstantiateWithFlags` (flags 0) and `cuGraphUpload` on the
    /// runtime stream. If the end fails (an invalidated capture, unjoined work), the partial
    /// graph is destroyed and the error returned with `EndCapture`; the stream is left out of
    /// capture mode either way, so core must not call `abort_capture` after a failed
    /// `end_capture` (it would answer `CaptureState`).
    fn end_capture(&self, _: &CoreOnly) -> Result<CudaGraph, DeviceError> {
        let graph = self.end_stream_capture()?;
        self.instantiate(graph)
    }

    /// Ends the capture, then `cuGraphExecUpdate`s `target`'s executable with it; when the
    /// driver refuses, instantiates the capture into `target` instead.
    fn end_capture_into(
        &self,
        _: &CoreOnly,
        target: &mut CudaGraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        let graph = self.end_stream_capture()?;
        match target.update(graph) {
            Ok(None) => Ok(None),
            Ok(Some(refusal)) => {
                *target = self.instantiate(graph)?;
                Ok(Some(refusal))
            }
            Err(err) => {
                graph::destroy_orphan(&self.queue.inner, graph, ptr::null_mut());
                Err(err)
            }
        }
    }

    /// If the runtime stream is capturing (active or invalidated), ends the capture and destroys
    /// whatever graph comes back, ignoring the capture errors the end reports (that is what
    /// aborting a broken capture means). Errors with `CaptureState` if no capture is underway.
    ///
    /// The driver API keeps no per-thread "last error" (that is the runtime API's
    /// `cudaGetLastError`), and capture violations are not sticky context errors, so once the
    /// capture has ended there is no error state left to clear: the stream is usable eagerly.
    fn abort_capture(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let op = DeviceOp::EndCapture;
        let inner = &self.queue.inner;
        inner.enter_capture(op)?;
        let ended = inner.end_and_discard();
        if ended != sys::CUresult::CUDA_SUCCESS && !is_capture_error(ended) {
            return Err(map(op, ended, 0));
        }
        if inner.capture_status(op)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "the capture could not be ended",
            });
        }
        Ok(())
    }

    /// `cuGraphLaunch` on the runtime stream.
    fn launch(&self, _: &CoreOnly, graph: &CudaGraph) -> Result<(), DeviceError> {
        let op = DeviceOp::GraphLaunch;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        if !Arc::ptr_eq(&graph.device, inner) {
            return Err(invalid_argument(op, FOREIGN_GRAPH));
        }
        let handles = graph.lock();
        // SAFETY: `exec` is the live executable of `graph` (destroyed only when the graph is
        // dropped, impossible while borrowed), instantiated in this device's context, and its
        // use is serialized by the graph's lock; the runtime stream is live.
        check(op, unsafe {
            sys::cuGraphLaunch(handles.exec, inner.stream)
        })
    }

    /// `cuGraphExecMemcpyNodeSetParams` on the copy node writing `dst` (found once, cached).
    fn repoint_copy(
        &self,
        _: &CoreOnly,
        graph: &mut CudaGraph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::GraphUpdate;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        if !Arc::ptr_eq(&graph.device, inner) {
            return Err(invalid_argument(op, FOREIGN_GRAPH));
        }
        graph.repoint_copy(inner.ctx, recorded, now)
    }

    /// Patches the executable's kernel nodes (see the `patch` module).
    fn redirect_reads(
        &self,
        _: &CoreOnly,
        graph: &mut CudaGraph,
        copy: CopyEnds,
        len: usize,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        let op = DeviceOp::GraphUpdate;
        let inner = &self.queue.inner;
        inner.enter(op)?;
        if !Arc::ptr_eq(&graph.device, inner) {
            return Err(invalid_argument(op, FOREIGN_GRAPH));
        }
        graph.redirect_reads(copy, len, to)
    }

    /// `cuGraphGetNodes` and `cuGraphNodeGetType` over the captured graph.
    fn summarize(&self, graph: &CudaGraph) -> Result<GraphSummary, DeviceError> {
        self.queue.inner.enter(INSPECT_OP)?;
        let handles = graph.lock();
        graph::summarize(INSPECT_OP, handles.graph)
    }

    fn take_sticky_error(&self, _: &CoreOnly) -> Option<DeviceError> {
        self.queue.inner.take_sticky()
    }

    fn record_sticky_error(&self, _: &CoreOnly, error: DeviceError) {
        self.queue.inner.record_sticky(error);
    }
}
