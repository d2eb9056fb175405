//! `rms_norm(x, weight, eps)`, differentiable: one kernel forward; backward, one kernel for
//! the input's gradient and each row's share of the weight's, and one summing the shares over
//! the rows in a fixed order (no atomics, so a step's gradients are the same on every run).
//!
//! The backward op returns both gradients packed in one tensor (the input's, then the
//! weight's), handed out as views of it. [`rms_norm_backward`] runs it outside candle's
//! autograd (for a hand-written backward pass), adding the residual stream's gradient into the
//! input's in the same kernel.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use crate::check;
use crate::cpu::float_dispatch;

const OP: &str = "rms_norm";

/// `x / sqrt(mean(x², last dim) + eps) * weight`, computed in f32 and rounded once to `x`'s
/// dtype (f32, bf16 or f16): `x` `[..., d]`, `weight` `[d]`, both contiguous (a start offset is
/// fine), one dtype and device. Differentiable in `x` and `weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    check::float(OP, "x", x)?;
    check::like(OP, "weight", weight, "x", x)?;
    let Some(&cols) = x.dims().last() else {
        return Err(check::shape(OP, "x", x, "at least one dimension"));
    };
    if weight.dims() != [cols] {
        return Err(check::shape(OP, "weight", weight, "[x's last dimension]"));
    }
    check::contiguous(OP, "x", x)?;
    check::contiguous(OP, "weight", weight)?;
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    check::u32_of(OP, "the row length", cols)?;
    check::u32_of(OP, "the row count", x.elem_count() / cols)?;
    x.apply_op2(weight, RmsNorm { eps })
}

/// The forward op over (x, weight); the wrapper has checked shapes, dtypes and contiguity.
struct RmsNorm {
    eps: f32,
}

/// The backward op over (x, weight, dy): `[rows * cols + cols]`, dx (plus `res` when given)
/// then dweight.
struct RmsNormBackward {
    eps: f32,
    res: Option<Tensor>,
}

/// The gradients of [`rms_norm`]'s input and weight from its output's gradient `dy`, outside
/// candle's autograd: `(dx + residual, dweight)`, where `residual` (`x`'s shape and dtype,
/// when given) is the gradient the residual stream already carries to `x`, added in the
/// kernel that computes dx instead of by a separate add. The same kernels and bits as
/// `rms_norm`'s own backward pass (with no residual).
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    eps: f32,
    residual: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    check::float(OP, "x", x)?;
    check::like(OP, "weight", weight, "x", x)?;
    check::like(OP, "dy", dy, "x", x)?;
    if dy.dims() != x.dims() || weight.dims() != [*x.dims().last().unwrap_or(&0)] {
        return Err(check::shape(
            OP,
            "dy",
            dy,
            "x's shape, weight [x's last dimension]",
        ));
    }
    let res = match residual {
        Some(r) => {
            check::like(OP, "the residual gradient", r, "x", x)?;
            if r.dims() != x.dims() {
                return Err(check::shape(OP, "the residual gradient", r, "x's shape"));
            }
            Some(r.contiguous()?)
        }
        None => None,
    };
    let (x, weight, dy) = (x.contiguous()?, weight.contiguous()?, dy.contiguous()?);
    let n = x.elem_count();
    if n == 0 {
        return Ok((x.zeros_like()?, weight.zeros_like()?));
    }
    let packed = x.apply_op3_no_bwd(&weight, &dy, &RmsNormBackward { eps, res })?;
    let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
    let dw = packed.narrow(0, n, weight.elem_count())?;
    Ok((dx, dw))
}

impl CustomOp2 for RmsNorm {
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
        let out = float_dispatch!(OP, "x", (x, w), |x, w| cpu_forward(x, xl, w, wl, self.eps))?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self.eps, x, xl, w, wl)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_backward(x, w, dy, self.eps, None)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms_norm_backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        dy: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let eps = self.eps;
        let res = match &self.res {
            Some(r) => Some(
                r.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ),
            None => None,
        };
        let out = float_dispatch!(OP, "x", (x, w, dy), |x, w, dy| {
            cpu_backward(x, xl, w, wl, dy, dyl, eps, res.as_deref())
        })?;
        let len = xl.shape().elem_count() + wl.shape().elem_count();
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::backward(self.eps, self.res.as_ref(), x, xl, w, wl, dy, dyl)
    }
}

/// `1 / sqrt(mean(row²) + eps)` in f32.
fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    let squares: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (squares / row.len() as f32 + eps).sqrt()
}

fn cpu_forward<T: WithDType>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    wl: &Layout,
    eps: f32,
) -> Result<CpuStorage> {
    let x = check::cpu_slice(OP, "x", x, xl)?;
    let w: Vec<f32> = check::cpu_slice(OP, "weight", w, wl)?
        .iter()
        .map(|&v| check::f32_of(v))
        .collect();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(w.len()) {
        let row: Vec<f32> = row.iter().map(|&v| check::f32_of(v)).collect();
        let r = inverse_rms(&row, eps);
        out.extend(
            row.iter()
                .zip(&w)
                .map(|(&v, &w)| T::from_f64(f64::from(v * r * w))),
        );
    }
    Ok(T::to_cpu_storage_owned(out))
}

/// `dx = r (dy w) - x r³ mean(dy w x) (+ res)` and `dweight = Σ_rows dy x r`.
#[allow(clippy::too_many_arguments)]
fn cpu_backward<T: WithDType>(
    x: &[T],
    xl: &Layout,
    w: &[T],
    wl: &Layout,
    dy: &[T],
    dyl: &Layout,
    eps: f32,
    res: Option<&[f32]>,
) -> Result<CpuStorage> {
    let f32s = |s: &[T]| s.iter().map(|&v| check::f32_of(v)).collect::<Vec<f32>>();
    let x = f32s(check::cpu_slice(OP, "x", x, xl)?);
    let w = f32s(check::cpu_slice(OP, "weight", w, wl)?);
    let dy = f32s(check::cpu_slice(OP, "dy", dy, dyl)?);
    let cols = w.len();
    let mut dx = Vec::with_capacity(x.len() + cols);
    let mut dw = vec![0f32; cols];
    for (j, (row, g)) in x.chunks(cols).zip(dy.chunks(cols)).enumerate() {
        let r = inverse_rms(row, eps);
        let dot: f32 = row.iter().zip(g).zip(&w).map(|((x, g), w)| g * w * x).sum();
        let c = r * r * r * dot / cols as f32;
        for i in 0..cols {
            let d = r * g[i] * w[i] - row[i] * c;
            let d = res.map_or(d, |res| d + res[j * cols + i]);
            dx.push(T::from_f64(f64::from(d)));
            dw[i] += g[i] * row[i] * r;
        }
    }
    dx.extend(dw.into_iter().map(|v| T::from_f64(f64::from(v))));
    Ok(T::to_cpu_storage_owned(dx))
}
