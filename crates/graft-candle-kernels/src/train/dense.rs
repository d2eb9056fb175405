//! `dense(x, w) = x · wᵀ` over all of `x`'s rows as one matrix, differentiable: one GEMM
//! forward (candle's backend matmul, cuBLAS on CUDA, reading `w` transposed in place), two
//! backward. candle-nn's `Linear` broadcasts the weight over a 3-D input's batch (so the
//! weight's gradient is a batched GEMM and a sum) and records a transpose node; this records
//! one node, whose backward adds nothing but the two products.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use crate::check;

const OP: &str = "dense";

/// `x · wᵀ`: `x` `[..., k]`, `w` `[n, k]` (contiguous), one dtype and device; returns
/// `[..., n]`. Its backward pass is `dx = dy · w` and `dw = dyᵀ · x`, each one GEMM over all
/// rows.
pub fn dense(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check::like(OP, "w", w, "x", x)?;
    let (n, k) = w.dims2()?;
    if x.dims().last() != Some(&k) || x.rank() < 2 {
        return Err(check::shape(
            OP,
            "x",
            x,
            "[..., k] with k the weight's columns",
        ));
    }
    check::contiguous(OP, "w", w)?;
    let x = x.contiguous()?;
    let rows = x.elem_count() / k;
    if rows == 0 || n == 0 || k == 0 {
        let mut dims = x.dims().to_vec();
        dims[x.rank() - 1] = n;
        return Tensor::zeros(dims, x.dtype(), x.device());
    }
    x.apply_op2(w, Dense { rows, k, n })
}

/// The custom op: `rows` rows of `k` through an `[n, k]` weight.
struct Dense {
    rows: usize,
    k: usize,
    n: usize,
}

/// candle's matmul arguments for `x · wᵀ` (`x`'s layout `xl`, `w`'s `wl`, both contiguous):
/// `x` as `[rows, k]`, `w` (`[n, k]`) read transposed as `[k, n]`.
pub(crate) fn matmul_layouts(
    (rows, k, n): (usize, usize, usize),
    xl: &Layout,
    wl: &Layout,
) -> (Layout, Layout) {
    (
        Layout::contiguous_with_offset((rows, k), xl.start_offset()),
        Layout::new((k, n).into(), vec![1, k], wl.start_offset()),
    )
}

impl Dense {
    /// [`matmul_layouts`] of this op's sizes.
    fn layouts(&self, xl: &Layout, wl: &Layout) -> (Layout, Layout) {
        matmul_layouts((self.rows, self.k, self.n), xl, wl)
    }

    fn shape(&self, xl: &Layout) -> Shape {
        let mut dims = xl.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.n;
        }
        Shape::from(dims)
    }

    fn bmnk(&self) -> (usize, usize, usize, usize) {
        (1, self.rows, self.n, self.k)
    }
}

impl CustomOp2 for Dense {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (xm, wm) = self.layouts(xl, wl);
        Ok((x.matmul(w, self.bmnk(), &xm, &wm)?, self.shape(xl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (xm, wm) = self.layouts(xl, wl);
        Ok((x.matmul(w, self.bmnk(), &xm, &wm)?, self.shape(xl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if grad.elem_count() != self.rows * self.n {
            return Err(check::shape(
                OP,
                "the output's gradient",
                grad,
                "the output's shape",
            ));
        }
        let g = grad.contiguous()?.reshape((self.rows, self.n))?.detach();
        let dx = g.matmul(&w.detach())?.reshape(x.shape())?;
        let dw = g.t()?.matmul(&x.detach().reshape((self.rows, self.k))?)?;
        Ok((Some(dx), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn matches_candle_matmul_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (2, 3, 5), &dev)?;
        let w = Var::randn(0f32, 1.0, (4, 5), &dev)?;
        let r = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?;
        let ours = dense(&x, &w)?;
        let grads = (&ours * &r)?.sum_all()?.backward()?;
        let reference = x.broadcast_matmul(&w.t()?)?;
        let rgrads = (&reference * &r)?.sum_all()?.backward()?;
        let close = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
        };
        assert!(close(&ours, &reference)? < 1e-5);
        for v in [x.as_tensor(), w.as_tensor()] {
            let (a, b) = (grads.get(v), rgrads.get(v));
            let (Some(a), Some(b)) = (a, b) else {
                panic!("a gradient is missing");
            };
            assert!(close(a, b)? < 1e-5);
        }
        let bad = Tensor::zeros((3, 4), DType::F32, &dev)?;
        assert!(dense(&bad, &w).is_err());
        Ok(())
    }
}
