//! The backend traits: [`Ops`], the kernels a decoder step needs, held by a value bound to one
//! device (the simulator's [`crate::SimOps`], host loops; CUDA's [`crate::CudaOps`], NVRTC
//! kernels and cuBLAS), and [`Backend`], a device that can make one.
//!
//! Device scalars (`pos`) are read by the kernel when it runs, never by the host, so a
//! captured graph sees each replay's current value. Positions are clamped into `0..ctx` on
//! the device, so a bad position can never make a kernel touch memory outside its operands.

use std::fmt;

use graft_core::{Device, DeviceError};

use crate::error::Result;
use crate::sampling::Sampling;
use crate::tensor::Tensor;

/// Sizes of a layer norm over the last axis.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct NormDims {
    /// Rows.
    pub rows: usize,
    /// Columns (the normalized axis).
    pub dim: usize,
    /// Added to the variance.
    pub eps: f32,
}

/// Sizes of `out[rows, n] = x[rows, k] · w[k, n] (+ bias[n])`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MatmulDims {
    /// Rows of `x` and `out`.
    pub rows: usize,
    /// Columns of `x`, rows of `w`.
    pub k: usize,
    /// Columns of `w` and `out`.
    pub n: usize,
}

/// Sizes of single-token attention over a `[batch, ctx, heads * head_dim]` cache.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct AttnDims {
    /// Sequences (rows of the query).
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Columns per head.
    pub head_dim: usize,
    /// Positions of the cache.
    pub ctx: usize,
    /// Scale of the scores (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl AttnDims {
    /// `heads * head_dim`.
    pub fn model_dim(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Sizes of a fused embedding gather + position add + layer norm.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct EmbedDims {
    /// Ids to look up (rows of the outputs).
    pub rows: usize,
    /// Rows of the token table; ids outside `0..vocab` give zero rows.
    pub vocab: usize,
    /// Rows of the position table.
    pub ctx: usize,
    /// Columns of the tables and the outputs.
    pub dim: usize,
    /// Added to the variance of the norm.
    pub eps: f32,
}

/// Operands of [`Ops::embed_norm`].
#[derive(Clone, Copy, Debug)]
pub struct EmbedNormArgs<'a> {
    /// Out: `[rows, dim]`, `table[ids[r]] + pos_table[pos]`.
    pub x: &'a Tensor,
    /// Out: `[rows, dim]`, the layer norm of `x`.
    pub h: &'a Tensor,
    /// `[rows]` i32 ids.
    pub ids: &'a Tensor,
    /// `[vocab, dim]` token table.
    pub table: &'a Tensor,
    /// `[ctx, dim]` position table.
    pub pos_table: &'a Tensor,
    /// The i32 device position.
    pub pos: &'a Tensor,
    /// `[dim]` norm scale.
    pub gamma: &'a Tensor,
    /// `[dim]` norm shift.
    pub beta: &'a Tensor,
}

/// Operands of [`Ops::linear`]: `out = act(x · w + bias) + residual`.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs<'a> {
    /// Out: `[rows, n]` (distinct from every input).
    pub out: &'a Tensor,
    /// `[rows, k]`.
    pub x: &'a Tensor,
    /// `[k, n]`.
    pub w: &'a Tensor,
    /// `[n]`, added to every row.
    pub bias: Option<&'a Tensor>,
    /// `[rows, n]`, added after the activation.
    pub residual: Option<&'a Tensor>,
    /// Apply GELU (tanh approximation) after the bias.
    pub gelu: bool,
}

/// Operands of [`Ops::add_norm`]: `x_out = x + (a + bias)`, `h = layer_norm(x_out)`.
#[derive(Clone, Copy, Debug)]
pub struct AddNormArgs<'a> {
    /// Out: `[rows, dim]`, the sum.
    pub x_out: &'a Tensor,
    /// Out: `[rows, dim]`, its layer norm.
    pub h: &'a Tensor,
    /// `[rows, dim]`, the residual stream.
    pub x: &'a Tensor,
    /// `[rows, dim]`, the update.
    pub a: &'a Tensor,
    /// `[dim]`, added to every row of `a` first.
    pub bias: Option<&'a Tensor>,
    /// `[dim]` norm scale.
    pub gamma: &'a Tensor,
    /// `[dim]` norm shift.
    pub beta: &'a Tensor,
}

/// Operands of [`Ops::attention_step`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs<'a> {
    /// Out: `[batch, d]`.
    pub out: &'a Tensor,
    /// `[batch, 3 * d]`: the new token's q, k and v.
    pub qkv: &'a Tensor,
    /// `[3 * d]`, added to `qkv` first.
    pub bias: Option<&'a Tensor>,
    /// `[batch, ctx, d]` keys, written at row `pos`.
    pub k_cache: &'a Tensor,
    /// `[batch, ctx, d]` values, written at row `pos`.
    pub v_cache: &'a Tensor,
    /// The i32 device position.
    pub pos: &'a Tensor,
}

/// Operands of [`Ops::argmax_step`].
#[derive(Clone, Copy, Debug)]
pub struct ArgmaxArgs<'a> {
    /// Out: `[rows]` i32.
    pub out: &'a Tensor,
    /// `[rows, cols]`.
    pub x: &'a Tensor,
    /// `[cols]`, added to every row first.
    pub bias: Option<&'a Tensor>,
    /// The i32 device position, incremented.
    pub pos: &'a Tensor,
}

/// Operands of [`Ops::sample_step`].
#[derive(Clone, Copy, Debug)]
pub struct SampleArgs<'a> {
    /// Out: `[rows]` i32.
    pub out: &'a Tensor,
    /// `[rows, cols]` logits.
    pub x: &'a Tensor,
    /// `[cols]`, added to every row first.
    pub bias: Option<&'a Tensor>,
    /// The i32 device position, incremented.
    pub pos: &'a Tensor,
    /// `[4]` u32 generator state (key lo, key hi, offset lo, offset hi; see
    /// [`crate::philox`]): row `r` draws from counter (offset, r), then the offset advances.
    pub rng: &'a Tensor,
}

/// Sizes and constants of a token loop's bookkeeping ([`Ops::loop_begin`],
/// [`Ops::loop_record`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LoopDims {
    /// Rows (sequences).
    pub rows: usize,
    /// Iterations at most (tokens per row per launch).
    pub steps: usize,
    /// The context: the loop stops once the device position reaches it.
    pub ctx: i32,
    /// The end token, or -1 for none.
    pub eos: i32,
}

/// The device state of a token loop, made before it ([`crate::ops::loop_begin`]).
#[derive(Clone, Debug)]
pub struct LoopArgs<'a> {
    /// `[steps, rows]` i32: iteration `i`'s token of row `r`, or [`crate::PAD`].
    pub out: &'a Tensor,
    /// `[rows]` i32: the tokens the next iteration decodes from.
    pub cur: &'a Tensor,
    /// `[rows]` i32: tokens each row may still emit (0: stopped).
    pub left: &'a Tensor,
    /// `[2]` u32: the loop's flag (non-zero: run another iteration), then the iteration.
    pub ctl: &'a Tensor,
    /// The i32 device position (read only).
    pub pos: &'a Tensor,
}

/// A device whose kernels graft-tensor can run: [`Backend::load_ops`] makes the value that
/// holds them for one device.
pub trait Backend: Device + Clone {
    /// This backend's kernels, loaded for one device.
    type Ops: Ops;

    /// Loads this device's kernels (compiles them, creates library handles): slow on CUDA,
    /// so do it once, outside any capture, and keep the value. Dropping it unloads them; the
    /// device is released when the last of its handles goes.
    fn load_ops(&self) -> Result<Self::Ops, DeviceError>;
}

/// The kernels of a decoder step, bound to one device's queue. Every method enqueues work on
/// that device's runtime stream (recorded when capturing) and checks nothing about shapes:
/// the tensor-level functions in [`crate::ops`] do that before calling here.
pub trait Ops: Send + Sync + fmt::Debug + 'static {
    /// `out[i] = a[i] + b[i]` over `out`'s elements (`out` may be `a` or `b`).
    fn add(&self, out: &Tensor, a: &Tensor, b: &Tensor) -> Result<()>;

    /// `out = gelu?(x · w + bias) + residual` (see [`LinearArgs`]), all row-major f32.
    fn linear(&self, a: LinearArgs<'_>, d: MatmulDims) -> Result<()>;

    /// `x[r, :] = table[ids[r], :] + pos_table[pos, :]` (ids outside the vocabulary give
    /// zero rows before the add) and `h = layer_norm(x)` (see [`EmbedNormArgs`]).
    fn embed_norm(&self, a: EmbedNormArgs<'_>, d: EmbedDims) -> Result<()>;

    /// `x_out = x + (a + bias)` and `h = layer_norm(x_out)` row by row (see [`AddNormArgs`]):
    /// a residual add folded into the norm that follows it.
    fn add_norm(&self, a: AddNormArgs<'_>, d: NormDims) -> Result<()>;

    /// Single-token attention step (see [`AttentionArgs`]): k and v of `qkv` (plus `bias`)
    /// are written into row `pos` of the caches, then
    /// `out[b, h, :] = softmax_{j <= pos}(scale * q[b, h, :] · k[b, j, h, :]) · v[b, j, h, :]`.
    fn attention_step(&self, a: AttentionArgs<'_>, d: AttnDims) -> Result<()>;

    /// Row argmax of `x + bias` as i32 (first index on ties; NaNs never win), then
    /// `pos = min(pos + 1, limit)` (the end of a decode step; see [`ArgmaxArgs`]).
    fn argmax_step(&self, a: ArgmaxArgs<'_>, rows: usize, cols: usize, limit: i32) -> Result<()>;

    /// Picks each row's token from `x + bias` as `s` says ([`crate::sampling`]: greedy is
    /// [`Ops::argmax_step`]'s pick), row `r` with the uniform of counter (offset, r) of the
    /// generator state `rng`; then `offset += 1` and `pos = min(pos + 1, limit)` (see
    /// [`SampleArgs`]). The offset advances for greedy steps too.
    fn sample_step(
        &self,
        a: SampleArgs<'_>,
        rows: usize,
        cols: usize,
        limit: i32,
        s: Sampling,
    ) -> Result<()>;

    /// Starts a token loop (see [`LoopArgs`]): `out` all [`crate::PAD`], `cur = tokens`,
    /// `left = limits`, iteration 0, and the flag set if `d.steps > 0`, the position is below
    /// `d.ctx` and some row has a limit above 0.
    fn loop_begin(
        &self,
        a: &LoopArgs<'_>,
        tokens: &Tensor,
        limits: &Tensor,
        d: LoopDims,
    ) -> Result<()>;

    /// Ends iteration `i` (the device's count) of a token loop: each row with tokens left
    /// writes `next` into row `i` of `out` and has one fewer left (none after `d.eos`);
    /// `cur = next` for every row; the iteration becomes `i + 1`; the flag stays set while
    /// `i + 1 < d.steps`, the position is below `d.ctx` and some row has tokens left.
    fn loop_record(&self, a: &LoopArgs<'_>, next: &Tensor, d: LoopDims) -> Result<()>;
}
