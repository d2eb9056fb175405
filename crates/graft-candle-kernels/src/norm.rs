//! `add_rms_norm`: a decoder layer's residual add and the RMS norm after it, in one kernel
//! that writes both the sum and the normed sum.
//!
//! The custom op returns both packed in one tensor `[2, ...x's shape]` (the sum, then the
//! normed sum); [`add_rms_norm`] hands out its two halves as views (no copy), which keep the
//! one allocation alive between them.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use crate::check;
use crate::cpu::float_dispatch;

const OP: &str = "add_rms_norm";

/// `(sum, normed)` with `sum = x + residual` (rounded to the dtype, as candle's add rounds it)
/// and `normed = sum / sqrt(mean(sum², last dim) + eps) * weight` (as
/// `candle_nn::ops::rms_norm` of `sum`), both in `x`'s dtype, computed in f32. `x` and
/// `residual` have one shape (any leading dims), `weight` is `[last dim]`; all three are
/// contiguous (a start offset is fine) and of one dtype (f32, bf16 or f16) and device.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    check::float(OP, "x", x)?;
    check::like(OP, "residual", residual, "x", x)?;
    check::like(OP, "weight", weight, "x", x)?;
    let Some(&cols) = x.dims().last() else {
        return Err(check::shape(OP, "x", x, "at least one dimension"));
    };
    if residual.dims() != x.dims() {
        return Err(check::shape(OP, "residual", residual, "x's shape"));
    }
    if weight.dims() != [cols] {
        return Err(check::shape(OP, "weight", weight, "[x's last dimension]"));
    }
    check::contiguous(OP, "x", x)?;
    check::contiguous(OP, "residual", residual)?;
    check::contiguous(OP, "weight", weight)?;
    if x.elem_count() == 0 {
        return Ok((x.zeros_like()?, x.zeros_like()?));
    }
    check::u32_of(OP, "the row length", cols)?;
    check::u32_of(OP, "the row count", x.elem_count() / cols)?;
    let packed = x.apply_op3_no_bwd(residual, weight, &AddRmsNorm { eps })?;
    Ok((packed.get(0)?, packed.get(1)?))
}

/// The custom op over (x, residual, weight); the wrapper has checked shapes, dtypes and
/// contiguity. Its output is `[2, ...x's shape]`: the sum, then the normed sum.
struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        r: &CpuStorage,
        rl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(OP, "x", (x, r, w), |x, r, w| {
            self.cpu(x, xl, r, rl, w, wl)
        })?;
        Ok((out, packed_shape(xl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        r: &candle_core::CudaStorage,
        rl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self.eps, x, xl, r, rl, w, wl)
    }
}

/// `[2, ...x's shape]`.
fn packed_shape(xl: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(xl.dims());
    Shape::from_dims(&dims)
}

impl AddRmsNorm {
    fn cpu<T: WithDType>(
        &self,
        x: &[T],
        xl: &Layout,
        r: &[T],
        rl: &Layout,
        w: &[T],
        wl: &Layout,
    ) -> Result<CpuStorage> {
        let x = check::cpu_slice(OP, "x", x, xl)?;
        let r = check::cpu_slice(OP, "residual", r, rl)?;
        let w = check::cpu_slice(OP, "weight", w, wl)?;
        let cols = w.len();
        let mut sum: Vec<T> = x.iter().zip(r).map(|(&a, &b)| add(a, b)).collect();
        let mut normed = Vec::with_capacity(sum.len());
        for row in sum.chunks(cols) {
            let squares: f32 = row
                .iter()
                .map(|&s| check::f32_of(s) * check::f32_of(s))
                .sum();
            let m = (squares / cols as f32 + self.eps).sqrt();
            normed.extend(
                row.iter().zip(w).map(|(&s, &w)| {
                    T::from_f64(f64::from(check::f32_of(s) / m * check::f32_of(w)))
                }),
            );
        }
        sum.append(&mut normed);
        Ok(T::to_cpu_storage_owned(sum))
    }
}

/// `a + b` rounded once to `T` (exact in f32 for the 16-bit dtypes, as candle's add).
fn add<T: WithDType>(a: T, b: T) -> T {
    T::from_f64(f64::from(check::f32_of(a) + check::f32_of(b)))
}
