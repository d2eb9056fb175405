//! `dense(x, w) = x · wᵀ` over all of `x`'s rows as one matrix, differentiable: one GEMM
//! forward, two backward, each a `Product` op. candle-nn's `Linear` broadcasts the weight over
//! a 3-D input's batch (so the weight's gradient is a batched GEMM and a sum) and records a
//! transpose node; this records one node, whose backward adds nothing but the two products.
//!
//! On CUDA an f32 product is one `cublasSgemm` (what PyTorch's f32 `mm` calls); candle's own
//! matmul runs the other dtypes and the CPU (cuBLAS's strided-batched GEMM on CUDA).

#[cfg(feature = "cuda")]
mod cuda;

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

/// `C = op(A) · op(B)`, row-major and contiguous: `op(A)` is `[m, k]` (A stored `[k, m]`
/// when `ta`), `op(B)` is `[k, n]` (B stored `[n, k]` when `tb`); C is `[m, n]`.
#[derive(Clone, Copy, Debug)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
}

impl Product {
    /// candle's matmul layouts of A and B (their start offsets kept).
    fn layouts(&self, al: &Layout, bl: &Layout) -> (Layout, Layout) {
        let Product { m, n, k, ta, tb } = *self;
        let a = if ta {
            Layout::new((m, k).into(), vec![1, m], al.start_offset())
        } else {
            Layout::contiguous_with_offset((m, k), al.start_offset())
        };
        let b = if tb {
            Layout::new((k, n).into(), vec![1, k], bl.start_offset())
        } else {
            Layout::contiguous_with_offset((k, n), bl.start_offset())
        };
        (a, b)
    }

    fn apply(&self, a: &Tensor, b: &Tensor, shape: Shape) -> Result<Tensor> {
        a.apply_op2_no_bwd(
            b,
            &Shaped {
                product: *self,
                shape,
            },
        )
    }
}

/// A product whose result has `shape` (`m * n` elements).
struct Shaped {
    product: Product,
    shape: Shape,
}

impl CustomOp2 for Shaped {
    fn name(&self) -> &'static str {
        "dense_product"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = self.product;
        let (la, lb) = p.layouts(al, bl);
        Ok((
            a.matmul(b, (1, p.m, p.n, p.k), &la, &lb)?,
            self.shape.clone(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::product(self.product, a, al, b, bl)?,
            self.shape.clone(),
        ))
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
        Shaped {
            product: self.forward(),
            shape: self.shape(xl),
        }
        .cpu_fwd(x, xl, w, wl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Shaped {
            product: self.forward(),
            shape: self.shape(xl),
        }
        .cuda_fwd(x, xl, w, wl)
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
        let g = grad.contiguous()?;
        let (rows, n, k) = (self.rows, self.n, self.k);
        // dx = dy · w: [rows, n] · [n, k].
        let dx = Product {
            m: rows,
            n: k,
            k: n,
            ta: false,
            tb: false,
        }
        .apply(&g, w, x.shape().clone())?;
        // dw = dyᵀ · x: [n, rows] (dy read transposed) · [rows, k].
        let dw = Product {
            m: n,
            n: k,
            k: rows,
            ta: true,
            tb: false,
        }
        .apply(&g, x, Shape::from((n, k)))?;
        Ok((Some(dx), Some(dw)))
    }
}

impl Dense {
    /// The forward product: `x` `[rows, k]` times `w` `[n, k]` read transposed.
    fn forward(&self) -> Product {
        Product {
            m: self.rows,
            n: self.n,
            k: self.k,
            ta: false,
            tb: true,
        }
    }

    fn shape(&self, xl: &Layout) -> Shape {
        let mut dims = xl.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.n;
        }
        Shape::from(dims)
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
