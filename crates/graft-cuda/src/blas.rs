//! cuBLAS on the runtime stream: [`Blas`], one handle per device, made once, and the GEMM
//! behind [`CudaQueue::sgemm`](crate::CudaQueue::sgemm), a row-major f32 matrix product.
//!
//! # Why a fixed workspace
//! cuBLAS needs scratch memory for some GEMM algorithms. Left to itself it allocates that
//! memory lazily, on the first call that needs it, and an allocation while the runtime stream
//! is being captured either fails the capture or (with relaxed capture) bakes an address into
//! the graph that cuBLAS may free later. So the handle is given its own workspace once, at
//! creation, with `cublasSetWorkspace_v2`: [`WORKSPACE_BYTES`] from the device's own
//! segment allocation (`cuMemAlloc`, outside graft's pool), freed only when the device is
//! dropped. The handle is created outside any capture ([`CudaQueue::init_cublas`](crate::CudaQueue::init_cublas), or the
//! first `sgemm` when the stream is not capturing); an `sgemm` that would have to create it
//! during a capture fails with a capture error instead, which graft turns into an eager
//! fallback.
//!
//! # Numerics
//! Math mode is `CUBLAS_DEFAULT_MATH` (pure fp32: no TF32 tensor cores), pointer mode host
//! (alpha and beta are read when the call is enqueued, so a captured GEMM keeps the values it
//! was captured with), atomics not allowed: results are deterministic for one problem size and
//! match the simulator's fp32 loops closely (not bitwise: the summation order differs).

use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::{Mutex, OnceLock, PoisonError};

use graft_core::{Buffer, CaptureViolation, DeviceError, DeviceId, DeviceOp};

use crate::context::Context;
use crate::driver;
use crate::driver::cublas;
use crate::driver::stream::CAPTURE_NONE;

/// Bytes of the workspace each device's cuBLAS handle gets (32 MiB, what PyTorch gives
/// Hopper GPUs).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// A device's cuBLAS: its handle, made once (see [`Blas::handle`]), and the lock that
/// serializes making it.
#[derive(Default)]
pub(crate) struct Blas {
    made: OnceLock<Handle>,
    init: Mutex<()>,
}

/// A cuBLAS handle and its workspace. Destroyed by the device's `Drop`, after the stream is
/// synchronized.
struct Handle {
    handle: cublas::Handle,
    workspace: u64,
}

// SAFETY: the cuBLAS handle is created once (under `Blas::init`) and only read after, and
// cuBLAS allows one handle to be used from several host threads once the owning context is
// current (every use makes it current first); the workspace is device memory graft never
// dereferences on the host. Destroyed only in the device's `Drop`, with exclusive access.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`.
unsafe impl Sync for Handle {}

impl Handle {
    /// Creates the handle on `cx`'s runtime stream with a fixed workspace. The context
    /// must be current and the stream not capturing.
    fn create(cx: &Context) -> Result<Handle, DeviceError> {
        let op = DeviceOp::ModuleLoad;
        if !cublas::library_present() {
            return Err(DeviceError::Unavailable {
                op,
                what: "libcublas could not be loaded; install the CUDA toolkit's cuBLAS or add it to LD_LIBRARY_PATH",
            });
        }
        let mut b = Handle {
            handle: ptr::null_mut(),
            workspace: 0,
        };
        // cudarc panics when a cuBLAS symbol is missing; report that as an error instead.
        let made =
            catch_unwind(AssertUnwindSafe(|| b.setup(cx))).unwrap_or(Err(
                DeviceError::Unavailable {
                    op,
                    what: "libcublas lacks a function graft calls (cudarc panicked calling it); install cuBLAS 12 or later",
                },
            ));
        match made {
            Ok(()) => Ok(b),
            Err(e) => {
                // Setup failed part way: release what it got; the setup error is the one to report.
                let _ = b.destroy();
                Err(e)
            }
        }
    }

    fn setup(&mut self, cx: &Context) -> Result<(), DeviceError> {
        let op = DeviceOp::ModuleLoad;
        // Bound to the device's primary context, current; destroyed in `destroy`.
        let handle = cublas::create(op)?;
        self.handle = handle;
        cublas::set_stream(op, handle, cx.stream)?;
        self.workspace = cx.alloc_relaxed(DeviceOp::RawAlloc, WORKSPACE_BYTES)?;
        // Owned by this handle until `destroy` frees it after the handle.
        cublas::set_workspace(op, handle, self.workspace, WORKSPACE_BYTES)?;
        cublas::set_modes(op, handle)
    }

    /// Destroys the handle, then frees the workspace. The context must be current and the
    /// stream idle (synchronized). Idempotent.
    fn destroy(&mut self) -> Result<(), DeviceError> {
        let mut first = Ok(());
        let handle = std::mem::replace(&mut self.handle, ptr::null_mut());
        if !handle.is_null() {
            // Created in `setup`, destroyed exactly once (swapped out).
            first = cublas::destroy(DeviceOp::GraphDestroy, handle);
        }
        let workspace = std::mem::replace(&mut self.workspace, 0);
        if workspace != 0 {
            // Allocated by cuMemAlloc in `setup`, no longer referenced (the handle that used it
            // is destroyed), freed exactly once (swapped out).
            let r = driver::memory::free(DeviceOp::RawAlloc, workspace);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// One row-major f32 matrix product for [`CudaQueue::sgemm`](crate::CudaQueue::sgemm):
/// `C[m, n] = alpha * A[m, k] · op(B) + beta * C[m, n]`, all matrices dense and row-major.
///
/// `op(B)` is `B` stored as `[k, n]` when `b_transposed` is false, and `Bᵀ` of a `B` stored as
/// `[n, k]` when it is true (the `[out, in]` weight layout of a linear layer: `C = A · Bᵀ`).
///
/// The matrices are graft buffers of the device ([`Operand`]), each checked before cuBLAS
/// sees it to be valid and to hold the bytes its dimensions need from its offset.
#[derive(Clone, Copy, Debug)]
pub struct Sgemm<'a> {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `C` (and of `op(B)`).
    pub n: usize,
    /// Columns of `A`, rows of `op(B)`.
    pub k: usize,
    /// `A`, `m * k` f32s.
    pub a: Operand<'a>,
    /// `B`, `k * n` f32s.
    pub b: Operand<'a>,
    /// `C`, `m * n` f32s; read when `beta != 0`.
    pub c: Operand<'a>,
    /// Whether `B` is stored `[n, k]` (use `Bᵀ`).
    pub b_transposed: bool,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing `C` (0: `C` is only written).
    pub beta: f32,
}

/// A matrix of an [`Sgemm`]: a graft buffer of the device and the byte offset of its first
/// element.
#[derive(Clone, Copy, Debug)]
pub struct Operand<'a> {
    /// The buffer holding the matrix.
    pub buffer: &'a Buffer,
    /// Where the matrix starts, in bytes from the buffer's start.
    pub offset: usize,
}

impl<'a> Operand<'a> {
    /// A matrix at the start of `buffer`.
    pub fn new(buffer: &'a Buffer) -> Operand<'a> {
        Operand { buffer, offset: 0 }
    }

    /// A matrix `offset` bytes into `buffer`.
    pub fn at(buffer: &'a Buffer, offset: usize) -> Operand<'a> {
        Operand { buffer, offset }
    }

    /// The device address of a `rows * cols` f32 matrix here, checked for device `device`.
    fn resolve(self, device: DeviceId, rows: usize, cols: usize) -> Result<u64, DeviceError> {
        let op = DeviceOp::KernelLaunch;
        let bytes = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(size_of::<f32>()))
            .ok_or(DeviceError::InvalidArgument {
                op,
                what: "a matrix's byte size overflows usize",
            })?;
        Ok(self.buffer.device_addr(op, device, self.offset, bytes)?.0)
    }
}

impl Blas {
    /// The handle, created on first use (once; see [`Handle::create`]). Fails during a capture
    /// when it does not exist yet (`Capture { Unsupported }`).
    pub(crate) fn handle(&self, cx: &Context) -> Result<cublas::Handle, DeviceError> {
        if let Some(b) = self.made.get() {
            return Ok(b.handle);
        }
        let _guard = self.init.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = self.made.get() {
            return Ok(b.handle);
        }
        cx.make_current(DeviceOp::ModuleLoad)?;
        cx.enter(DeviceOp::Query)?;
        if cx.capture_status(DeviceOp::Query)? != CAPTURE_NONE {
            return Err(DeviceError::Capture {
                op: DeviceOp::RawAlloc,
                violation: CaptureViolation::Unsupported,
            });
        }
        let b = Handle::create(cx)?;
        let handle = b.handle;
        if let Err(mut lost) = self.made.set(b) {
            // Unreachable under the lock; release the spare rather than leak it.
            let _ = lost.destroy();
        }
        Ok(handle)
    }

    /// Enqueues `C = alpha * A · op(B) + beta * C` (row-major, see [`Sgemm`]) on `cx`'s
    /// runtime stream: see [`CudaQueue::sgemm`](crate::CudaQueue::sgemm).
    pub(crate) fn sgemm(&self, cx: &Context, g: &Sgemm<'_>) -> Result<(), DeviceError> {
        let op = DeviceOp::KernelLaunch;
        cx.make_current(op)?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let a = g.a.resolve(cx.id, g.m, g.k)?;
        let b = g.b.resolve(cx.id, g.k, g.n)?;
        let c = g.c.resolve(cx.id, g.m, g.n)?;
        let handle = self.handle(cx)?;
        let dim = |x: usize| {
            c_int::try_from(x).map_err(|_| DeviceError::InvalidArgument {
                op,
                what: "a matrix dimension exceeds i32::MAX",
            })
        };
        let (m, n, k) = (dim(g.m)?, dim(g.n)?, dim(g.k.max(1))?);
        let k_real = dim(g.k)?;
        let ldb = if g.b_transposed { k } else { n };
        // The handle is live (destroyed only in the device's Drop) and bound to the runtime
        // stream; the leading dimensions are at least the row lengths they describe and at
        // least 1; A, B and C are live graft buffers of this device holding at least the
        // `m * k`, `k * n` and `m * n` f32s the call reads and writes (checked by `resolve`).
        cublas::sgemm(
            op,
            handle,
            g.b_transposed,
            (n, m, k_real),
            g.alpha,
            (b, ldb),
            (a, k),
            g.beta,
            (c, n),
        )
    }

    /// Destroys the handle and frees its workspace, if made (teardown: the context current,
    /// the stream idle). Errors are ignored: they have nowhere to go.
    pub(crate) fn destroy(&mut self) {
        if let Some(mut b) = self.made.take() {
            let _ = b.destroy();
        }
    }
}
