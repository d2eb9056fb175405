//! A dense product on CUDA: f32 through `cublasSgemm` on candle's cuBLAS handle (candle's
//! stream), the other dtypes through candle's matmul.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

use super::{OP, Product};
use crate::nvrtc::view;

/// `C = op(A) · op(B)` (see [`Product`]).
pub(super) fn product(
    p: Product,
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
) -> Result<CudaStorage> {
    let (CudaStorageSlice::F32(sa), CudaStorageSlice::F32(sb)) = (&a.slice, &b.slice) else {
        let (la, lb) = p.layouts(al, bl);
        return a.matmul(b, (1, p.m, p.n, p.k), &la, &lb);
    };
    let device = a.device.clone();
    let (m, n, k) = (gemm_dim(p.m)?, gemm_dim(p.n)?, gemm_dim(p.k)?);
    let av = view(OP, "a", sa, al)?;
    let bv = view(OP, "b", sb, bl)?;
    // SAFETY: cuBLAS writes all m * n elements of C (beta is 0, so none is read) before
    // anything reads it: the GEMM is enqueued below on candle's stream, which orders every
    // later use.
    let mut c = unsafe { device.alloc::<f32>(p.m * p.n)? };
    // Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage as
    // cuBLAS's first operand, A's as its second.
    let cfg = GemmConfig {
        transa: if p.tb {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        },
        transb: if p.ta {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        },
        m: n,
        n: m,
        k,
        alpha: 1.0f32,
        lda: if p.tb { k } else { n },
        ldb: if p.ta { m } else { k },
        beta: 0.0f32,
        ldc: n,
    };
    // SAFETY: `bv` holds op(B)'s k * n elements with leading dimension `lda` as set above,
    // `av` op(A)'s m * k with `ldb`, `c` m * n with `ldc = n` (the wrappers checked the
    // shapes); candle's cuBLAS handle runs on candle's stream, where the views stay valid
    // until the GEMM is enqueued.
    unsafe { device.cublas_handle().gemm(cfg, &bv, &av, &mut c) }.w()?;
    Ok(CudaStorage {
        slice: CudaStorageSlice::F32(c),
        device,
    })
}

fn gemm_dim(size: usize) -> Result<i32> {
    i32::try_from(size).map_err(|_| {
        crate::KernelError::TooLarge {
            op: OP,
            what: "a GEMM dimension",
            size,
        }
        .into()
    })
}
