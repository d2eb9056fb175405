//! `decode_attention`: one decode step of grouped-query attention over a static KV cache,
//! reading keys and values only up to each sequence's position.
//!
//! On CUDA it is split over the cache ("flash-decoding"): a first kernel has one block per
//! (chunk of [`CHUNK`] cache positions, KV head, sequence) that scores all the query heads of
//! its KV head against the visible positions of its chunk (each key and value row loaded once
//! for the group) and writes an unnormalised partial (output, running max, sum) in f32
//! scratch; a block whose chunk holds no visible position reads nothing and writes an empty
//! partial (max -inf, sum 0). A second kernel combines the partials of each (sequence, head)
//! and writes the output. The grid depends only on shapes, so one CUDA-graph recording serves
//! every position. On the CPU it is plain loops over the visible positions.
//!
//! Candle's custom ops take at most three tensors: the op holds `positions` (a clone, sharing
//! its storage) and reaches its storage inside the forward (`storage_and_layout` on CUDA,
//! `to_vec1` on the CPU).

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::cpu::float_dispatch;
use crate::pages::{Index, Lookup};
use crate::{KernelError, check};

const OP: &str = "decode_attention";

/// Cache positions a block of the split kernel covers. 64 keeps enough blocks in flight at
/// batch 1 with few KV heads (a 4096-position cache is 64 chunks per KV head) while the
/// per-chunk work (64 key rows scored, 64 value rows summed per thread) still amortises the
/// block's setup and the partial it writes, and a group's scores fit in shared memory beside
/// its queries (see [`KernelError::GroupTooLarge`]).
pub const CHUNK: usize = 64;
/// The largest head dim: a warp holds one key row in 8 registers per lane.
const MAX_HEAD_DIM: usize = 256;
/// Shared memory a block of the split kernel may use (the default limit, no opt-in):
/// the group's queries and scores in f32, and a stage of value rows.
const SHARED_LIMIT: usize = 48 * 1024;
/// Bytes of value rows a split-kernel block stages in shared memory at once: a whole chunk's
/// at head_dim 128 in bf16 or f16 (and 64 in f32), so that the chunk's values are loaded in
/// one round beside its keys.
const STAGE_BYTES: usize = 16 * 1024;
/// CUDA's limit on the grid's y and z dimensions (KV heads and sequences).
const GRID_YZ_LIMIT: usize = 65535;

/// Attention of one new token per sequence over its KV cache row.
///
/// - `q`: `[batch, heads, 1, head_dim]`, contiguous;
/// - `k_cache`, `v_cache`: `[batch, kv_heads, max_seq, head_dim]`, each contiguous (a view
///   with a start offset, such as `narrow(0, 0, batch)` of a bigger cache, is fine);
/// - `positions`: `[batch]` u32 on q's device: the cache position the new token of each
///   sequence was written at;
/// - `rows`: `None`, each query `b` reads cache row `b` (the caches' batch is q's); or
///   `[batch]` u32, the cache row each query reads (the caches may then have any number of
///   rows: a prefill chunk is a batch of queries of one row, each at its own position);
/// - query head `h` uses KV head `h / (heads / kv_heads)` (grouped-query attention; K and V
///   are never repeated); `head_dim` is at most 256;
/// - position `j` is visible to sequence `b` when `j <= positions[b]` and, with
///   `window = Some(w)`, `j + w >= positions[b]`.
///
/// Returns `[batch, 1, heads * head_dim]` in q's dtype (f32, bf16 or f16; k and v share it):
/// per sequence and head, the softmax over visible positions of `q·k_j * scale`, times the
/// values, with scores, softmax and sums in f32. Only visible cache positions are read. A
/// position at or past `max_seq` is an error on the CPU; the CUDA kernel clamps it to
/// `max_seq - 1` (it cannot report data) and never reads outside the cache.
pub fn decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
    rows: Option<&Tensor>,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let lookup = Lookup::Rows(rows);
    attend(
        q,
        (k_cache, v_cache),
        positions,
        lookup,
        scale,
        window,
        false,
    )
}

/// [`decode_attention`] over a paged cache: `k_pages`, `v_pages` are `[blocks, kv_heads,
/// block_size, head_dim]`, each contiguous, and `table` (`[batch, max_blocks]` u32 on q's
/// device, contiguous) lists each sequence's blocks in order: its position `p` is in block
/// `table[b][p / block_size]` at offset `p % block_size`. A sequence may use `max_blocks *
/// block_size` positions (the `max_seq` above); entries past a sequence's position are never
/// read. A block id past the cache is an error on the CPU; the CUDA kernel clamps it to the
/// last block. The same kernel as the static cache's (a static cache is a table of one block
/// per sequence), so a paged cache holding the same keys and values gives the same bits.
pub fn decode_attention_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    positions: &Tensor,
    table: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let lookup = Lookup::Pages(table);
    attend(
        q,
        (k_pages, v_pages),
        positions,
        lookup,
        scale,
        window,
        false,
    )
}

/// [`decode_attention`] of queries that come in long runs of one sequence's consecutive
/// positions (a prefill chunk; `rows` names each query's cache row): the same result up to
/// rounding. In bf16 and f16 on CUDA (head_dim a multiple of 16 up to 128, a query head
/// group dividing 64), a block takes 64 query rows, tiles of a run's queries, on tensor
/// cores: each key and value is loaded once for the tile, not once per query, and the
/// softmax weights are rounded to the dtype before they weigh the values (the flash-attention
/// scheme). Each query's result does not depend on the others in its tile. A tile takes its
/// runs one after another, so queries in runs of a few (a verify pass) are faster with
/// [`decode_attention`]. Elsewhere it is [`decode_attention`].
pub fn prefill_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
    rows: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let lookup = Lookup::Rows(Some(rows));
    attend(
        q,
        (k_cache, v_cache),
        positions,
        lookup,
        scale,
        window,
        true,
    )
}

/// [`prefill_attention`] over a paged cache, as [`decode_attention_paged`] reads it: a run is
/// the queries whose table rows name the same blocks for a chunk of positions (one
/// sequence's, or sequences sharing a prefix).
pub fn prefill_attention_paged(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    positions: &Tensor,
    table: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let lookup = Lookup::Pages(table);
    attend(
        q,
        (k_pages, v_pages),
        positions,
        lookup,
        scale,
        window,
        true,
    )
}

/// Any form: the op over the caches, looked up as `lookup` says, the queries in runs of one
/// sequence's consecutive positions with `runs` ([`prefill_attention`]).
pub(crate) fn attend(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    positions: &Tensor,
    lookup: Lookup<'_>,
    scale: f32,
    window: Option<usize>,
    runs: bool,
) -> Result<Tensor> {
    let dims = Dims::of(q, k, v, positions, lookup)?;
    if dims.batch == 0 {
        return Tensor::zeros(dims.out_shape(), q.dtype(), q.device());
    }
    let op = DecodeAttention {
        positions: positions.clone(),
        table: lookup.table().cloned(),
        dims,
        scale,
        reach: window.map_or(dims.index.max_seq(), |w| w.min(dims.index.max_seq())),
        runs,
    };
    q.apply_op3_no_bwd(k, v, &op)
}

/// Whether [`decode_attention`] takes a model of these head counts and head dim (`Err` says
/// why not): a model decides once, at load, between it and the unfused attention.
pub fn decode_attention_fits(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> std::result::Result<(), KernelError> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(KernelError::Heads {
            op: OP,
            heads,
            kv_heads,
        });
    }
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(KernelError::HeadDim { head_dim });
    }
    let group = heads / kv_heads;
    // Any layout and dtype: a paged one of one-position blocks in f32 needs the most.
    let bytes = shared_bytes(group, head_dim, 1, size_of::<f32>());
    if bytes > SHARED_LIMIT {
        return Err(KernelError::GroupTooLarge {
            group,
            head_dim,
            bytes,
            limit: SHARED_LIMIT,
        });
    }
    Ok(())
}

/// Dynamic shared memory of a split-kernel block: the group's queries and its scores over
/// one chunk, in f32 (the group padded to a multiple of [`heads_at_once`]), then, at the next 8-byte boundary, the first cache row of each block of
/// `block_size` positions a chunk's positions are in (u64; a chunk starts anywhere in a block,
/// so one block more than fit in it), then, at the next 16-byte boundary, [`stage_rows`] value
/// rows of `elem`-byte elements.
fn shared_bytes(group: usize, head_dim: usize, block_size: usize, elem: usize) -> usize {
    let scores =
        group.next_multiple_of(heads_at_once(group)) * (head_dim + CHUNK) * size_of::<f32>();
    let blocks = (CHUNK.div_ceil(block_size.max(1)) + 1) * size_of::<u64>();
    (scores.next_multiple_of(8) + blocks).next_multiple_of(16)
        + stage_rows(head_dim, elem) * head_dim * elem
}

/// Query heads a split-kernel block takes at once (its `G`): the group's size rounded up to a
/// power of two, at most 8 (a larger group in rounds of 8; the last round's missing heads are
/// zero queries whose results are not written).
fn heads_at_once(group: usize) -> usize {
    group.next_power_of_two().min(8)
}

/// Value rows (positions) of `head_dim` `elem`-byte elements a split-kernel block stages at
/// once: a chunk's, or as many as [`STAGE_BYTES`] hold (at least one).
fn stage_rows(head_dim: usize, elem: usize) -> usize {
    (STAGE_BYTES / (head_dim * elem).max(1)).clamp(1, CHUNK)
}

/// The attention's sizes, checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    batch: usize,
    /// Where each sequence's positions are in the caches.
    index: Index,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Dims {
    fn of(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        positions: &Tensor,
        lookup: Lookup<'_>,
    ) -> Result<Self> {
        check::float(OP, "q", q)?;
        check::like(OP, "k_cache", k, "q", q)?;
        check::like(OP, "v_cache", v, "q", q)?;
        check::indices(OP, "positions", positions, q)?;
        let &[batch, heads, 1, head_dim] = q.dims() else {
            return Err(check::shape(OP, "q", q, "[batch, heads, 1, head_dim]"));
        };
        let &[blocks, kv_heads, block_size, khd] = k.dims() else {
            return Err(check::shape(
                OP,
                "k_cache",
                k,
                "[batch, kv_heads, max_seq, head_dim] (or [blocks, kv_heads, block_size, head_dim] paged)",
            ));
        };
        if khd != head_dim {
            return Err(check::shape(
                OP,
                "k_cache",
                k,
                "[batch (or any rows, with rows), kv_heads, max_seq, head_dim]",
            ));
        }
        if v.dims() != k.dims() {
            return Err(check::shape(OP, "v_cache", v, "k_cache's shape"));
        }
        if positions.dims() != [batch] {
            return Err(check::shape(OP, "positions", positions, "[batch]"));
        }
        let index = lookup.index(OP, q, k, batch)?;
        decode_attention_fits(heads, kv_heads, head_dim)?;
        if block_size == 0 {
            return Err(KernelError::EmptyCache.into());
        }
        let max_seq = index.max_seq();
        let dims = Self {
            batch,
            index,
            heads,
            kv_heads,
            head_dim,
        };
        for (what, size, limit) in [
            ("the batch", batch, GRID_YZ_LIMIT),
            ("the KV head count", kv_heads, GRID_YZ_LIMIT),
            ("the query head count", heads, GRID_YZ_LIMIT),
            ("max_seq", max_seq, u32::MAX as usize - CHUNK),
            ("the cache's blocks", blocks, u32::MAX as usize),
        ] {
            if size > limit {
                return Err(KernelError::TooLarge { op: OP, what, size }.into());
            }
        }
        check::contiguous(OP, "q", q)?;
        check::contiguous(OP, "k_cache", k)?;
        check::contiguous(OP, "v_cache", v)?;
        check::contiguous(OP, "positions", positions)?;
        Ok(dims)
    }

    /// The sizes of `decode_step`'s attention, which checked them itself (the heads with
    /// `decode_attention_fits`, the caches' shape).
    #[cfg(feature = "cuda")]
    pub(crate) fn for_step(
        batch: usize,
        index: Index,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            batch,
            index,
            heads,
            kv_heads,
            head_dim,
        }
    }

    /// Query heads per KV head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Chunks of [`CHUNK`] positions per cache row: the split kernel's grid x.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn splits(&self) -> usize {
        self.index.max_seq().div_ceil(CHUNK)
    }

    /// Dynamic shared memory of a split-kernel block for `elem`-byte elements.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn shared_bytes(&self, elem: usize) -> usize {
        shared_bytes(self.group(), self.head_dim, self.index.block_size, elem)
    }

    /// Query heads a split-kernel block takes at once.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn heads_at_once(&self) -> usize {
        heads_at_once(self.group())
    }

    /// Value rows a split-kernel block stages at once for `elem`-byte elements.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn stage_rows(&self, elem: usize) -> usize {
        stage_rows(self.head_dim, elem)
    }

    /// `[batch, 1, heads * head_dim]`.
    fn out_shape(&self) -> Shape {
        Shape::from_dims(&[self.batch, 1, self.heads * self.head_dim])
    }
}

/// The custom op over (q, k_cache, v_cache); the wrapper has checked everything about them.
struct DecodeAttention {
    /// `[batch]` u32 on q's device (a clone of the caller's tensor: the same storage).
    positions: Tensor,
    /// `[batch]` u32 cache rows or `[batch, max_blocks]` u32 block ids (see `pages`), or
    /// `None`: each query's own row.
    table: Option<Tensor>,
    dims: Dims,
    scale: f32,
    /// Positions `pos - reach ..= pos` are visible (`max_seq` without a window: all of
    /// `0..=pos`).
    reach: usize,
    /// The queries come in runs of one sequence's consecutive positions
    /// ([`prefill_attention`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    runs: bool,
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(OP, "q", (q, k, v), |q, k, v| {
            cpu::forward(self, q, ql, k, kl, v, vl)
        })?;
        Ok((out, self.dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, q, ql, k, kl, v, vl)
    }
}
