//! The body-facing [`CudaQueue`] methods on the runtime stream: copies, host reads and writes (on graft buffers, checked; the raw-address versions serve core through the `Device` trait), cuBLAS GEMMs (over the `blas` module), synchronize, and what a queue says about its device.

use std::sync::Arc;

use graft_core::{Buffer, DeviceError, DeviceId, DeviceOp, DevicePtr};

use crate::blas::Sgemm;
use crate::device::CudaQueue;
use crate::driver;
use crate::driver::stream::CAPTURE_NONE;
use cudarc::driver::sys;

impl CudaQueue {
    /// The stream this queue enqueues on: the runtime stream, or the side stream for
    /// `Device::side_queue`.
    pub(crate) fn stream(&self) -> sys::CUstream {
        if self.side {
            self.inner.side.stream()
        } else {
            self.inner.stream
        }
    }

    /// The identity of the device this queue belongs to.
    pub fn device_id(&self) -> DeviceId {
        self.inner.id
    }

    /// The device's compute capability, major and minor (9.0 on an H100 or H200): whether
    /// kernels may be launched as programmatic dependents (9.0 or later).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.capability
    }

    /// How many handles share this device: clones of the device and of its queues, loaded
    /// modules, graphs; a `CudaDevice` counts twice (its runtime stream's queue and its side
    /// stream's). The device (its context, streams, cuBLAS handle and memory) is
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

    /// Copies the first `bytes` of `src` to the start of `dst` on the runtime stream (recorded
    /// when capturing): both are checked to be this device's, still valid and at least `bytes`
    /// long ([`Buffer::device_addr`]) before anything is enqueued (`InvalidArgument`,
    /// `InvalidBuffer`); overlapping ranges fail with `OverlappingCopy`.
    pub fn copy(&self, dst: &Buffer, src: &Buffer, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Copy;
        let dst = dst.device_addr(op, self.inner.id, 0, bytes)?;
        let src = src.device_addr(op, self.inner.id, 0, bytes)?;
        self.copy_raw(dst, src, bytes)
    }

    /// Writes `src` to the start of `dst`, synchronously, checked as [`Self::copy`] checks its
    /// buffers. Fails during a capture.
    pub fn write(&self, dst: &Buffer, src: &[u8]) -> Result<(), DeviceError> {
        let dst = dst.device_addr(DeviceOp::Write, self.inner.id, 0, src.len())?;
        self.write_raw(dst, src)
    }

    /// Reads the first `dst.len()` bytes of `src` into `dst`, synchronously, checked as
    /// [`Self::copy`] checks its buffers. Fails during a capture.
    pub fn read(&self, src: &Buffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        let src = src.device_addr(DeviceOp::Read, self.inner.id, 0, dst.len())?;
        self.read_raw(src, dst)
    }

    /// Waits until all work on the runtime stream has finished. Fails during a capture.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Synchronize;
        self.inner.enter(op)?;
        self.inner.sync(op)
    }

    /// Creates this device's cuBLAS handle (once; later calls do nothing): bound to the
    /// runtime stream, with a fixed [`WORKSPACE_BYTES`](crate::WORKSPACE_BYTES) workspace, default (fp32) math.
    /// Call it before capturing anything that uses [`CudaQueue::sgemm`]; the first `sgemm`
    /// outside a capture does it too. Fails during a capture (`Capture { Unsupported }`).
    pub fn init_cublas(&self) -> Result<(), DeviceError> {
        self.inner.blas.handle(&self.inner.context).map(|_| ())
    }

    /// Enqueues `C = alpha * A · op(B) + beta * C` (row-major, see [`Sgemm`]) on the runtime
    /// stream through `cublasSgemm_v2` (captured when capturing).
    ///
    /// cuBLAS is column-major; a row-major `[r, c]` matrix is its column-major transpose. So
    /// the call computes `Cᵀ = op(B)ᵀ · Aᵀ`: cuBLAS's first operand is `B` (transposed when
    /// `b_transposed`), its second `A`, with `m` and `n` swapped and leading dimensions equal
    /// to the row lengths (`n` for `B` stored `[k, n]`, `k` for `B` stored `[n, k]`, `k` for
    /// `A`, `n` for `C`). Sizes of zero do nothing; sizes past `i32::MAX`, an operand of
    /// another device or smaller than its matrix are refused (`InvalidArgument`), an operand
    /// graft reused with `InvalidBuffer`.
    ///
    /// The side queue refuses GEMMs (`Unavailable`): the device's one cuBLAS handle is bound to
    /// the runtime stream, and re-binding it around a call would race with GEMMs of the runtime
    /// stream. Run GEMMs in the main closure of `Ctx::fork`.
    pub fn sgemm(&self, g: &Sgemm<'_>) -> Result<(), DeviceError> {
        if self.side {
            return Err(DeviceError::Unavailable {
                op: DeviceOp::KernelLaunch,
                what: "cuBLAS GEMMs run on the runtime stream only; enqueue the GEMM in ctx.fork's main closure",
            });
        }
        self.inner.blas.sgemm(&self.inner.context, g)
    }

    /// `cuMemcpyDtoDAsync` on the runtime stream. Overlapping ranges are rejected before CUDA
    /// sees them; a zero-byte copy does nothing. Callers: the `Device` trait's `copy` (core's
    /// own pool addresses) and [`CudaQueue::copy`] (checked graft buffers).
    pub(crate) fn copy_raw(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
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
        // The ranges do not overlap (checked above); the addresses are device memory of this
        // device that the caller holds (core's pool addresses, or checked graft buffers).
        driver::memory::copy_dtod_async(op, dst.0, src.0, bytes, self.stream())
    }

    /// `cuMemcpyHtoDAsync` on the runtime stream, then `cuStreamSynchronize`. During a capture
    /// CUDA refuses one or the other, and the error is returned as it comes.
    pub(crate) fn write_raw(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        let op = DeviceOp::Write;
        let inner = &self.inner;
        inner.enter(op)?;
        // `dst` is device memory the caller holds (core's pool addresses, a checked graft
        // buffer, or a test's raw address); an invalid one is a driver error, not host UB.
        driver::memory::write_sync(op, dst.0, src, self.stream())
    }

    /// `cuMemcpyDtoHAsync` on the runtime stream (after its earlier work), then
    /// `cuStreamSynchronize`. Fails during a capture, as CUDA does.
    pub(crate) fn read_raw(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        let op = DeviceOp::Read;
        let inner = &self.inner;
        inner.enter(op)?;
        // `src` is device memory the caller holds (as for `write_raw`).
        driver::memory::read_sync(op, src.0, dst, self.stream())
    }
}
