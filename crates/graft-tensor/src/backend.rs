//! The backend trait: the kernels a decoder step needs, on raw device addresses, implemented on
//! the body-facing queue of each backend: the simulator's ([`graft_sim::SimQueue`], host
//! loops) and CUDA's ([`graft_cuda::CudaQueue`], NVRTC kernels and cuBLAS). [`Backend`] names
//! a device whose queue implements them.
//!
//! Every method enqueues work on the device's runtime stream (recorded when capturing) and
//! checks nothing about shapes: the tensor-level functions in [`crate::ops`] do that before
//! calling here. Device scalars (`pos`) are read by the kernel when it runs, never by the host,
//! so a captured graph sees each replay's current value. Positions are clamped into
//! `0..ctx` on the device, so a bad position can never make a kernel touch memory outside its
//! operands.

use graft_core::{Device, DeviceError, DevicePtr};

/// Sizes of an embedding gather: `rows` ids into a `[vocab, dim]` table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct GatherDims {
    /// Ids to look up (rows of the output).
    pub rows: usize,
    /// Rows of the table; ids outside `0..vocab` give zero rows.
    pub vocab: usize,
    /// Columns of the table and the output.
    pub dim: usize,
}

/// Sizes of a position-embedding add: `[rows, dim]` plus row `pos` of a `[ctx, dim]` table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PositionDims {
    /// Rows of the input and output.
    pub rows: usize,
    /// Rows of the table.
    pub ctx: usize,
    /// Columns.
    pub dim: usize,
}

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

/// Sizes of a row softmax masked at a device position.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SoftmaxDims {
    /// Rows.
    pub rows: usize,
    /// Columns; entries past the position are masked.
    pub cols: usize,
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

/// Sizes of a KV-cache write: `[batch, dim]` into row `pos` of a `[batch, ctx, dim]` cache.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CacheDims {
    /// Sequences.
    pub batch: usize,
    /// Positions of the cache.
    pub ctx: usize,
    /// Columns.
    pub dim: usize,
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
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct EmbedNormArgs {
    /// Out: `[rows, dim]`, `table[ids[r]] + pos_table[pos]`.
    pub x: DevicePtr,
    /// Out: `[rows, dim]`, the layer norm of `x`.
    pub h: DevicePtr,
    /// `[rows]` i32 ids.
    pub ids: DevicePtr,
    /// `[vocab, dim]` token table.
    pub table: DevicePtr,
    /// `[ctx, dim]` position table.
    pub pos_table: DevicePtr,
    /// The i32 device position.
    pub pos: DevicePtr,
    /// `[dim]` norm scale.
    pub gamma: DevicePtr,
    /// `[dim]` norm shift.
    pub beta: DevicePtr,
}

/// Operands of [`Ops::linear`]: `out = act(x · w + bias) + residual`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LinearArgs {
    /// Out: `[rows, n]` (distinct from every input).
    pub out: DevicePtr,
    /// `[rows, k]`.
    pub x: DevicePtr,
    /// `[k, n]`.
    pub w: DevicePtr,
    /// `[n]`, added to every row.
    pub bias: Option<DevicePtr>,
    /// `[rows, n]`, added after the activation.
    pub residual: Option<DevicePtr>,
    /// Apply GELU (tanh approximation) after the bias.
    pub gelu: bool,
}

/// Operands of [`Ops::add_norm`]: `x_out = x + (a + bias)`, `h = layer_norm(x_out)`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AddNormArgs {
    /// Out: `[rows, dim]`, the sum.
    pub x_out: DevicePtr,
    /// Out: `[rows, dim]`, its layer norm.
    pub h: DevicePtr,
    /// `[rows, dim]`, the residual stream.
    pub x: DevicePtr,
    /// `[rows, dim]`, the update.
    pub a: DevicePtr,
    /// `[dim]`, added to every row of `a` first.
    pub bias: Option<DevicePtr>,
    /// `[dim]` norm scale.
    pub gamma: DevicePtr,
    /// `[dim]` norm shift.
    pub beta: DevicePtr,
}

/// A device whose body-facing queue runs the decoder's kernels: what graft-tensor is generic
/// over.
pub trait Backend: Device<Queue: Ops> + Clone {}

impl<D: Device<Queue: Ops> + Clone> Backend for D {}

/// The kernels of a decoder step, on raw addresses (see the module docs), on a device's queue.
pub trait Ops: Send + Sync + 'static {
    /// Copies host bytes to the device, synchronously (not inside a captured body).
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError>;

    /// Gets the backend ready (compiles kernels, creates library handles). Idempotent and
    /// cheap after the first call. Call it before capturing anything; each op calls it too.
    fn prepare(&self) -> Result<(), DeviceError>;

    /// `out[r, :] = table[ids[r], :]` (i32 ids; ids outside the vocabulary give zeros).
    fn embedding(
        &self,
        out: DevicePtr,
        ids: DevicePtr,
        table: DevicePtr,
        d: GatherDims,
    ) -> Result<(), DeviceError>;

    /// `out[r, :] = x[r, :] + table[pos, :]`, `pos` an i32 device scalar.
    fn add_position(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        table: DevicePtr,
        pos: DevicePtr,
        d: PositionDims,
    ) -> Result<(), DeviceError>;

    /// `out[i] = a[i] + b[i]` for `n` f32s (`out` may be `a` or `b`).
    fn add(&self, out: DevicePtr, a: DevicePtr, b: DevicePtr, n: usize) -> Result<(), DeviceError>;

    /// Layer norm of each row: `(x - mean) / sqrt(var + eps) * gamma + beta`.
    fn layer_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        gamma: DevicePtr,
        beta: DevicePtr,
        d: NormDims,
    ) -> Result<(), DeviceError>;

    /// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    fn gelu(&self, out: DevicePtr, x: DevicePtr, n: usize) -> Result<(), DeviceError>;

    /// Row softmax over columns `0..=pos` (`pos` an i32 device scalar, clamped into
    /// `0..cols`); columns past it are 0 in `out`.
    fn masked_softmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: SoftmaxDims,
    ) -> Result<(), DeviceError>;

    /// `out[b, h, j] = scale * q[b, h, :] · k[b, j, h, :]` for `j <= pos`, 0 past it;
    /// `out` is `[batch, heads, ctx]`.
    fn attention_scores(
        &self,
        out: DevicePtr,
        q: DevicePtr,
        k_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError>;

    /// `out[b, h, :] = sum_{j <= pos} probs[b, h, j] * v[b, j, h, :]`; `out` is
    /// `[batch, heads * head_dim]`.
    fn attention_values(
        &self,
        out: DevicePtr,
        probs: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError>;

    /// `cache[b, pos, :] = x[b, :]`.
    fn kv_write(
        &self,
        cache: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: CacheDims,
    ) -> Result<(), DeviceError>;

    /// `out[r] = argmax_j x[r, j]` as i32 (first index on ties; NaNs never win).
    fn argmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        rows: usize,
        cols: usize,
    ) -> Result<(), DeviceError>;

    /// `out = gelu?(x · w + bias) + residual` (see [`LinearArgs`]), all row-major f32.
    fn linear(&self, a: LinearArgs, d: MatmulDims) -> Result<(), DeviceError>;

    /// `x[r, :] = table[ids[r], :] + pos_table[pos, :]` (ids outside the vocabulary give
    /// zero rows before the add) and `h = layer_norm(x)` (see [`EmbedNormArgs`]).
    fn embed_norm(&self, a: EmbedNormArgs, d: EmbedDims) -> Result<(), DeviceError>;

    /// `x_out = x + (a + bias)` and `h = layer_norm(x_out)` row by row (see [`AddNormArgs`]):
    /// a residual add folded into the norm that follows it.
    fn add_norm(&self, a: AddNormArgs, d: NormDims) -> Result<(), DeviceError>;

    /// Single-token attention step: `qkv` is `[batch, 3 * d]` (the new token's q, k and v,
    /// plus `bias` `[3 * d]` when given); k and v are written into row `pos` of the `[batch, ctx, d]` caches,
    /// then `out[b, h, :] = softmax_{j <= pos}(scale * q[b, h, :] · k[b, j, h, :]) · v[b, j, h, :]`;
    /// `out` is `[batch, d]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_step(
        &self,
        out: DevicePtr,
        qkv: DevicePtr,
        bias: Option<DevicePtr>,
        k_cache: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError>;

    /// [`Ops::argmax`] of `x + bias` (bias `[cols]`, optional), then
    /// `pos = min(pos + 1, limit)` (the end of a decode step).
    #[allow(clippy::too_many_arguments)]
    fn argmax_step(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        bias: Option<DevicePtr>,
        rows: usize,
        cols: usize,
        pos: DevicePtr,
        limit: i32,
    ) -> Result<(), DeviceError>;

    /// `pos = min(pos + 1, limit)` on the device.
    fn increment(&self, pos: DevicePtr, limit: i32) -> Result<(), DeviceError>;
}
