//! `rope_store`: a decode step's rotary embedding at each sequence's device position, applied
//! to the queries and keys of a packed `qkv` projection (after an optional per-head RMS norm,
//! as Qwen3 has), with the rotated keys and the values written into the KV cache at that
//! position: what takes four or more launches unfused (rotate q, rotate k, two scatters, and
//! the norms) in one.
//!
//! On CUDA one kernel does all of it, one warp per (head, sequence), and writes the cache rows
//! through the caches' device addresses, as candle's in-place `scatter_set` would. On the CPU
//! (where a custom op cannot write a second tensor) the same op rotates the keys, candle's
//! `scatter_set` stores them and the values, and the op then rotates the queries.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::cpu::float_dispatch;
use crate::pages::{Index, Lookup};
use crate::{KernelError, check};

const OP: &str = "rope_store";

/// How a head's dims pair up for rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dim `i` with `i + head_dim / 2` (candle-nn's `rope`; Llama, Mistral, Qwen).
    Half,
    /// Dim `2i` with `2i + 1` (candle-nn's `rope_i`).
    Interleaved,
}

/// Per-head RMS norms applied before the rotation: `x / sqrt(mean(x²) + eps) * weight`,
/// rounded to the dtype (as `candle_nn::ops::rms_norm` leaves it).
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    /// `[head_dim]`, for every query head.
    pub q: &'a Tensor,
    /// `[head_dim]`, for every key head.
    pub k: &'a Tensor,
    pub eps: f32,
}

/// The rotary embedding of one decode step, stored.
///
/// - `qkv`: `[batch, (heads + 2 * kv_heads) * head_dim]`, contiguous: each sequence's query
///   heads, key heads, then value heads (a packed projection's output);
/// - `cos`, `sin`: `[table, head_dim / 2]` rotary tables, contiguous;
/// - `positions`: `[batch]` u32: where each sequence's new token goes (row `positions[b]` of
///   the tables, cache position `positions[b]`);
/// - `rows`: `None`, token `b` goes to cache row `b`; or `[batch]` u32, the cache row of each
///   token (a prefill chunk's tokens all go to one sequence's row);
/// - `k_cache`, `v_cache`: `[batch (any rows, with rows), kv_heads, max_seq, head_dim]`,
///   contiguous (a view of the first rows of a bigger cache is fine): the rotated keys and
///   the values are written at each token's row and position;
/// - all of one float dtype and device (positions u32).
///
/// Returns the rotated queries `[batch, heads, 1, head_dim]`. A position past the tables or
/// the cache, or a row past the cache, is an error on the CPU; the CUDA kernel clamps it to
/// the last (it cannot report data) and never writes outside the cache.
#[allow(clippy::too_many_arguments)]
pub fn rope_store(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    rows: Option<&Tensor>,
    caches: (&Tensor, &Tensor),
    heads: usize,
    style: RopeStyle,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    store(
        qkv,
        (cos, sin),
        positions,
        Lookup::Rows(rows),
        caches,
        heads,
        style,
        norm,
    )
}

/// [`rope_store`] into a paged cache: `k_pages`, `v_pages` are `[blocks, kv_heads,
/// block_size, head_dim]`, contiguous, and `table` (`[batch, max_blocks]` u32, contiguous)
/// lists each sequence's blocks in order: token b's key and value go to block
/// `table[b][positions[b] / block_size]` at offset `positions[b] % block_size` (see
/// [`crate::decode_attention_paged`], which reads them there). A position past `max_blocks *
/// block_size` or the tables, or a block id past the cache, is an error on the CPU; the CUDA
/// kernel clamps it to the last.
#[allow(clippy::too_many_arguments)]
pub fn rope_store_paged(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    table: &Tensor,
    pages: (&Tensor, &Tensor),
    heads: usize,
    style: RopeStyle,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    store(
        qkv,
        (cos, sin),
        positions,
        Lookup::Pages(table),
        pages,
        heads,
        style,
        norm,
    )
}

/// Either form: the op, with the caches looked up as `lookup` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn store(
    qkv: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    positions: &Tensor,
    lookup: Lookup<'_>,
    (k_cache, v_cache): (&Tensor, &Tensor),
    heads: usize,
    style: RopeStyle,
    norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    let dims = Dims::of(
        qkv, cos, sin, positions, lookup, k_cache, v_cache, heads, norm,
    )?;
    if dims.batch == 0 {
        return Tensor::zeros(dims.out_shape(Part::Queries), qkv.dtype(), qkv.device());
    }
    let table = lookup.table();
    let op = |part| RopeStore {
        dims,
        style,
        part,
        positions: positions.clone(),
        table: table.cloned(),
        norm: norm.map(|n| (n.q.clone(), n.k.clone(), n.eps)),
        caches: (k_cache.clone(), v_cache.clone()),
    };
    if qkv.device().is_cpu() {
        // Keys rotated by the op (which checks the positions and the table), then stored with
        // the values by candle, into the caches seen as `[places, head_dim]`.
        let (b, kv, hd) = (dims.batch, dims.kv_heads, dims.head_dim);
        let keys = qkv.apply_op3_no_bwd(cos, sin, &op(Part::Keys))?;
        let values = qkv
            .reshape((b, dims.heads + 2 * kv, hd))?
            .narrow(1, dims.heads + kv, kv)?;
        let at = places(positions, table, dims)?;
        let flat = |t: &Tensor| t.reshape((t.elem_count() / hd, hd));
        flat(k_cache)?.scatter_set(&at, &keys.reshape((b * kv, hd))?, 0)?;
        flat(v_cache)?.scatter_set(&at, &values.reshape((b * kv, hd))?, 0)?;
    }
    qkv.apply_op3_no_bwd(cos, sin, &op(Part::Queries))
}

/// `[batch * kv_heads, head_dim]` i64 (CPU): the place of token b's key head h in a cache seen
/// as `[blocks * kv_heads * block_size, head_dim]`, repeated along each row (the op checked
/// the positions and the table first).
fn places(positions: &Tensor, table: Option<&Tensor>, d: Dims) -> Result<Tensor> {
    let positions = positions.to_vec1::<u32>()?;
    let table = table
        .map(|t| t.flatten_all()?.to_vec1::<u32>())
        .transpose()?;
    let mut at = Vec::with_capacity(d.batch * d.kv_heads * d.head_dim);
    for (b, &p) in positions.iter().enumerate() {
        for h in 0..d.kv_heads {
            let place = d
                .index
                .place(OP, table.as_deref(), b, p as usize, d.kv_heads, h)?;
            at.extend(std::iter::repeat_n(place as i64, d.head_dim));
        }
    }
    Tensor::from_vec(
        at,
        (d.batch * d.kv_heads, d.head_dim),
        &candle_core::Device::Cpu,
    )
}

/// Which heads an op call rotates and returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// The queries (on CUDA, also storing the keys and values).
    Queries,
    /// The keys only (the CPU's first call).
    Keys,
}

/// The sizes, checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    batch: usize,
    /// Where each token's key and value go in the caches.
    index: Index,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    table: usize,
}

impl Dims {
    /// The sizes of `decode_step`'s rotary embedding, which checked them itself (the caches,
    /// the tables, the heads).
    #[cfg(feature = "cuda")]
    pub(crate) fn for_step(
        batch: usize,
        index: Index,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        table: usize,
    ) -> Self {
        Self {
            batch,
            index,
            heads,
            kv_heads,
            head_dim,
            table,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn of(
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        positions: &Tensor,
        lookup: Lookup<'_>,
        k: &Tensor,
        v: &Tensor,
        heads: usize,
        norm: Option<QkNorm<'_>>,
    ) -> Result<Self> {
        check::float(OP, "qkv", qkv)?;
        for (name, t) in [("cos", cos), ("sin", sin), ("k_cache", k), ("v_cache", v)] {
            check::like(OP, name, t, "qkv", qkv)?;
        }
        check::indices(OP, "positions", positions, qkv)?;
        let &[blocks, kv_heads, block_size, head_dim] = k.dims() else {
            return Err(check::shape(
                OP,
                "k_cache",
                k,
                "[batch, kv_heads, max_seq, head_dim]",
            ));
        };
        let batch = qkv.dims().first().copied().unwrap_or(0);
        if v.dims() != k.dims() {
            return Err(check::shape(OP, "v_cache", v, "k_cache's shape"));
        }
        let index = lookup.index(OP, qkv, k, batch)?;
        let max_seq = index.max_seq();
        if head_dim == 0 || !head_dim.is_multiple_of(2) || block_size == 0 {
            return Err(check::shape(
                OP,
                "k_cache",
                k,
                "[batch, kv_heads, max_seq, head_dim] with an even head_dim and max_seq > 0",
            ));
        }
        if qkv.dims() != [batch, (heads + 2 * kv_heads) * head_dim] {
            return Err(check::shape(
                OP,
                "qkv",
                qkv,
                "[batch, (heads + 2 * kv_heads) * head_dim], the cache's batch and heads",
            ));
        }
        let &[table, half] = cos.dims() else {
            return Err(check::shape(OP, "cos", cos, "[table, head_dim / 2]"));
        };
        if half != head_dim / 2 || table == 0 {
            return Err(check::shape(OP, "cos", cos, "[table, head_dim / 2]"));
        }
        if sin.dims() != cos.dims() {
            return Err(check::shape(OP, "sin", sin, "cos's shape"));
        }
        if positions.dims() != [batch] {
            return Err(check::shape(OP, "positions", positions, "[batch]"));
        }
        if let Some(n) = norm {
            for (name, w) in [("q norm", n.q), ("k norm", n.k)] {
                check::like(OP, name, w, "qkv", qkv)?;
                if w.dims() != [head_dim] {
                    return Err(check::shape(OP, name, w, "[head_dim]"));
                }
                check::contiguous(OP, name, w)?;
            }
        }
        for (name, t) in [
            ("qkv", qkv),
            ("cos", cos),
            ("sin", sin),
            ("positions", positions),
            ("k_cache", k),
            ("v_cache", v),
        ] {
            check::contiguous(OP, name, t)?;
        }
        for (what, size, limit) in [
            ("the batch", batch, 65535),
            ("the head count", heads + 2 * kv_heads, u32::MAX as usize),
            ("max_seq", max_seq, u32::MAX as usize),
            ("the cache's blocks", blocks, u32::MAX as usize),
            ("the table's rows", table, u32::MAX as usize),
        ] {
            if size > limit {
                return Err(KernelError::TooLarge { op: OP, what, size }.into());
            }
        }
        Ok(Self {
            batch,
            index,
            heads,
            kv_heads,
            head_dim,
            table,
        })
    }

    fn out_shape(&self, part: Part) -> Shape {
        let n = match part {
            Part::Queries => self.heads,
            Part::Keys => self.kv_heads,
        };
        Shape::from_dims(&[self.batch, n, 1, self.head_dim])
    }
}

/// The custom op over (qkv, cos, sin), holding clones (same storage) of the rest.
struct RopeStore {
    dims: Dims,
    style: RopeStyle,
    part: Part,
    positions: Tensor,
    /// `[batch]` u32 cache rows or `[batch, max_blocks]` u32 block ids (see `pages`), or
    /// `None`: each token's own row.
    table: Option<Tensor>,
    norm: Option<(Tensor, Tensor, f32)>,
    /// Where CUDA stores the keys and values.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    caches: (Tensor, Tensor),
}

impl CustomOp3 for RopeStore {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        ql: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(OP, "qkv", (qkv, cos, sin), |q, c, s| {
            self.cpu(q, ql, c, cl, s, sl)
        })?;
        Ok((out, self.dims.out_shape(self.part)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        ql: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, qkv, ql, cos, cl, sin, sl)
    }
}

impl RopeStore {
    /// The CPU rotation of this call's heads.
    fn cpu<T: WithDType>(
        &self,
        qkv: &[T],
        ql: &Layout,
        cos: &[T],
        cl: &Layout,
        sin: &[T],
        sl: &Layout,
    ) -> Result<CpuStorage> {
        let qkv = check::cpu_slice(OP, "qkv", qkv, ql)?;
        let cos = check::cpu_slice(OP, "cos", cos, cl)?;
        let sin = check::cpu_slice(OP, "sin", sin, sl)?;
        let d = self.dims;
        let hd = d.head_dim;
        let half = hd / 2;
        let positions = self.positions.to_vec1::<u32>()?;
        let table = self
            .table
            .as_ref()
            .map(|t| t.flatten_all()?.to_vec1::<u32>())
            .transpose()?;
        let norm = match &self.norm {
            Some((q, k, eps)) => Some((
                q.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                k.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                *eps,
            )),
            None => None,
        };
        let (first, count) = match self.part {
            Part::Queries => (0, d.heads),
            Part::Keys => (d.heads, d.kv_heads),
        };
        let mut out = Vec::with_capacity(d.batch * count * hd);
        let mut x = vec![0f32; hd];
        for (b, &position) in positions.iter().enumerate() {
            let p = position as usize;
            let max_seq = d.index.max_seq();
            if p >= max_seq || p >= d.table {
                return Err(KernelError::PositionPastCache {
                    sequence: b,
                    position,
                    max_seq: max_seq.min(d.table),
                }
                .into());
            }
            // The block holding the position exists (the place itself is the store's).
            d.index.place(OP, table.as_deref(), b, p, d.kv_heads, 0)?;
            let (c, s) = (&cos[p * half..][..half], &sin[p * half..][..half]);
            for h in first..first + count {
                let src = &qkv[(b * (d.heads + 2 * d.kv_heads) + h) * hd..][..hd];
                for (xi, &v) in x.iter_mut().zip(src) {
                    *xi = check::f32_of(v);
                }
                if let Some((qn, kn, eps)) = &norm {
                    let w = if h < d.heads { qn } else { kn };
                    let mean = x.iter().map(|v| v * v).sum::<f32>() / hd as f32;
                    let m = (mean + eps).sqrt();
                    for (xi, &wi) in x.iter_mut().zip(w) {
                        *xi = round::<T>(*xi / m * wi);
                    }
                }
                let mut rotated = vec![0f32; hd];
                for i in 0..half {
                    let (i1, i2) = match self.style {
                        RopeStyle::Half => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (ci, si) = (check::f32_of(c[i]), check::f32_of(s[i]));
                    rotated[i1] = x[i1] * ci - x[i2] * si;
                    rotated[i2] = x[i1] * si + x[i2] * ci;
                }
                out.extend(rotated.into_iter().map(|v| T::from_f64(f64::from(v))));
            }
        }
        Ok(T::to_cpu_storage_owned(out))
    }
}

/// `v` rounded to `T` and back.
fn round<T: WithDType>(v: f32) -> f32 {
    check::f32_of(T::from_f64(f64::from(v)))
}
