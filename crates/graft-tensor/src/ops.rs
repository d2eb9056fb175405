//! Tensor operations: check shapes and dtypes, allocate the output from the given allocator
//! (graft's pool inside a body, the eager pool outside), and enqueue the backend kernel.
//!
//! Nothing here reads device memory on the host, so every op is legal inside a captured body.

use crate::backend::Backend;
use crate::backend::{
    AddNormArgs, AttnDims, CacheDims, EmbedDims, EmbedNormArgs, GatherDims, LinearArgs, MatmulDims,
    NormDims, Ops, PositionDims, SoftmaxDims,
};
use crate::error::{Result, TensorError};
use crate::tensor::{Alloc, DType, Tensor};

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

/// An optional `[n]` f32 operand's address.
fn vector(
    op: &'static str,
    operand: &'static str,
    t: Option<&Tensor>,
    n: usize,
) -> Result<Option<graft_core::DevicePtr>> {
    match t {
        Some(t) => {
            dtype_is(op, operand, t, DType::F32)?;
            shape_is(op, operand, t, &[n])?;
            Ok(Some(t.ptr()?))
        }
        None => Ok(None),
    }
}

/// A position: a one-element i32 tensor on the device.
fn position(op: &'static str, pos: &Tensor) -> Result<()> {
    dtype_is(op, "pos", pos, DType::I32)?;
    shape_is(op, "pos", pos, &[1])
}

/// `out[r, :] = table[ids[r], :]`: `ids` is `[n]` i32, `table` `[vocab, d]` f32; out `[n, d]`.
/// Ids outside the vocabulary give zero rows.
pub fn embedding<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    ids: &Tensor,
    table: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "embedding";
    dtype_is(OP, "ids", ids, DType::I32)?;
    dtype_is(OP, "table", table, DType::F32)?;
    let rows = ids_len(OP, ids)?;
    let (vocab, dim) = matrix(OP, "table", table)?;
    let out = Tensor::empty(cx, &[rows, dim], DType::F32)?;
    cx.queue().embedding(
        out.ptr()?,
        ids.ptr()?,
        table.ptr()?,
        GatherDims { rows, vocab, dim },
    )?;
    Ok(out)
}

/// `out[r, :] = x[r, :] + table[pos, :]`: learned positions at a device-held position.
pub fn add_position<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    x: &Tensor,
    table: &Tensor,
    pos: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "add_position";
    dtype_is(OP, "x", x, DType::F32)?;
    dtype_is(OP, "table", table, DType::F32)?;
    position(OP, pos)?;
    let (rows, dim) = matrix(OP, "x", x)?;
    let (ctx, tdim) = matrix(OP, "table", table)?;
    if tdim != dim || ctx == 0 {
        return Err(TensorError::Shape {
            op: OP,
            operand: "table",
            expected: vec![ctx.max(1), dim],
            found: table.shape().to_vec(),
        });
    }
    let out = Tensor::empty(cx, x.shape(), DType::F32)?;
    cx.queue().add_position(
        out.ptr()?,
        x.ptr()?,
        table.ptr()?,
        pos.ptr()?,
        PositionDims { rows, ctx, dim },
    )?;
    Ok(out)
}

/// `a + b`, elementwise, same shapes.
pub fn add<D: Backend, A: Alloc<D> + ?Sized>(cx: &mut A, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    dtype_is(OP, "a", a, DType::F32)?;
    dtype_is(OP, "b", b, DType::F32)?;
    shape_is(OP, "b", b, a.shape())?;
    let out = Tensor::empty(cx, a.shape(), DType::F32)?;
    cx.queue().add(out.ptr()?, a.ptr()?, b.ptr()?, a.numel())?;
    Ok(out)
}

/// Layer norm over the last axis: `gamma` and `beta` are `[d]` for `x` of shape `[..., d]`.
pub fn layer_norm<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    dtype_is(OP, "x", x, DType::F32)?;
    let Some(&dim) = x.shape().last() else {
        return Err(TensorError::Shape {
            op: OP,
            operand: "x",
            expected: vec![1],
            found: Vec::new(),
        });
    };
    dtype_is(OP, "gamma", gamma, DType::F32)?;
    dtype_is(OP, "beta", beta, DType::F32)?;
    shape_is(OP, "gamma", gamma, &[dim])?;
    shape_is(OP, "beta", beta, &[dim])?;
    let rows = x.numel().checked_div(dim).unwrap_or(0);
    let out = Tensor::empty(cx, x.shape(), DType::F32)?;
    cx.queue().layer_norm(
        out.ptr()?,
        x.ptr()?,
        gamma.ptr()?,
        beta.ptr()?,
        NormDims { rows, dim, eps },
    )?;
    Ok(out)
}

/// `x[rows, k] · w[k, n] (+ bias[n])`: [`linear`] without GELU or residual.
pub fn matmul<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    linear(cx, x, w, bias, None, false)
}

/// GELU (tanh approximation), elementwise.
pub fn gelu<D: Backend, A: Alloc<D> + ?Sized>(cx: &mut A, x: &Tensor) -> Result<Tensor> {
    dtype_is("gelu", "x", x, DType::F32)?;
    let out = Tensor::empty(cx, x.shape(), DType::F32)?;
    cx.queue().gelu(out.ptr()?, x.ptr()?, x.numel())?;
    Ok(out)
}

/// Softmax of each row of `x` (`[..., cols]`) over columns `0..=pos`, zeros after: the
/// causal mask of single-token attention at the device position `pos`.
pub fn masked_softmax<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    x: &Tensor,
    pos: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "masked_softmax";
    dtype_is(OP, "x", x, DType::F32)?;
    position(OP, pos)?;
    let cols = x.shape().last().copied().unwrap_or(0);
    if cols == 0 {
        return Err(TensorError::Shape {
            op: OP,
            operand: "x",
            expected: vec![1],
            found: x.shape().to_vec(),
        });
    }
    let rows = x.numel() / cols;
    let out = Tensor::empty(cx, x.shape(), DType::F32)?;
    cx.queue()
        .masked_softmax(out.ptr()?, x.ptr()?, pos.ptr()?, SoftmaxDims { rows, cols })?;
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

/// Attention scores of one query token per sequence against the cached keys, scaled by
/// `1/sqrt(head_dim)`: `q` `[batch, d]`, `k_cache` `[batch, ctx, d]` → `[batch, heads, ctx]`,
/// zeros past `pos`.
pub fn attention_scores<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    q: &Tensor,
    k_cache: &Tensor,
    pos: &Tensor,
    heads: usize,
) -> Result<Tensor> {
    const OP: &str = "attention_scores";
    dtype_is(OP, "q", q, DType::F32)?;
    position(OP, pos)?;
    let (batch, d) = matrix(OP, "q", q)?;
    let dims = attn_dims(OP, batch, d, k_cache, "k_cache", heads)?;
    let out = Tensor::empty(cx, &[batch, heads, dims.ctx], DType::F32)?;
    cx.queue()
        .attention_scores(out.ptr()?, q.ptr()?, k_cache.ptr()?, pos.ptr()?, dims)?;
    Ok(out)
}

/// The attention-weighted sum of cached values: `probs` `[batch, heads, ctx]`, `v_cache`
/// `[batch, ctx, d]` → `[batch, d]`, over positions `0..=pos`.
pub fn attention_values<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    probs: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "attention_values";
    dtype_is(OP, "probs", probs, DType::F32)?;
    position(OP, pos)?;
    let (batch, heads, ctx) = match *probs.shape() {
        [b, h, c] => (b, h, c),
        _ => {
            return Err(TensorError::Shape {
                op: OP,
                operand: "probs",
                expected: vec![0, 0, 0],
                found: probs.shape().to_vec(),
            });
        }
    };
    let d = v_cache.shape().get(2).copied().unwrap_or(0);
    let dims = attn_dims(OP, batch, d, v_cache, "v_cache", heads)?;
    if dims.ctx != ctx {
        return Err(TensorError::Shape {
            op: OP,
            operand: "v_cache",
            expected: vec![batch, ctx, d],
            found: v_cache.shape().to_vec(),
        });
    }
    let out = Tensor::empty(cx, &[batch, d], DType::F32)?;
    cx.queue()
        .attention_values(out.ptr()?, probs.ptr()?, v_cache.ptr()?, pos.ptr()?, dims)?;
    Ok(out)
}

/// Single-token multi-head attention over a KV cache at the device position: scores, masked
/// softmax, weighted values. `q` `[batch, d]`, caches `[batch, ctx, d]` → `[batch, d]`.
pub fn attention<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    heads: usize,
) -> Result<Tensor> {
    let scores = attention_scores(cx, q, k_cache, pos, heads)?;
    let probs = masked_softmax(cx, &scores, pos)?;
    attention_values(cx, &probs, v_cache, pos)
}

/// `cache[b, pos, :] = x[b, :]`: `cache` `[batch, ctx, d]`, `x` `[batch, d]`. In place.
pub fn kv_write<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    cache: &Tensor,
    x: &Tensor,
    pos: &Tensor,
) -> Result<()> {
    const OP: &str = "kv_write";
    dtype_is(OP, "cache", cache, DType::F32)?;
    dtype_is(OP, "x", x, DType::F32)?;
    position(OP, pos)?;
    let (batch, dim) = matrix(OP, "x", x)?;
    let ctx = match *cache.shape() {
        [b, c, d] if b == batch && d == dim && c > 0 => c,
        _ => {
            return Err(TensorError::Shape {
                op: OP,
                operand: "cache",
                expected: vec![
                    batch,
                    cache.shape().get(1).copied().unwrap_or(1).max(1),
                    dim,
                ],
                found: cache.shape().to_vec(),
            });
        }
    };
    cx.queue().kv_write(
        cache.ptr()?,
        x.ptr()?,
        pos.ptr()?,
        CacheDims { batch, ctx, dim },
    )?;
    Ok(())
}

/// Index of the largest entry of each row of `x` `[rows, cols]` → `[rows]` i32 (first index
/// on ties; NaNs never win).
pub fn argmax<D: Backend, A: Alloc<D> + ?Sized>(cx: &mut A, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "argmax";
    dtype_is(OP, "x", x, DType::F32)?;
    let (rows, cols) = matrix(OP, "x", x)?;
    if cols == 0 || i32::try_from(cols).is_err() {
        return Err(TensorError::Shape {
            op: OP,
            operand: "x",
            expected: vec![rows, cols.clamp(1, i32::MAX as usize)],
            found: x.shape().to_vec(),
        });
    }
    let out = Tensor::empty(cx, &[rows], DType::I32)?;
    cx.queue().argmax(out.ptr()?, x.ptr()?, rows, cols)?;
    Ok(out)
}

/// `pos = min(pos + 1, limit)` on the device. In place.
pub fn increment<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    pos: &Tensor,
    limit: i32,
) -> Result<()> {
    position("increment", pos)?;
    cx.queue().increment(pos.ptr()?, limit)?;
    Ok(())
}

/// `gelu?(x[rows, k] · w[k, n] + bias[n]) + residual[rows, n]` in one op (bias, GELU and
/// residual each optional; GELU is the tanh approximation, applied before the residual).
pub fn linear<D: Backend, A: Alloc<D> + ?Sized>(
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
    let (rows, k) = matrix(OP, "x", x)?;
    let (wk, n) = matrix(OP, "w", w)?;
    if wk != k {
        return Err(TensorError::Shape {
            op: OP,
            operand: "w",
            expected: vec![k, n],
            found: w.shape().to_vec(),
        });
    }
    let bias = match bias {
        Some(b) => {
            dtype_is(OP, "bias", b, DType::F32)?;
            shape_is(OP, "bias", b, &[n])?;
            Some(b.ptr()?)
        }
        None => None,
    };
    let residual = match residual {
        Some(r) => {
            dtype_is(OP, "residual", r, DType::F32)?;
            shape_is(OP, "residual", r, &[rows, n])?;
            Some(r.ptr()?)
        }
        None => None,
    };
    let out = Tensor::empty(cx, &[rows, n], DType::F32)?;
    cx.queue().linear(
        LinearArgs {
            out: out.ptr()?,
            x: x.ptr()?,
            w: w.ptr()?,
            bias,
            residual,
            gelu,
        },
        MatmulDims { rows, k, n },
    )?;
    Ok(out)
}

/// Embedding, position add and layer norm in one op: `x = table[ids] + pos_table[pos]`
/// (ids outside the vocabulary give zero rows before the add) and `h = layer_norm(x)`, both
/// `[n, d]`; returns `(x, h)`.
#[allow(clippy::too_many_arguments)]
pub fn embed_norm<D: Backend, A: Alloc<D> + ?Sized>(
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
    cx.queue().embed_norm(
        EmbedNormArgs {
            x: x.ptr()?,
            h: h.ptr()?,
            ids: ids.ptr()?,
            table: table.ptr()?,
            pos_table: pos_table.ptr()?,
            pos: pos.ptr()?,
            gamma: gamma.ptr()?,
            beta: beta.ptr()?,
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
pub fn attention_step<D: Backend, A: Alloc<D> + ?Sized>(
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
    cx.queue().attention_step(
        out.ptr()?,
        qkv.ptr()?,
        bias,
        k_cache.ptr()?,
        v_cache.ptr()?,
        pos.ptr()?,
        dims,
    )?;
    Ok(out)
}

/// [`argmax`] of each row of `x + bias` (`bias` `[cols]`, optional), then `pos = min(pos + 1, limit)` on the device: the end
/// of a decode step, in one op.
pub fn argmax_step<D: Backend, A: Alloc<D> + ?Sized>(
    cx: &mut A,
    x: &Tensor,
    bias: Option<&Tensor>,
    pos: &Tensor,
    limit: i32,
) -> Result<Tensor> {
    const OP: &str = "argmax_step";
    dtype_is(OP, "x", x, DType::F32)?;
    position(OP, pos)?;
    let (rows, cols) = matrix(OP, "x", x)?;
    if cols == 0 || i32::try_from(cols).is_err() {
        return Err(TensorError::Shape {
            op: OP,
            operand: "x",
            expected: vec![rows, cols.clamp(1, i32::MAX as usize)],
            found: x.shape().to_vec(),
        });
    }
    let bias = vector(OP, "bias", bias, cols)?;
    let out = Tensor::empty(cx, &[rows], DType::I32)?;
    cx.queue()
        .argmax_step(out.ptr()?, x.ptr()?, bias, rows, cols, pos.ptr()?, limit)?;
    Ok(out)
}

/// A residual add folded into the layer norm after it: `x_out = x + (a + bias)` (`bias`
/// `[d]` optional, `x` and `a` `[..., d]`) and `h = layer_norm(x_out)`; returns `(x_out, h)`.
pub fn add_norm<D: Backend, A: Alloc<D> + ?Sized>(
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
    cx.queue().add_norm(
        AddNormArgs {
            x_out: x_out.ptr()?,
            h: h.ptr()?,
            x: x.ptr()?,
            a: a.ptr()?,
            bias,
            gamma: gamma.ptr()?,
            beta: beta.ptr()?,
        },
        NormDims { rows, dim, eps },
    )?;
    Ok((x_out, h))
}
