//! cuBLAS: creating and configuring a handle (stream, workspace, math and pointer modes), destroying it, and `cublasSgemm`, each status mapped to a typed error.

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use cudarc::cublas::sys as blas;
use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

pub(crate) use blas::cublasHandle_t as Handle;

/// Whether libcublas can be loaded (with `dynamic-linking` the loader already found it).
pub(crate) fn library_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: only `dlopen`s candidate names of libcublas and drops each handle.
        unsafe { blas::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    true
}

/// A new handle (`cublasCreate`), bound to the current context (through the runtime API);
/// destroyed once with [`destroy`].
pub(crate) fn create(op: DeviceOp) -> Result<Handle, DeviceError> {
    let mut handle: Handle = ptr::null_mut();
    // SAFETY: `handle` is a valid out-pointer; the caller made the device's primary context
    // current, so cuBLAS binds the handle to it.
    blas_check(op, unsafe { blas::cublasCreate_v2(&mut handle) })?;
    Ok(handle)
}

/// Binds `handle` to `stream` (`cublasSetStream`).
pub(crate) fn set_stream(
    op: DeviceOp,
    handle: Handle,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: a live handle; the stream is a live stream of the context the handle is bound to
    // (a driver CUstream is a runtime cudaStream_t).
    blas_check(op, unsafe {
        blas::cublasSetStream_v2(handle, stream.cast())
    })
}

/// Gives `handle` the workspace `bytes` at `workspace` (`cublasSetWorkspace`).
pub(crate) fn set_workspace(
    op: DeviceOp,
    handle: Handle,
    workspace: u64,
    bytes: usize,
) -> Result<(), DeviceError> {
    // SAFETY: a live handle; the workspace is `bytes` of device memory of its context,
    // 256-byte aligned (cuMemAlloc), which the caller keeps until the handle is destroyed.
    blas_check(op, unsafe {
        blas::cublasSetWorkspace_v2(handle, workspace as *mut c_void, bytes)
    })
}

/// Sets `handle` to graft's numerics: `CUBLAS_DEFAULT_MATH` (pure fp32) and host pointer mode.
pub(crate) fn set_modes(op: DeviceOp, handle: Handle) -> Result<(), DeviceError> {
    // SAFETY: a live handle and valid enum values.
    blas_check(op, unsafe {
        blas::cublasSetMathMode(handle, blas::cublasMath_t::CUBLAS_DEFAULT_MATH)
    })?;
    // SAFETY: as above.
    blas_check(op, unsafe {
        blas::cublasSetPointerMode_v2(handle, blas::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST)
    })
}

/// Destroys a handle from [`create`] (`cublasDestroy`). A panic inside cudarc (a missing
/// symbol) is swallowed: the handle is then left as it is.
pub(crate) fn destroy(op: DeviceOp, handle: Handle) -> Result<(), DeviceError> {
    // SAFETY: created by `create`, owned by the caller alone and destroyed exactly once.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        blas::cublasDestroy_v2(handle)
    }));
    match r {
        Ok(status) => blas_check(op, status),
        Err(_) => Ok(()),
    }
}

/// The column-major GEMM `C = alpha * op(A) · B + beta * C` (`cublasSgemm`, `op(B)` untransposed)
/// on `handle`'s stream: `A` is `ta` of an `lda`-strided matrix at `a`, `B` `ldb`-strided at `b`,
/// `C` `m × n`, `ldc`-strided at `c`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    op: DeviceOp,
    handle: Handle,
    ta: bool,
    (m, n, k): (c_int, c_int, c_int),
    alpha: f32,
    (a, lda): (u64, c_int),
    (b, ldb): (u64, c_int),
    beta: f32,
    (c, ldc): (u64, c_int),
) -> Result<(), DeviceError> {
    let ta = if ta {
        blas::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas::cublasOperation_t::CUBLAS_OP_N
    };
    // SAFETY: the handle is live and bound to a live stream; alpha and beta are host values
    // read during the call (pointer mode host, `set_modes`); `a`, `b` and `c` are device
    // addresses, which the host never dereferences: the caller checks they hold the matrices
    // (an address past a buffer is a device fault the driver reports, not host UB).
    blas_check(op, unsafe {
        blas::cublasSgemm_v2(
            handle,
            ta,
            blas::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            k,
            &alpha,
            a as *const f32,
            lda,
            b as *const f32,
            ldb,
            &beta,
            c as *mut f32,
            ldc,
        )
    })
}

/// Maps a cuBLAS status to a device error named after it (`Library`, or `OutOfMemory`).
pub(crate) fn blas_check(op: DeviceOp, status: blas::cublasStatus_t) -> Result<(), DeviceError> {
    use blas::cublasStatus_t as S;
    let name = match status {
        S::CUBLAS_STATUS_SUCCESS => return Ok(()),
        S::CUBLAS_STATUS_ALLOC_FAILED => {
            return Err(DeviceError::OutOfMemory { op, bytes: 0 });
        }
        S::CUBLAS_STATUS_NOT_INITIALIZED => "CUBLAS_STATUS_NOT_INITIALIZED",
        S::CUBLAS_STATUS_INVALID_VALUE => "CUBLAS_STATUS_INVALID_VALUE",
        S::CUBLAS_STATUS_ARCH_MISMATCH => "CUBLAS_STATUS_ARCH_MISMATCH",
        S::CUBLAS_STATUS_MAPPING_ERROR => "CUBLAS_STATUS_MAPPING_ERROR",
        S::CUBLAS_STATUS_EXECUTION_FAILED => "CUBLAS_STATUS_EXECUTION_FAILED",
        S::CUBLAS_STATUS_INTERNAL_ERROR => "CUBLAS_STATUS_INTERNAL_ERROR",
        S::CUBLAS_STATUS_NOT_SUPPORTED => "CUBLAS_STATUS_NOT_SUPPORTED",
        S::CUBLAS_STATUS_LICENSE_ERROR => "CUBLAS_STATUS_LICENSE_ERROR",
    };
    Err(DeviceError::Library {
        op,
        library: "cuBLAS",
        code: status as u32,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_library_errors() {
        let op = DeviceOp::KernelLaunch;
        assert_eq!(
            blas_check(op, blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS),
            Ok(())
        );
        assert_eq!(
            blas_check(op, blas::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE),
            Err(DeviceError::Library {
                op,
                library: "cuBLAS",
                code: blas::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE as u32,
                name: "CUBLAS_STATUS_INVALID_VALUE",
            })
        );
        assert_eq!(
            blas_check(op, blas::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED),
            Err(DeviceError::OutOfMemory { op, bytes: 0 })
        );
    }
}
