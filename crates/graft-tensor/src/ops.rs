//! Tensor operations: check shapes and dtypes, allocate the output from the given allocator
//! (graft's pool inside a body, the eager pool outside), and enqueue the kernel of `k`, the
//! device's loaded kernels ([`Backend::load_ops`]).
//!
//! Nothing here reads device memory on the host, so every op is legal inside a captured body.

mod token_loop;

pub use token_loop::{PAD, TokenLoop, loop_begin, loop_record};

use crate::backend::{
    AddNormArgs, ArgmaxArgs, AttentionArgs, AttnDims, Backend, EmbedDims, EmbedNormArgs,
    LinearArgs, MatmulDims, NormDims, Ops, SampleArgs,
};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::philox::RNG_WORDS;
use crate::sampling::Sampling;
use crate::tensor::{Alloc, Tensor};

fn shape_is(op: &'static str, operand: &'static str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.shape() != want {
        return Err(TensorError::Shape {
            op,
            operand,
            expected: want.to_vec(),
            found: t.shape().to_vec(),
        });
    }
    Ok(())
}

fn dtype_is(op: &'static str, operand: &'static str, t: &Tensor, want: DType) -> Result<()> {
    if t.dtype() != want {
        return Err(TensorError::DType {
            op,
            operand,
            expected: want,
            found: t.dtype(),
        });
    }
    Ok(())
}

/// The `[rows, cols]` of a rank-2 tensor, or a shape error.
fn matrix(op: &'static str, operand: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [r, c] => Ok((r, c)),
        _ => Err(TensorError::Shape {
            op,
            operand,
            expected: vec![0, 0],
            found: t.shape().to_vec(),
        }),
    }
}

/// The length of a one-dimensional `ids` operand.
fn ids_len(op: &'static str, ids: &Tensor) -> Result<usize> {
    match *ids.shape() {
        [n] => Ok(n),
        _ => Err(TensorError::Shape {
            op,
            operand: "ids",
            expected: vec![ids.numel()],
            found: ids.shape().to_vec(),
        }),
    }
}

/// Checks an optional `[n]` f32 operand.
fn vector<'t>(
    op: &'static str,
    operand: &'static str,
    t: Option<&'t Tensor>,
    n: usize,
) -> Result<Option<&'t Tensor>> {
    if let Some(t) = t {
        dtype_is(op, operand, t, DType::F32)?;
        shape_is(op, operand, t, &[n])?;
    }
    Ok(t)
}

/// A position: a one-element i32 tensor on the device.
fn position(op: &'static str, pos: &Tensor) -> Result<()> {
    dtype_is(op, "pos", pos, DType::I32)?;
    shape_is(op, "pos", pos, &[1])
}

/// `a + b`, elementwise, same shapes.
pub fn add<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    a: &Tensor,
    b: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "add";
    dtype_is(OP, "a", a, DType::F32)?;
    dtype_is(OP, "b", b, DType::F32)?;
    shape_is(OP, "b", b, a.shape())?;
    let out = Tensor::empty(cx, a.shape(), DType::F32)?;
    k.add(&out, a, b)?;
    Ok(out)
}

/// Checks `q` `[batch, d]` against a `[batch, ctx, d]` cache and returns the dims.
fn attn_dims(
    op: &'static str,
    q_rows: usize,
    d: usize,
    cache: &Tensor,
    operand: &'static str,
    heads: usize,
) -> Result<AttnDims> {
    dtype_is(op, operand, cache, DType::F32)?;
    let ctx = match *cache.shape() {
        [b, ctx, cd] if b == q_rows && cd == d && ctx > 0 => ctx,
        _ => {
            return Err(TensorError::Shape {
                op,
                operand,
                expected: vec![q_rows, cache.shape().get(1).copied().unwrap_or(1).max(1), d],
                found: cache.shape().to_vec(),
            });
        }
    };
    if heads == 0 || !d.is_multiple_of(heads) {
        return Err(TensorError::Config {
            what: "the model dimension must be a non-zero multiple of the number of heads",
        });
    }
    let head_dim = d / heads;
    Ok(AttnDims {
        batch: q_rows,
        heads,
        head_dim,
        ctx,
        scale: 1.0 / (head_dim as f32).sqrt(),
    })
}

/// `gelu?(x[rows, k] · w[k, n] + bias[n]) + residual[rows, n]` in one op (bias, GELU and
/// residual each optional; GELU is the tanh approximation, applied before the residual).
pub fn linear<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    const OP: &str = "linear";
    dtype_is(OP, "x", x, DType::F32)?;
    dtype_is(OP, "w", w, DType::F32)?;
    let (rows, inner) = matrix(OP, "x", x)?;
    let (wk, n) = matrix(OP, "w", w)?;
    if wk != inner {
        return Err(TensorError::Shape {
            op: OP,
            operand: "w",
            expected: vec![inner, n],
            found: w.shape().to_vec(),
        });
    }
    let bias = vector(OP, "bias", bias, n)?;
    if let Some(r) = residual {
        dtype_is(OP, "residual", r, DType::F32)?;
        shape_is(OP, "residual", r, &[rows, n])?;
    }
    let out = Tensor::empty(cx, &[rows, n], DType::F32)?;
    k.linear(
        LinearArgs {
            out: &out,
            x,
            w,
            bias,
            residual,
            gelu,
        },
        MatmulDims { rows, k: inner, n },
    )?;
    Ok(out)
}

/// Embedding, position add and layer norm in one op: `x = table[ids] + pos_table[pos]`
/// (ids outside the vocabulary give zero rows before the add) and `h = layer_norm(x)`, both
/// `[n, d]`; returns `(x, h)`.
#[allow(clippy::too_many_arguments)]
pub fn embed_norm<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    ids: &Tensor,
    table: &Tensor,
    pos_table: &Tensor,
    pos: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "embed_norm";
    dtype_is(OP, "ids", ids, DType::I32)?;
    dtype_is(OP, "table", table, DType::F32)?;
    dtype_is(OP, "pos_table", pos_table, DType::F32)?;
    position(OP, pos)?;
    let rows = ids_len(OP, ids)?;
    let (vocab, dim) = matrix(OP, "table", table)?;
    let (ctx, pdim) = matrix(OP, "pos_table", pos_table)?;
    if pdim != dim || ctx == 0 {
        return Err(TensorError::Shape {
            op: OP,
            operand: "pos_table",
            expected: vec![ctx.max(1), dim],
            found: pos_table.shape().to_vec(),
        });
    }
    dtype_is(OP, "gamma", gamma, DType::F32)?;
    dtype_is(OP, "beta", beta, DType::F32)?;
    shape_is(OP, "gamma", gamma, &[dim])?;
    shape_is(OP, "beta", beta, &[dim])?;
    let x = Tensor::empty(cx, &[rows, dim], DType::F32)?;
    let h = Tensor::empty(cx, &[rows, dim], DType::F32)?;
    k.embed_norm(
        EmbedNormArgs {
            x: &x,
            h: &h,
            ids,
            table,
            pos_table,
            pos,
            gamma,
            beta,
        },
        EmbedDims {
            rows,
            vocab,
            ctx,
            dim,
            eps,
        },
    )?;
    Ok((x, h))
}

/// One attention step in one op: `qkv` `[batch, 3 * d]` holds the new token's q, k and v
/// (plus `bias` `[3 * d]` when given); k and v are written into row `pos` of the caches (`[batch, ctx, d]`, in place), then
/// single-token multi-head attention over rows `0..=pos` → `[batch, d]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_step<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    qkv: &Tensor,
    bias: Option<&Tensor>,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    heads: usize,
) -> Result<Tensor> {
    const OP: &str = "attention_step";
    dtype_is(OP, "qkv", qkv, DType::F32)?;
    position(OP, pos)?;
    let (batch, d3) = matrix(OP, "qkv", qkv)?;
    if !d3.is_multiple_of(3) {
        return Err(TensorError::Shape {
            op: OP,
            operand: "qkv",
            expected: vec![batch, d3 / 3 * 3],
            found: qkv.shape().to_vec(),
        });
    }
    let d = d3 / 3;
    let dims = attn_dims(OP, batch, d, k_cache, "k_cache", heads)?;
    let vd = attn_dims(OP, batch, d, v_cache, "v_cache", heads)?;
    if vd.ctx != dims.ctx {
        return Err(TensorError::Shape {
            op: OP,
            operand: "v_cache",
            expected: vec![batch, dims.ctx, d],
            found: v_cache.shape().to_vec(),
        });
    }
    let bias = vector(OP, "bias", bias, d3)?;
    let out = Tensor::empty(cx, &[batch, d], DType::F32)?;
    k.attention_step(
        AttentionArgs {
            out: &out,
            qkv,
            bias,
            k_cache,
            v_cache,
            pos,
        },
        dims,
    )?;
    Ok(out)
}

/// Logits `x` `[rows, cols]` f32 whose columns index an i32 and rows a u32 (the pickers'
/// counters); returns `(rows, cols)`.
fn logits_dims(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    dtype_is(op, "x", x, DType::F32)?;
    let (rows, cols) = matrix(op, "x", x)?;
    if cols == 0 || i32::try_from(cols).is_err() || u32::try_from(rows).is_err() {
        return Err(TensorError::Shape {
            op,
            operand: "x",
            expected: vec![
                rows.min(u32::MAX as usize),
                cols.clamp(1, i32::MAX as usize),
            ],
            found: x.shape().to_vec(),
        });
    }
    Ok((rows, cols))
}

/// Each row's next token from `x + bias` (`x` `[rows, cols]` f32, `bias` `[cols]` optional) as
/// `sampling` says ([`crate::sampling`]: greedy picks what [`argmax_step`] picks), row `r`
/// drawing the uniform of counter (offset, r) of the generator state `rng` (`[4]` u32, see
/// [`crate::philox`]); then, on the device, the offset advances by one and
/// `pos = min(pos + 1, limit)`. Returns the tokens, `[rows]` i32.
#[allow(clippy::too_many_arguments)]
pub fn sample_step<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    x: &Tensor,
    bias: Option<&Tensor>,
    pos: &Tensor,
    rng: &Tensor,
    limit: i32,
    sampling: Sampling,
) -> Result<Tensor> {
    const OP: &str = "sample_step";
    sampling.check()?;
    let (rows, cols) = logits_dims(OP, x)?;
    position(OP, pos)?;
    dtype_is(OP, "rng", rng, DType::U32)?;
    shape_is(OP, "rng", rng, &[RNG_WORDS])?;
    let bias = vector(OP, "bias", bias, cols)?;
    let out = Tensor::empty(cx, &[rows], DType::I32)?;
    k.sample_step(
        SampleArgs {
            out: &out,
            x,
            bias,
            pos,
            rng,
        },
        rows,
        cols,
        limit,
        sampling,
    )?;
    Ok(out)
}

/// The row-wise argmax of `x + bias` (`bias` `[cols]`, optional), then `pos = min(pos + 1, limit)` on the device: the end
/// of a decode step, in one op.
pub fn argmax_step<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    x: &Tensor,
    bias: Option<&Tensor>,
    pos: &Tensor,
    limit: i32,
) -> Result<Tensor> {
    const OP: &str = "argmax_step";
    let (rows, cols) = logits_dims(OP, x)?;
    position(OP, pos)?;
    let bias = vector(OP, "bias", bias, cols)?;
    let out = Tensor::empty(cx, &[rows], DType::I32)?;
    k.argmax_step(
        ArgmaxArgs {
            out: &out,
            x,
            bias,
            pos,
        },
        rows,
        cols,
        limit,
    )?;
    Ok(out)
}

/// A residual add folded into the layer norm after it: `x_out = x + (a + bias)` (`bias`
/// `[d]` optional, `x` and `a` `[..., d]`) and `h = layer_norm(x_out)`; returns `(x_out, h)`.
#[allow(clippy::too_many_arguments)]
pub fn add_norm<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    x: &Tensor,
    a: &Tensor,
    bias: Option<&Tensor>,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "add_norm";
    dtype_is(OP, "x", x, DType::F32)?;
    dtype_is(OP, "a", a, DType::F32)?;
    shape_is(OP, "a", a, x.shape())?;
    let Some(&dim) = x.shape().last() else {
        return Err(TensorError::Shape {
            op: OP,
            operand: "x",
            expected: vec![1],
            found: Vec::new(),
        });
    };
    let bias = vector(OP, "bias", bias, dim)?;
    dtype_is(OP, "gamma", gamma, DType::F32)?;
    dtype_is(OP, "beta", beta, DType::F32)?;
    shape_is(OP, "gamma", gamma, &[dim])?;
    shape_is(OP, "beta", beta, &[dim])?;
    let rows = x.numel().checked_div(dim).unwrap_or(0);
    let x_out = Tensor::empty(cx, x.shape(), DType::F32)?;
    let h = Tensor::empty(cx, x.shape(), DType::F32)?;
    k.add_norm(
        AddNormArgs {
            x_out: &x_out,
            h: &h,
            x,
            a,
            bias,
            gamma,
            beta,
        },
        NormDims { rows, dim, eps },
    )?;
    Ok((x_out, h))
}
