//! [`Context`], a device's primary context and runtime stream (opened and released here), its identity, the sticky error slot, and what every subsystem does through them: entering an operation (context current, capture status), relaxed capture mode, the backend's own allocations, and destroying graphs that never became a `CudaGraph`.

use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;
use graft_core::backend::StickyError;
use graft_core::{DeviceError, DeviceId, DeviceOp};

use crate::driver::stream::CAPTURE_NONE;
use crate::driver::{self, driver_ready};

/// A device's primary context and runtime stream. Handles are null until created, so a
/// partly opened `Context` (a failing [`Context::open`]) releases exactly what it got.
pub(crate) struct Context {
    pub(crate) id: DeviceId,
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    /// Compute capability, major and minor.
    pub(crate) capability: (u32, u32),
    pub(crate) cu_device: sys::CUdevice,
    /// The device's primary context; non-null once retained (and then released in `Drop`).
    pub(crate) ctx: sys::CUcontext,
    /// The runtime stream: all work and all captures.
    pub(crate) stream: sys::CUstream,
    /// The cudarc stream `stream` was adopted from (`CudaDevice::from_stream`): kept alive
    /// while the device lives, and never destroyed here (its owner does that).
    adopted: Option<Arc<cudarc::driver::CudaStream>>,
    sticky: StickyError,
    /// Set whenever `sticky` may hold an error, so the fast path checks an atomic, not a mutex.
    sticky_pending: AtomicBool,
}

// SAFETY: the raw handles in `Context` (the context and the runtime stream) are CUDA driver
// handles, which may be used from any thread once the owning context is current on it; every
// operation makes the context current first (`make_current`). Streams are internally
// synchronized by the driver. The remaining fields are Send + Sync (atomics, String, the
// sticky slot's mutex). Handles are created in `open` and destroyed only in `Drop`, with
// exclusive access.
unsafe impl Send for Context {}
// SAFETY: see the `Send` impl: shared use only passes the handles to driver calls, which are
// thread-safe for contexts and streams.
unsafe impl Sync for Context {}

impl Context {
    /// Opens device `ordinal`: initializes the driver, retains the device's primary context
    /// and makes it current on this thread, and creates the runtime stream (non-blocking, so it
    /// never synchronizes with the legacy default stream), or adopts `adopted`. Failures are
    /// reported with `DeviceOp::Init`.
    pub(crate) fn open(
        ordinal: usize,
        adopted: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<Context, DeviceError> {
        let op = DeviceOp::Init;
        driver_ready()?;
        let cu_device = driver::device::get(op, ordinal)?;
        let name = driver::device::name(op, cu_device)?;
        let capability = driver::device::compute_capability(op, cu_device)?;
        let mut context = Context {
            id: DeviceId::fresh(),
            ordinal,
            name,
            capability,
            cu_device,
            ctx: ptr::null_mut(),
            stream: ptr::null_mut(),
            adopted: None,
            sticky: StickyError::default(),
            sticky_pending: AtomicBool::new(false),
        };
        // From here on, an early return drops `context`, which releases what was created.
        context.ctx = driver::device::retain_primary(op, cu_device)?;
        context.make_current(op)?;
        match adopted {
            Some(stream) => {
                context.stream = stream.cu_stream();
                context.adopted = Some(stream);
            }
            None => context.stream = driver::stream::create(op)?,
        }
        Ok(context)
    }

    /// Makes this device's context current on the calling thread. Called unconditionally
    /// (a thread-local store in the driver) rather than cached: a cached "already current"
    /// would go stale when another library, or a dropped device, changes the thread's context.
    #[inline]
    pub(crate) fn make_current(&self, op: DeviceOp) -> Result<(), DeviceError> {
        driver::device::set_current(op, self.ctx)
    }

    /// Puts `err` in the sticky slot (unless one is already waiting).
    pub(crate) fn record_sticky(&self, err: DeviceError) {
        self.sticky.record(err);
        self.sticky_pending.store(true, Ordering::Release);
    }

    /// Puts the error of `result`, if any, in the sticky slot (for teardown paths, whose
    /// errors have nowhere else to go).
    pub(crate) fn sticky_on_error(&self, result: Result<(), DeviceError>) {
        if let Err(err) = result {
            self.record_sticky(err);
        }
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
        driver::stream::capture_status(op, self.stream)
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

    /// Whether the runtime stream is capturing now (active or invalidated); an error asking
    /// counts as not capturing.
    pub(crate) fn stream_capturing(&self, op: DeviceOp) -> bool {
        matches!(self.capture_status(op), Ok(s) if s != CAPTURE_NONE)
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
        driver::stream::exchange_capture_mode(op, &mut mode)?;
        let result = f();
        // Restores the mode saved by the first exchange.
        let restored = driver::stream::exchange_capture_mode(op, &mut mode);
        let value = result?;
        restored?;
        Ok(value)
    }

    /// `cuMemAlloc` in relaxed capture mode (legal during a capture), for the backend's own
    /// memory (the cuBLAS workspace, conditional bodies' scratch, NCCL votes). The caller owns
    /// the memory and frees it once.
    pub(crate) fn alloc_relaxed(&self, op: DeviceOp, bytes: usize) -> Result<u64, DeviceError> {
        self.with_relaxed(op, || driver::memory::alloc(op, bytes))
    }

    /// Synchronizes the runtime stream, mapping a failure to `op`.
    pub(crate) fn sync(&self, op: DeviceOp) -> Result<(), DeviceError> {
        driver::stream::synchronize(op, self.stream)
    }

    /// Ends the runtime stream's capture, whatever its state, and destroys any graph it
    /// returns. The capture errors the end reports are ignored (that is what aborting a broken
    /// capture means); any other is returned.
    pub(crate) fn end_and_discard(&self, op: DeviceOp) -> Result<(), DeviceError> {
        let (graph, ended) = driver::stream::end_broken_capture(op, self.stream);
        self.destroy_orphan(graph, ptr::null_mut());
        ended
    }

    /// Destroys a graph that never made it into a `CudaGraph` (a failed end, instantiate or
    /// upload, a body already copied, an aborted capture's graph): its executable, if any,
    /// then the graph (null: nothing). Failures go to the sticky slot: the caller is already
    /// returning another error, or has nowhere to report one.
    pub(crate) fn destroy_orphan(&self, graph: sys::CUgraph, exec: sys::CUgraphExec) {
        self.sticky_on_error(driver::graph::destroy_exec(DeviceOp::GraphDestroy, exec));
        self.sticky_on_error(driver::graph::destroy(DeviceOp::GraphDestroy, graph));
    }

    /// Frees memory from [`Context::alloc_relaxed`] that a graph, or a discarded capture,
    /// owned (conditional bodies' scratch); failures go to the sticky slot. No launch that uses
    /// it may be pending (the graph that used it is destroyed, and the driver defers until
    /// launches end).
    pub(crate) fn free_scratch(&self, scratch: Vec<u64>) {
        for ptr in scratch {
            self.sticky_on_error(driver::memory::free(DeviceOp::GraphDestroy, ptr));
        }
    }

    /// Teardown's first step: makes the context current, ends a capture left open (a panic
    /// inside a body would make every later call fail) and waits for the runtime stream.
    /// Errors are ignored: they have nowhere to go.
    pub(crate) fn settle(&self) {
        let _ = self.make_current(DeviceOp::GraphDestroy);
        if !self.stream.is_null() {
            if self.stream_capturing(DeviceOp::EndCapture) {
                let _ = self.end_and_discard(DeviceOp::EndCapture);
            }
            let _ = self.sync(DeviceOp::Synchronize);
        }
    }
}

impl Drop for Context {
    /// Releases what `open` created, in reverse order, after [`Context::settle`] (which the
    /// device ran already before releasing its subsystems; a second time it finds nothing to
    /// do). Errors here have nowhere to go (the sticky slot dies with the device, and every
    /// graph, which holds an `Arc` to it, is already gone), so they are ignored: teardown
    /// continues so that the context is still released.
    fn drop(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        self.settle();
        if self.adopted.is_some() {
            // Not ours to destroy: the adopted stream's owner (cudarc) does that.
            self.stream = ptr::null_mut();
        }
        let _ = driver::stream::destroy(DeviceOp::GraphDestroy, &mut self.stream);
        let _ = driver::device::release_primary(DeviceOp::GraphDestroy, self.cu_device);
        self.ctx = ptr::null_mut();
    }
}
