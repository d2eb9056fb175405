//! `Inner`, a device's shared state: its primary context and runtime stream (opened and released here), the sticky error slot, and entering an operation (context current, capture status).

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;
use graft_core::backend::StickyError;
use graft_core::{DeviceError, DeviceId, DeviceOp};

use crate::blas::Blas;
use crate::driver::driver_ready;
use crate::error::{check, check_alloc, invalid_argument};
#[cfg(feature = "test-support")]
use crate::test_hooks::SideStream;
use crate::vmm::{self, Vmm};

/// `CU_STREAM_CAPTURE_STATUS_NONE` as the number [`Inner::capture_status`] returns.
pub(crate) const CAPTURE_NONE: u32 =
    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;
/// `CU_STREAM_CAPTURE_STATUS_INVALIDATED` as the number [`Inner::capture_status`] returns.
pub(crate) const CAPTURE_INVALIDATED: u32 =
    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED as u32;

/// The shared state of a device. Handles are null until created, so a partly built `Inner`
/// (a failing [`Inner::open`]) releases exactly what it got.
pub(crate) struct Inner {
    pub(crate) id: DeviceId,
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) cu_device: sys::CUdevice,
    /// The device's primary context; non-null once retained (and then released in `Drop`).
    pub(crate) ctx: sys::CUcontext,
    /// The runtime stream: all work and all captures.
    pub(crate) stream: sys::CUstream,
    /// The cudarc stream `stream` was adopted from (`CudaDevice::from_stream`): kept alive
    /// while the device lives, and never destroyed here (its owner does that).
    adopted: Option<Arc<cudarc::driver::CudaStream>>,
    /// A second stream and its fork/join events, for the tests' side-stream work.
    #[cfg(feature = "test-support")]
    pub(crate) side: SideStream,
    /// The cuBLAS handle and its workspace, made once (see the `blas` module).
    pub(crate) blas: OnceLock<Blas>,
    /// Serializes the handle's creation.
    pub(crate) blas_init: Mutex<()>,
    sticky: StickyError,
    /// Set whenever `sticky` may hold an error, so the fast path checks an atomic, not a mutex.
    sticky_pending: AtomicBool,
    /// The physical mapping granularity (the driver's recommended granularity for this device).
    pub(crate) granularity: usize,
    /// Reservations and mapped granules, for validation and teardown.
    pub(crate) vmm: Mutex<Vmm>,
    /// The capture's conditional nodes (see the `conditional` module).
    pub(crate) conditional: Mutex<crate::conditional::ConditionalState>,
    /// The kernel that sets a conditional node's handle, loaded on first use.
    pub(crate) set_conditional: OnceLock<crate::conditional::SetConditional>,
}

// SAFETY: the raw handles in `Inner` (context, streams, events, the cuBLAS handle) are CUDA
// driver or library handles, which may be used from any thread once the owning context is
// current on it; every operation makes the context current first (`make_current`). The cuBLAS
// handle is created once (under `blas_init`) and only read after, and cuBLAS allows one handle
// to be used from several host threads. Streams and events are internally synchronized by the
// driver. The remaining fields are Send + Sync (Mutex, atomics, String). Handles are created in
// `open` and destroyed only in `Drop`, with exclusive access.
unsafe impl Send for Inner {}
// SAFETY: see the `Send` impl: shared use only passes the handles to driver calls, which are
// thread-safe for contexts, streams, events and launched functions; graph handles, which are
// not, live in `CudaGraph` behind a mutex.
unsafe impl Sync for Inner {}

impl Inner {
    /// Opens device `ordinal`: initializes the driver, retains the device's primary context
    /// and makes it current on this thread, reads the allocation granularity, and creates the
    /// runtime stream (non-blocking, so it never synchronizes with the legacy default stream),
    /// or adopts `adopted`. Failures are reported with `DeviceOp::Init`.
    pub(crate) fn open(
        ordinal: usize,
        adopted: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<Inner, DeviceError> {
        let op = DeviceOp::Init;
        driver_ready()?;
        let ordinal_c = c_int::try_from(ordinal)
            .map_err(|_| invalid_argument(op, "the device ordinal exceeds i32::MAX"))?;
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: the driver is initialized (driver_ready); `cu_device` is a valid out-pointer.
        check(op, unsafe { sys::cuDeviceGet(&mut cu_device, ordinal_c) })?;

        let mut name_buf: [c_char; 256] = [0; 256];
        // SAFETY: `name_buf` has room for the 256 bytes passed as its length.
        check(op, unsafe {
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
            #[cfg(feature = "test-support")]
            side: SideStream::default(),
            blas: OnceLock::new(),
            blas_init: Mutex::new(()),
            sticky: StickyError::default(),
            sticky_pending: AtomicBool::new(false),
            granularity: 0,
            vmm: Mutex::new(Vmm::default()),
            conditional: Mutex::default(),
            set_conditional: OnceLock::new(),
        };
        // From here on, an early return drops `inner`, which releases what was created.
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `cu_device` is a valid device; `ctx` is a valid out-pointer. The reference is
        // released once in `Inner::drop` (which runs only if `inner.ctx` is set, below).
        check(op, unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, cu_device)
        })?;
        inner.ctx = ctx;
        inner.make_current(op)?;
        inner.granularity = vmm::granularity(op, cu_device)?;
        match adopted {
            Some(stream) => {
                inner.stream = stream.cu_stream();
                inner.adopted = Some(stream);
            }
            None => inner.stream = create_stream(op)?,
        }
        #[cfg(feature = "test-support")]
        inner.side.create()?;
        Ok(inner)
    }

    /// Makes this device's context current on the calling thread. Called unconditionally
    /// (a thread-local store in the driver) rather than cached: a cached "already current"
    /// would go stale when another library, or a dropped device, changes the thread's context.
    #[inline]
    pub(crate) fn make_current(&self, op: DeviceOp) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is the primary context retained in `open` and released only in `Drop`,
        // which cannot run while `&self` is alive.
        check(op, unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Puts `err` in the sticky slot (unless one is already waiting).
    pub(crate) fn record_sticky(&self, err: DeviceError) {
        self.sticky.record(err);
        self.sticky_pending.store(true, Ordering::Release);
    }

    /// Takes the waiting sticky error, if any: one atomic load when there is none.
    #[inline]
    pub(crate) fn take_sticky(&self) -> Option<DeviceError> {
        if !self.sticky_pending.load(Ordering::Acquire) {
            return None;
        }
        self.sticky_pending.store(false, Ordering::Release);
        self.sticky.take()
    }

    /// Entry of every operation: makes the context current. (Sticky errors are not checked
    /// here: core polls `take_sticky_error` on every graft call.)
    #[inline]
    pub(crate) fn enter(&self, op: DeviceOp) -> Result<(), DeviceError> {
        self.make_current(op)
    }

    /// The runtime stream's capture status (`CU_STREAM_CAPTURE_STATUS_*` as a number).
    pub(crate) fn capture_status(&self, op: DeviceOp) -> Result<u32, DeviceError> {
        let mut status: u32 = CAPTURE_NONE;
        // SAFETY: `stream` is the live runtime stream (created in `open`, destroyed in `Drop`);
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
    pub(crate) fn enter_capture(&self, op: DeviceOp) -> Result<(), DeviceError> {
        self.enter(op)?;
        if self.capture_status(op)? == CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "no capture is underway on the runtime stream",
            });
        }
        Ok(())
    }

    /// Runs `f` with the calling thread switched to relaxed capture mode, as PyTorch's caching
    /// allocator does: in global or thread-local mode CUDA refuses allocation and mapping calls
    /// during a capture, but the pool must be able to grow inside one.
    pub(crate) fn with_relaxed<T>(
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

    /// Synchronizes `stream`, mapping a failure to `op`.
    pub(crate) fn sync(&self, op: DeviceOp, stream: sys::CUstream) -> Result<(), DeviceError> {
        // SAFETY: `stream` is one of this device's live streams.
        check(op, unsafe { sys::cuStreamSynchronize(stream) })
    }
}

/// A new non-blocking stream in the current context, owned by the caller, who destroys it
/// once.
pub(crate) fn create_stream(op: DeviceOp) -> Result<sys::CUstream, DeviceError> {
    let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
    let mut stream: sys::CUstream = ptr::null_mut();
    // SAFETY: the caller made the context current; `stream` is a valid out-pointer.
    check(op, unsafe {
        sys::cuStreamCreate(&mut stream, non_blocking)
    })?;
    Ok(stream)
}

/// Destroys a stream made by [`create_stream`] (null: nothing), swapped out of `slot` so it
/// is destroyed once. Errors are ignored: this only runs in teardown.
pub(crate) fn destroy_stream(slot: &mut sys::CUstream) {
    let stream = std::mem::replace(slot, ptr::null_mut());
    if !stream.is_null() {
        // SAFETY: created by cuStreamCreate (`create_stream`), synchronized by the caller,
        // destroyed exactly once (swapped out).
        let _ = unsafe { sys::cuStreamDestroy_v2(stream) };
    }
}

impl Drop for Inner {
    /// Releases what `open` created, in reverse order. Errors here have nowhere to go (the
    /// sticky slot dies with the device, and every graph, which holds an `Arc` to it, is
    /// already gone), so they are ignored: teardown continues so that the context is still
    /// released.
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
        #[cfg(feature = "test-support")]
        self.side.release();
        self.discard_conditionals();
        self.unload_set_conditional();
        if let Some(mut blas) = self.blas.take() {
            // The stream is synchronized above, so no GEMM still uses the workspace.
            let _ = blas.destroy();
        }
        // Memory pools did not give back (a runtime leaked, or a test stopped early).
        let vmm = std::mem::take(self.vmm.get_mut().unwrap_or_else(PoisonError::into_inner));
        vmm.release(self);
        if self.adopted.is_some() {
            // Not ours to destroy: the adopted stream's owner (cudarc) does that.
            self.stream = ptr::null_mut();
        }
        destroy_stream(&mut self.stream);
        // SAFETY: the primary context of `cu_device` was retained once in `open` (ctx non-null)
        // and is released once here. Nothing of this device uses it afterwards.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
        self.ctx = ptr::null_mut();
    }
}
