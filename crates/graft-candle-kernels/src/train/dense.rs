//! `dense(x, w) = x · wᵀ` over all of `x`'s rows as one matrix, differentiable: one GEMM
//! forward (candle's backend matmul, cuBLAS on CUDA, reading `w` transposed in place), two
//! backward. candle-nn's `Linear` broadcasts the weight over a 3-D input's batch (so the
//! weight's gradient is a batched GEMM and a sum) and records a transpose node; this records
//! one node, whose backward adds nothing but the two products.
//!
//! [`dense_sum`] is the input gradient of several projections of one input (`Σ dy_i · w_i`,
//! q, k and v's or gate and up's) for a hand-written backward pass: one GEMM per term into
//! one output, each after the first adding to it (cuBLAS's β = 1), so the sum costs no add
//! kernel.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

use crate::check;
use crate::cpu::float_dispatch;

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

/// `Σ_i a_i · w_i` over `terms` `(a_i, w_i)`: each `a_i` `[..., n_i]` with the same leading
/// dims, each `w_i` `[n_i, k]` (contiguous) with the same `k`, all of one dtype and device;
/// returns `[..., k]`. Not differentiable (a backward pass's op): the input gradient of
/// projections `dense(x, w_i)` from their outputs' gradients `a_i`, in one output.
pub fn dense_sum(terms: &[(&Tensor, &Tensor)]) -> Result<Tensor> {
    const OP: &str = "dense_sum";
    let Some(&(a0, w0)) = terms.first() else {
        return Err(crate::KernelError::Unsupported {
            op: OP,
            reason: "a sum of no products: pass at least one (gradient, weight) pair",
        }
        .into());
    };
    let (_, k) = w0.dims2()?;
    let Some((_, lead)) = a0.dims().split_last() else {
        return Err(check::shape(OP, "a", a0, "[..., n]"));
    };
    let rows: usize = lead.iter().product();
    let mut checked = Vec::with_capacity(terms.len());
    for &(a, w) in terms {
        check::float(OP, "a", a)?;
        check::like(OP, "a", a, "the first a", a0)?;
        check::like(OP, "w", w, "the first a", a0)?;
        check::contiguous(OP, "w", w)?;
        let (n, wk) = w.dims2()?;
        if wk != k {
            return Err(check::shape(
                OP,
                "w",
                w,
                "[n_i, k] with one k for every term",
            ));
        }
        if a.dims().split_last() != Some((&n, lead)) {
            return Err(check::shape(
                OP,
                "a",
                a,
                "[..., n_i] with the first a's leading dims",
            ));
        }
        checked.push((a.contiguous()?, w.clone(), n));
    }
    let mut dims = lead.to_vec();
    dims.push(k);
    if rows == 0 || k == 0 {
        return Tensor::zeros(dims, a0.dtype(), a0.device());
    }
    let first = checked[0].0.clone();
    first
        .apply_op1_no_bwd(&DenseSum {
            terms: checked,
            rows,
            k,
        })?
        .reshape(dims)
}

/// The op behind [`dense_sum`], over the first term's `a` (a placeholder: every term's
/// tensors are held here, contiguous); its output is `[rows, k]`.
struct DenseSum {
    /// `(a_i, w_i, n_i)`.
    terms: Vec<(Tensor, Tensor, usize)>,
    rows: usize,
    k: usize,
}

impl CustomOp1 for DenseSum {
    fn name(&self) -> &'static str {
        "dense_sum"
    }

    /// Each product by candle's CPU matmul, summed in f32 and rounded once.
    fn cpu_fwd(&self, first: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, k) = (self.rows, self.k);
        let mut products = Vec::with_capacity(self.terms.len());
        for (a, w, n) in &self.terms {
            let (a_storage, al) = a.storage_and_layout();
            let (w_storage, wl) = w.storage_and_layout();
            let (candle_core::Storage::Cpu(a), candle_core::Storage::Cpu(w)) =
                (&*a_storage, &*w_storage)
            else {
                return Err(crate::KernelError::Device {
                    op: "dense_sum",
                    input: "a",
                }
                .into());
            };
            let am = Layout::contiguous_with_offset((rows, *n), al.start_offset());
            let wm = Layout::contiguous_with_offset((*n, k), wl.start_offset());
            products.push(a.matmul(w, (1, rows, k, *n), &am, &wm)?);
        }
        let out = float_dispatch!("dense_sum", "a", (first), |x| sum(x, &products))?;
        Ok((out, Shape::from((rows, k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        first: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let device = first.device.clone();
        let slice = cuda::dense_sum(&self.terms, self.rows, self.k, first, &device)?;
        Ok((
            candle_core::CudaStorage { slice, device },
            Shape::from((self.rows, self.k)),
        ))
    }
}

/// The elementwise sum of `products` (each of `T`, the type of `_x`'s elements), in f32.
fn sum<T: WithDType>(_x: &[T], products: &[CpuStorage]) -> Result<CpuStorage> {
    let mut total: Vec<f32> = Vec::new();
    for p in products {
        let p = T::cpu_storage_as_slice(p)?;
        if total.is_empty() {
            total = vec![0.0; p.len()];
        }
        for (t, &v) in total.iter_mut().zip(p) {
            *t += check::f32_of(v);
        }
    }
    Ok(T::to_cpu_storage_owned(
        total
            .into_iter()
            .map(|v| T::from_f64(f64::from(v)))
            .collect(),
    ))
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

    #[test]
    fn a_dense_sum_is_the_sum_of_its_products() -> Result<()> {
        let dev = Device::Cpu;
        let a1 = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?;
        let a2 = Tensor::randn(0f32, 1.0, (2, 3, 6), &dev)?;
        let w1 = Tensor::randn(0f32, 1.0, (4, 5), &dev)?;
        let w2 = Tensor::randn(0f32, 1.0, (6, 5), &dev)?;
        let ours = dense_sum(&[(&a1, &w1), (&a2, &w2)])?;
        let reference = (a1.broadcast_matmul(&w1)? + a2.broadcast_matmul(&w2)?)?;
        assert_eq!(ours.dims(), [2, 3, 5]);
        let diff = (ours - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        assert!(dense_sum(&[]).is_err());
        assert!(dense_sum(&[(&a1, &w2)]).is_err());
        Ok(())
    }
}
