//! `rotary(x, cos, sin, heads, style)`: the rotary embedding of whole sequences, token-major
//! (the projections' output as it is, no transpose to head-major), differentiable: its
//! backward is the inverse rotation (the same kernel with the sine negated), one launch each.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use crate::cpu::float_dispatch;
use crate::{RopeStyle, check};

const OP: &str = "rotary";

/// `x` (`[batch, seq, heads * head_dim]`) with each head's dims rotated by the angle of the
/// row's position in its sequence (0 to `seq - 1`): `cos` and `sin` are `[positions,
/// head_dim / 2]` tables with `positions >= seq` (the decoder's rotary tables), and `style`
/// pairs the dims as candle-nn's `rope` (`Half`) or `rope_i` (`Interleaved`) does. All
/// contiguous, one dtype (f32, bf16 or f16) and device; computed in f32, rounded once.
/// Differentiable in `x` (the tables are constants).
pub fn rotary(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    style: RopeStyle,
) -> Result<Tensor> {
    if !checked(x, cos, sin, heads)? {
        return x.zeros_like();
    }
    x.apply_op3(
        cos,
        sin,
        Rotary {
            heads,
            style,
            inverse: false,
        },
    )
}

/// The gradient of [`rotary`]'s input from its output's gradient `dy` (the inverse rotation),
/// outside candle's autograd: the kernel `rotary`'s own backward pass runs.
pub fn rotary_backward(
    dy: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    style: RopeStyle,
) -> Result<Tensor> {
    let dy = dy.contiguous()?;
    if !checked(&dy, cos, sin, heads)? {
        return dy.zeros_like();
    }
    dy.apply_op3_no_bwd(
        cos,
        sin,
        &Rotary {
            heads,
            style,
            inverse: true,
        },
    )
}

/// Checks [`rotary`]'s arguments; `false` when `x` is empty (nothing to rotate).
fn checked(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<bool> {
    check::float(OP, "x", x)?;
    check::like(OP, "cos", cos, "x", x)?;
    check::like(OP, "sin", sin, "x", x)?;
    let (_, seq, width) = x.dims3()?;
    if heads == 0 || !width.is_multiple_of(heads) || !(width / heads).is_multiple_of(2) {
        return Err(check::shape(
            OP,
            "x",
            x,
            "[batch, seq, heads * head_dim] with an even head_dim",
        ));
    }
    let half = width / heads / 2;
    if cos.rank() != 2 || cos.dim(1)? != half || cos.dim(0)? < seq {
        return Err(check::shape(
            OP,
            "cos",
            cos,
            "[positions >= seq, head_dim / 2]",
        ));
    }
    if sin.dims() != cos.dims() {
        return Err(check::shape(OP, "sin", sin, "cos's shape"));
    }
    for (name, t) in [("x", x), ("cos", cos), ("sin", sin)] {
        check::contiguous(OP, name, t)?;
    }
    if x.elem_count() == 0 {
        return Ok(false);
    }
    check::u32_of(
        OP,
        "the pair count / 256",
        (x.elem_count() / 2).div_ceil(256),
    )?;
    Ok(true)
}

/// The op over (x, cos, sin): the rotation, or its inverse (the backward pass).
#[derive(Clone, Copy)]
struct Rotary {
    heads: usize,
    style: RopeStyle,
    inverse: bool,
}

/// The shapes a kernel needs: `x` `[rows, heads * 2 * half]`, rows `seq` to a sequence.
#[derive(Clone, Copy)]
struct Dims {
    seq: usize,
    heads: usize,
    half: usize,
}

impl Rotary {
    fn dims(&self, xl: &Layout) -> Dims {
        let d = xl.dims();
        Dims {
            seq: d[1],
            heads: self.heads,
            half: d[2] / self.heads / 2,
        }
    }
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(xl);
        let (style, inverse) = (self.style, self.inverse);
        let out = float_dispatch!(OP, "x", (x, cos, sin), |x, c, s| {
            cpu(x, xl, c, cl, s, sl, d, style, inverse)
        })?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, self.dims(xl), x, xl, cos, cl, sin, sl)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Only the forward rotation is tracked, so its backward is the inverse one.
        let dx = rotary_backward(dy, cos, sin, self.heads, self.style)?;
        Ok((Some(dx), None, None))
    }
}

/// The two dims of pair `i` of a head (`half` pairs) in `style`.
fn pair(style: RopeStyle, i: usize, half: usize) -> (usize, usize) {
    match style {
        RopeStyle::Half => (i, i + half),
        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
    }
}

#[allow(clippy::too_many_arguments)]
fn cpu<T: WithDType>(
    x: &[T],
    xl: &Layout,
    cos: &[T],
    cl: &Layout,
    sin: &[T],
    sl: &Layout,
    d: Dims,
    style: RopeStyle,
    inverse: bool,
) -> Result<CpuStorage> {
    let x = check::cpu_slice(OP, "x", x, xl)?;
    let cos = check::cpu_slice(OP, "cos", cos, cl)?;
    let sin = check::cpu_slice(OP, "sin", sin, sl)?;
    let width = d.heads * 2 * d.half;
    let mut out = vec![T::zero(); x.len()];
    for (row, (xs, ys)) in x.chunks(width).zip(out.chunks_mut(width)).enumerate() {
        let pos = row % d.seq;
        for h in 0..d.heads {
            for i in 0..d.half {
                let (a, b) = pair(style, i, d.half);
                let (a, b) = (h * 2 * d.half + a, h * 2 * d.half + b);
                let c = check::f32_of(cos[pos * d.half + i]);
                let mut s = check::f32_of(sin[pos * d.half + i]);
                if inverse {
                    s = -s;
                }
                let (u, v) = (check::f32_of(xs[a]), check::f32_of(xs[b]));
                ys[a] = T::from_f64(f64::from(u * c - v * s));
                ys[b] = T::from_f64(f64::from(v * c + u * s));
            }
        }
    }
    Ok(T::to_cpu_storage_owned(out))
}
