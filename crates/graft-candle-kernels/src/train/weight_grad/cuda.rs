//! [`dense_weight_grad_add`](super::dense_weight_grad_add) on CUDA: one cuBLAS GEMM with
//! β = 1, reading and writing the accumulator.

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t;
use candle_core::cuda_backend::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaViewMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CudaStorage, Layout, Result, WithDType};

use super::{OP, WeightGradAdd};
use crate::KernelError;
use crate::nvrtc::view;

/// `acc [n, k] += dyᵀ · x` for `dy` `[rows, n]` and `x` `[rows, k]`, all of one dtype.
/// `span` is the accumulator's elements in its storage.
pub(super) fn add(
    op: &WeightGradAdd,
    acc: &mut CudaStorage,
    span: (usize, usize),
    inputs: Inputs<'_>,
) -> Result<()> {
    let device = acc.device.clone();
    let (start, end) = span;
    match &mut acc.slice {
        CudaStorageSlice::F32(a) => gemm(op, &mut a.slice_mut(start..end), &inputs, &device),
        CudaStorageSlice::BF16(a) => gemm(op, &mut a.slice_mut(start..end), &inputs, &device),
        CudaStorageSlice::F16(a) => gemm(op, &mut a.slice_mut(start..end), &inputs, &device),
        _ => Err(KernelError::UnsupportedDType {
            op: OP,
            input: "acc",
            got: candle_core::backend::BackendStorage::dtype(acc),
        }
        .into()),
    }
}

/// The GEMM's two read operands with their layouts.
pub(super) struct Inputs<'a> {
    pub dy: &'a CudaStorage,
    pub dl: &'a Layout,
    pub x: &'a CudaStorage,
    pub xl: &'a Layout,
}

/// The GEMM for dtype `T`. In cuBLAS's column-major terms `acc` (`[n, k]` row-major) is
/// `k x n` with leading dimension `k`, `x` (`[rows, k]`) is `k x rows` and `dy` (`[rows, n]`)
/// is `n x rows`: `acc += x · dyᵀ`, the second operand transposed.
fn gemm<T>(
    d: &WeightGradAdd,
    acc: &mut CudaViewMut<'_, T>,
    inputs: &Inputs<'_>,
    device: &CudaDevice,
) -> Result<()>
where
    T: WithDType + CudaDType + DeviceRepr,
    CudaBlas: Gemm<T>,
{
    let c_int = |what, size: usize| -> Result<i32> {
        i32::try_from(size).map_err(|_| KernelError::TooLarge { op: OP, what, size }.into())
    };
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_T,
        m: c_int("the columns", d.k)?,
        n: c_int("the gradient's rows", d.n)?,
        k: c_int("the rows", d.rows)?,
        alpha: T::from_f64(1.0),
        lda: c_int("the columns", d.k)?,
        ldb: c_int("the gradient's rows", d.n)?,
        beta: T::from_f64(1.0),
        ldc: c_int("the columns", d.k)?,
    };
    let dy = view(OP, "dy", inputs.dy.as_cuda_slice::<T>()?, inputs.dl)?;
    let x = view(OP, "x", inputs.x.as_cuda_slice::<T>()?, inputs.xl)?;
    let blas = device.cublas_handle();
    // SAFETY: `x` holds rows * k elements and `dy` rows * n (the wrapper reshaped both,
    // contiguous, to `[rows, k]` and `[rows, n]`), `acc` exactly n * k (its layout's span of a
    // tensor checked `[n, k]` and contiguous); all on `device`, whose stream the handle is
    // bound to and which orders the GEMM after every earlier use of the three.
    unsafe { blas.gemm(cfg, &x, &dy, acc) }.map_err(candle_core::Error::wrap)
}
