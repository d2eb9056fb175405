//! [`dense_sum`](super::dense_sum) on CUDA: one cuBLAS GEMM per term into one output, the
//! first with β = 0 and the rest with β = 1, so the products add in the GEMMs themselves.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t;
use candle_core::cuda_backend::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, Result, Storage, Tensor, WithDType};

use crate::KernelError;
use crate::nvrtc::view;

const OP: &str = "dense_sum";

/// The sum `Σ a_i · w_i` (`[rows, k]`) in the dtype of `first` (the first term's `a`).
pub(super) fn dense_sum(
    terms: &[(Tensor, Tensor, usize)],
    rows: usize,
    k: usize,
    first: &CudaStorage,
    device: &CudaDevice,
) -> Result<CudaStorageSlice> {
    Ok(match &first.slice {
        CudaStorageSlice::F32(_) => CudaStorageSlice::F32(sum_of(terms, rows, k, device)?),
        CudaStorageSlice::BF16(_) => CudaStorageSlice::BF16(sum_of(terms, rows, k, device)?),
        CudaStorageSlice::F16(_) => CudaStorageSlice::F16(sum_of(terms, rows, k, device)?),
        _ => {
            return Err(KernelError::UnsupportedDType {
                op: OP,
                input: "a",
                got: first.dtype(),
            }
            .into());
        }
    })
}

/// [`dense_sum`] for dtype `T`. In cuBLAS's column-major terms the output (`[rows, k]`
/// row-major: `k x rows`, leading dimension `k`) is `Σ w_iᵀᵀ · a_iᵀ`: `w_i` (`[n_i, k]`
/// row-major) read as `k x n_i`, `a_i` (`[rows, n_i]`) as `n_i x rows`, neither transposed.
fn sum_of<T>(
    terms: &[(Tensor, Tensor, usize)],
    rows: usize,
    k: usize,
    device: &CudaDevice,
) -> Result<CudaSlice<T>>
where
    T: WithDType + CudaDType + DeviceRepr,
    CudaBlas: Gemm<T>,
{
    let c_int = |what, size: usize| -> Result<i32> {
        i32::try_from(size).map_err(|_| KernelError::TooLarge { op: OP, what, size }.into())
    };
    let (rows_c, k_c) = (c_int("the rows", rows)?, c_int("the columns", k)?);
    // SAFETY: the first GEMM below (β = 0) writes all rows * k elements, on the device's
    // stream, before the later ones (β = 1) read them and before anything else does.
    let mut out = unsafe { device.alloc::<T>(rows * k)? };
    let blas = device.cublas_handle();
    for (i, (a, w, n)) in terms.iter().enumerate() {
        let (a_storage, al) = a.storage_and_layout();
        let (w_storage, wl) = w.storage_and_layout();
        let (Storage::Cuda(a), Storage::Cuda(w)) = (&*a_storage, &*w_storage) else {
            return Err(KernelError::Device { op: OP, input: "a" }.into());
        };
        let a = view(OP, "a", a.as_cuda_slice::<T>()?, al)?;
        let w = view(OP, "w", w.as_cuda_slice::<T>()?, wl)?;
        let n_c = c_int("a term's width", *n)?;
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: k_c,
            n: rows_c,
            k: n_c,
            alpha: T::from_f64(1.0),
            lda: k_c,
            ldb: n_c,
            beta: T::from_f64(if i == 0 { 0.0 } else { 1.0 }),
            ldc: k_c,
        };
        // SAFETY: `w` holds n * k elements and `a` rows * n (checked `[n, k]` and `[rows, n]`,
        // both contiguous, by the wrapper), the output rows * k; all of `device`, used on its
        // stream, which the handle is bound to.
        unsafe { blas.gemm(cfg, &w, &a, &mut out) }.map_err(candle_core::Error::wrap)?;
    }
    Ok(out)
}
