//! More rows than the few-row kernels take, through two or three weights side by side
//! (`linear_cat` without biases): one GEMM per weight written straight into its columns of
//! the output (cuBLAS on CUDA, the output's row stride the sum of the weights' rows), so
//! the concatenation costs no copy. Each weight's GEMM was its own output, then a
//! `Tensor::cat` of them, three copies per layer of a decode step above 16 rows (125 µs of a
//! batch-32 step of the ~1B Llama on an H200, ncu).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

use super::{Dims, OP};
use crate::cpu::float_dispatch;
use crate::train::matmul_layouts;

/// The custom op over `x` (`[rows, k]`, contiguous), holding clones of the weights; the
/// wrapper has checked everything. Its output is `[rows, n_0 + n_1 + ...]`.
pub(super) struct Gemms {
    pub(super) weights: Vec<Tensor>,
    pub(super) dims: Dims,
}

impl CustomOp1 for Gemms {
    fn name(&self) -> &'static str {
        OP
    }

    /// Each weight's product by candle's CPU matmul, then its rows placed in their columns.
    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let Dims { rows, k, ns, .. } = self.dims;
        let mut products = Vec::with_capacity(self.weights.len());
        for (w, &n) in self.weights.iter().zip(&ns) {
            let (storage, wl) = w.storage_and_layout();
            let candle_core::Storage::Cpu(w) = &*storage else {
                return Err(crate::KernelError::Device { op: OP, input: "w" }.into());
            };
            let (xm, wm) = matmul_layouts((rows, k, n), xl, wl);
            products.push((x.matmul(w, (1, rows, n, k), &xm, &wm)?, n));
        }
        let total = self.dims.n();
        let out = float_dispatch!(OP, "x", (x), |x| place(x, &products, rows, total))?;
        Ok((out, self.dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::gemms(self, x, xl)
    }
}

/// Row r of the output: row r of each product (`[rows, n_i]`) in turn, in the dtype `T` of
/// x's elements `_x` (passed for their type only: the products are `T` too).
fn place<T: WithDType>(
    _x: &[T],
    products: &[(CpuStorage, usize)],
    rows: usize,
    total: usize,
) -> Result<CpuStorage> {
    let products = products
        .iter()
        .map(|(p, n)| Ok((T::cpu_storage_as_slice(p)?, *n)))
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(rows * total);
    for r in 0..rows {
        for &(p, n) in &products {
            out.extend_from_slice(&p[r * n..][..n]);
        }
    }
    Ok(T::to_cpu_storage_owned(out))
}
