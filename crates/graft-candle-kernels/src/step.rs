//! `decode_step`: a dense decoder's whole decode step for a few rows as one chain of kernels:
//! the embedding, per layer the norm fused into the query-key-value projection, the rotary
//! embedding with the cache writes, the split-KV attention and its combine, the output
//! projection added to the residual stream, the norm fused into the gate-and-up projection
//! with SwiGLU, the down projection added to the residual stream; then the final norm fused
//! into the head.
//!
//! On CUDA it is one custom op that allocates its scratch once and launches every kernel
//! back to back, each a programmatic dependent of the one before (compute capability 9.0+):
//! a kernel's blocks start while the kernel before still runs, load their weights, and wait
//! for it before they read what it wrote. No tensor is made between two kernels, so a
//! recording holds the step as one chain of programmatic edges (a candle tensor made inside a
//! capture is a memory node, which no programmatic edge crosses). On the CPU it runs the
//! unfused composition of this crate's ops, the oracle the CUDA kernels are tested against.
//!
//! A tensor-parallel rank's part of a model ([`StepShard`]) runs the same chain with its
//! heads and MLP columns: one rank adds the residual stream into each block's partial output,
//! the others write theirs alone, and the shard's sum over the ranks runs in place between
//! the two kernels, so every rank holds the whole residual stream again. With the vocabulary
//! split too, the embedding kernel writes the rank's rows (zeros for the tokens of other
//! ranks) and the sum follows it, and the head writes the rank's columns of the logits.

#[cfg(feature = "cuda")]
mod cuda;

use std::fmt;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

use crate::linear::tensor_cores;
use crate::pages::{Index, Lookup};
use crate::{
    KernelError, MATVEC_ROWS, QkNorm, RopeStyle, TENSOR_ROWS, check, decode_attention_fits, linear,
    linear_cat, linear_swiglu, rms_norm,
};

const OP: &str = "decode_step";

/// One layer of a [`StepModel`]: its weights (`[out, in]` projections, biases `[out]`, norm
/// weights `[hidden]`).
#[derive(Debug, Clone)]
pub struct StepLayer {
    pub attn_norm: Tensor,
    pub q: (Tensor, Option<Tensor>),
    pub k: (Tensor, Option<Tensor>),
    pub v: (Tensor, Option<Tensor>),
    /// Per-head norms of the queries and keys (Qwen3), `[head_dim]` each.
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub o: (Tensor, Option<Tensor>),
    pub mlp_norm: Tensor,
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

/// A dense decoder with a SiLU-gated MLP, for [`decode_step`]: the tensors are shared with
/// the model (clones of the same storage).
#[derive(Debug, Clone)]
pub struct StepModel {
    /// `[vocab, hidden]`.
    pub embed: Tensor,
    pub layers: Vec<StepLayer>,
    /// The final norm's weight, `[hidden]`.
    pub norm: Tensor,
    /// The output projection, `[vocab, hidden]`.
    pub head: Tensor,
    /// The rotary tables, `[table, head_dim / 2]` each.
    pub cos: Tensor,
    pub sin: Tensor,
    pub style: RopeStyle,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The RMS norms' epsilon.
    pub eps: f32,
    /// Sliding-window attention's window, if any.
    pub window: Option<usize>,
    /// This rank's place when the model is one part of a tensor-parallel model (its heads,
    /// key/value heads and MLP width, `heads` and `kv_heads` then the part's); `None`: the
    /// whole model.
    pub shard: Option<StepShard>,
}

/// The sum over the ranks of a tensor-parallel model: takes this rank's `[batch, hidden]`
/// part and returns the sum, the same on every rank (it may sum in place and return its
/// argument). Every rank calls it with tensors of the same shape, in the same order.
pub type StepReduce = dyn Fn(Tensor) -> Result<Tensor> + Send + Sync;

/// How a rank's part of a tensor-parallel model (Megatron style: the query, key and value
/// projections split by heads, the output projection by its input columns, gate and up by
/// rows, down by columns; the norms whole, the embedding and the head whole or split by
/// vocabulary rows) joins the others in [`decode_step`]: after each block's attention and
/// after its MLP, the ranks' partial outputs are summed into the residual stream.
#[derive(Clone)]
pub struct StepShard {
    /// Whether this rank adds the residual stream into its partial outputs: exactly one
    /// rank of the group must, so that the sum holds it once.
    pub adds_residual: bool,
    /// The sum over the ranks.
    pub reduce: Arc<StepReduce>,
    /// With the vocabulary split over the ranks, the first vocabulary row of this rank's
    /// embedding and head (`StepModel::embed` and `head` then hold its rows only): the
    /// embedding takes the rows of the tokens in its range and zeros for the others, summed
    /// over the ranks, and the step's logits are this rank's columns of the vocabulary.
    /// `None`: both whole.
    pub vocab_first: Option<usize>,
}

impl fmt::Debug for StepShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepShard")
            .field("adds_residual", &self.adds_residual)
            .field("vocab_first", &self.vocab_first)
            .finish_non_exhaustive()
    }
}

impl StepShard {
    /// The embedding of `tokens` from this rank's `rows` of a table split by vocabulary
    /// rows from `first`: its rows of the tokens in its range, zeros for the others, summed
    /// over the ranks (adding zeros is exact: every rank gets the whole table's rows). On
    /// the CPU (the composition's; the kernel does the same on the device).
    fn embed(&self, rows: &Tensor, tokens: &Tensor, first: usize) -> Result<Tensor> {
        let n = rows.dim(0)?;
        let ids = tokens.to_vec1::<u32>()?;
        let local = |&t: &u32| (t as usize).checked_sub(first).filter(|&i| i < n);
        let index: Vec<u32> = ids.iter().map(|t| local(t).unwrap_or(0) as u32).collect();
        let mine: Vec<f32> = ids
            .iter()
            .map(|t| if local(t).is_some() { 1.0 } else { 0.0 })
            .collect();
        let device = rows.device();
        let mine = Tensor::new(mine, device)?.to_dtype(rows.dtype())?;
        let part = rows
            .index_select(&Tensor::new(index, device)?, 0)?
            .broadcast_mul(&mine.unsqueeze(1)?)?;
        (self.reduce)(part)
    }

    /// The residual stream after a block's attention or MLP: `x` plus the sum over the ranks
    /// of their partial outputs `y` (this rank's).
    fn join(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let part = if self.adds_residual { (x + y)? } else { y };
        (self.reduce)(part)
    }
}

/// Whether [`decode_step`] takes `rows` rows of a `dtype` model of these head counts and head
/// dim on `device` (`Err` says why not): at most [`TENSOR_ROWS`] rows in bf16 and f16 (the
/// projections on tensor cores; the model's sizes multiples of 8 and its weights 16-byte
/// aligned, which `decode_step` checks) or [`MATVEC_ROWS`] in f32, and heads the fused
/// attention takes. On the CPU, [`TENSOR_ROWS`] in every dtype: its composition gives a row the
/// same bits at every row count up to there, so one path serves every batch a server pads to.
pub fn decode_step_fits(
    device: &Device,
    dtype: DType,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> std::result::Result<(), KernelError> {
    let max = match dtype {
        _ if device.is_cpu() => TENSOR_ROWS,
        DType::BF16 | DType::F16 => TENSOR_ROWS,
        _ => MATVEC_ROWS,
    };
    if rows > max {
        return Err(KernelError::StepRows { rows, max, dtype });
    }
    decode_attention_fits(heads, kv_heads, head_dim)
}

/// One decode step of `model`: `tokens` (`[batch]` u32, the token at each sequence's
/// position `positions[b]`, `[batch]` u32) in, the logits (`[batch, vocab]`, the model's
/// dtype) out; writes each token's key and value into its layer's `caches` (`[rows,
/// kv_heads, max_seq, head_dim]` each, one pair per layer) in its row (`rows[b]`, or b
/// without rows) at its position. Reads and writes nothing else. A rank of a model whose
/// vocabulary is split ([`StepShard::vocab_first`]) gets its columns of the logits. At most
/// [`TENSOR_ROWS`] rows in bf16 and f16, [`MATVEC_ROWS`] in f32 (see [`decode_step_fits`]).
pub fn decode_step(
    model: &StepModel,
    caches: &[(Tensor, Tensor)],
    tokens: &Tensor,
    positions: &Tensor,
    rows: Option<&Tensor>,
) -> Result<Tensor> {
    step(model, caches, tokens, positions, Lookup::Rows(rows))
}

/// [`decode_step`] over paged caches: `pages` are `[blocks, kv_heads, block_size, head_dim]`
/// per layer, and `table` (`[batch, max_blocks]` u32, contiguous) lists each sequence's blocks
/// in order, as [`crate::decode_attention_paged`] reads them. The same kernels but the
/// attention's lookup, so the same bits as a static cache holding the same keys and values.
pub fn decode_step_paged(
    model: &StepModel,
    pages: &[(Tensor, Tensor)],
    tokens: &Tensor,
    positions: &Tensor,
    table: &Tensor,
) -> Result<Tensor> {
    step(model, pages, tokens, positions, Lookup::Pages(table))
}

/// Either form, the caches looked up as `lookup` says.
fn step(
    model: &StepModel,
    caches: &[(Tensor, Tensor)],
    tokens: &Tensor,
    positions: &Tensor,
    lookup: Lookup<'_>,
) -> Result<Tensor> {
    let batch = tokens.dims1()?;
    let dtype = model.embed.dtype();
    let device = model.embed.device();
    decode_step_fits(
        device,
        dtype,
        batch,
        model.heads,
        model.kv_heads,
        model.head_dim,
    )?;
    check::indices(OP, "tokens", tokens, &model.embed)?;
    check::indices(OP, "positions", positions, &model.embed)?;
    if positions.dims() != [batch] {
        return Err(check::shape(OP, "positions", positions, "[batch]"));
    }
    if caches.len() != model.layers.len() {
        return Err(KernelError::Caches {
            layers: model.layers.len(),
            got: caches.len(),
        }
        .into());
    }
    if model.embed.device().is_cpu() {
        return composed(model, caches, tokens, positions, lookup);
    }
    let dims = Dims::of(model, caches, batch, lookup)?;
    check::contiguous(OP, "tokens", tokens)?;
    check::contiguous(OP, "positions", positions)?;
    // A rank's residual stream is a tensor of its own, which the shard's sum takes.
    let residual = match model.shard {
        Some(_) => {
            let (shape, device) = ((batch, dims.hidden), model.embed.device());
            // SAFETY: the chain's first kernel, the embedding, writes every element before
            // anything reads one.
            Some(unsafe { Tensor::empty(shape, dtype, device) }?)
        }
        None => None,
    };
    let op = Step {
        model: model.clone(),
        caches: caches.to_vec(),
        tokens: tokens.clone(),
        positions: positions.clone(),
        table: lookup.table().cloned(),
        residual,
        dims,
    };
    // Over the embedding table: the custom op dispatches on its dtype, the model's.
    model.embed.apply_op1_no_bwd(&op)
}

/// The step as this crate's unfused ops (the CPU's, and the oracle of the CUDA kernels).
fn composed(
    m: &StepModel,
    caches: &[(Tensor, Tensor)],
    tokens: &Tensor,
    positions: &Tensor,
    lookup: Lookup<'_>,
) -> Result<Tensor> {
    let batch = tokens.dims1()?;
    let join = |x: &Tensor, y: Tensor| match &m.shard {
        Some(shard) => shard.join(x, y),
        None => x + y,
    };
    let mut x = match &m.shard {
        Some(
            shard @ StepShard {
                vocab_first: Some(first),
                ..
            },
        ) => shard.embed(&m.embed, tokens, *first)?,
        _ => m.embed.index_select(tokens, 0)?,
    };
    let scale = 1.0 / (m.head_dim as f32).sqrt();
    for (l, (kc, vc)) in m.layers.iter().zip(caches) {
        let h = rms_norm(&x, &l.attn_norm, m.eps)?;
        let qkv = linear_cat(&h, &[part(&l.q), part(&l.k), part(&l.v)])?;
        let norm = l.qk_norm.as_ref().map(|(q, k)| QkNorm { q, k, eps: m.eps });
        let q = crate::rope::store(
            &qkv,
            (&m.cos, &m.sin),
            positions,
            lookup,
            (kc, vc),
            m.heads,
            m.style,
            norm,
        )?;
        let o = crate::attention::attend(&q, (kc, vc), positions, lookup, scale, m.window, false)?
            .reshape((batch, m.heads * m.head_dim))?;
        x = join(&x, linear(&o, &l.o.0, l.o.1.as_ref())?)?;
        let h = rms_norm(&x, &l.mlp_norm, m.eps)?;
        x = join(
            &x,
            linear(&linear_swiglu(&h, &l.gate, &l.up)?, &l.down, None)?,
        )?;
    }
    linear(&rms_norm(&x, &m.norm, m.eps)?, &m.head, None)
}

/// A projection's weight and bias as the ops take them.
fn part((w, b): &(Tensor, Option<Tensor>)) -> (&Tensor, Option<&Tensor>) {
    (w, b.as_ref())
}

/// The step's sizes, checked.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Dims {
    batch: usize,
    /// Where each sequence's positions are in the caches.
    index: Index,
    hidden: usize,
    vocab: usize,
    /// The MLP's width.
    ffn: usize,
    /// The rotary tables' rows.
    table: usize,
}

impl Dims {
    fn of(
        m: &StepModel,
        caches: &[(Tensor, Tensor)],
        batch: usize,
        lookup: Lookup<'_>,
    ) -> Result<Self> {
        let &[vocab, hidden] = m.embed.dims() else {
            return Err(check::shape(OP, "embed", &m.embed, "[vocab, hidden]"));
        };
        check::float(OP, "embed", &m.embed)?;
        let (heads, kv, hd) = (m.heads, m.kv_heads, m.head_dim);
        if hd == 0 || !hd.is_multiple_of(2) {
            return Err(check::shape(
                OP,
                "cos",
                &m.cos,
                "[table, head_dim / 2] with an even head_dim",
            ));
        }
        let (Some(first), Some((k0, _))) = (m.layers.first(), caches.first()) else {
            return Err(KernelError::NoLayers.into());
        };
        let &[blocks, _, block_size, _] = k0.dims() else {
            return Err(check::shape(
                OP,
                "k_cache",
                k0,
                "[rows, kv_heads, max_seq, head_dim] (or [blocks, kv_heads, block_size, head_dim] paged)",
            ));
        };
        let &[ffn, _] = first.gate.dims() else {
            return Err(check::shape(OP, "gate", &first.gate, "[ffn, hidden]"));
        };
        let &[table, half] = m.cos.dims() else {
            return Err(check::shape(OP, "cos", &m.cos, "[table, head_dim / 2]"));
        };
        if half != hd / 2 || table == 0 || m.sin.dims() != m.cos.dims() {
            return Err(check::shape(
                OP,
                "cos",
                &m.cos,
                "[table, head_dim / 2], sin's shape",
            ));
        }
        if blocks == 0 || block_size == 0 {
            return Err(check::shape(
                OP,
                "k_cache",
                k0,
                "[batch (or any rows, with rows), kv_heads, max_seq > 0, head_dim]",
            ));
        }
        let index = lookup.index(OP, &m.embed, k0, batch)?;
        let like = |name: &'static str, t: &Tensor, dims: &[usize], expected| -> Result<()> {
            check::like(OP, name, t, "embed", &m.embed)?;
            if t.dims() != dims {
                return Err(check::shape(OP, name, t, expected));
            }
            check::contiguous(OP, name, t)
        };
        let proj =
            |name, (w, b): &(Tensor, Option<Tensor>), out: usize, inp: usize| -> Result<()> {
                like(name, w, &[out, inp], "[out, in] of the model's sizes")?;
                match b {
                    Some(b) => like("bias", b, &[out], "[out]"),
                    None => Ok(()),
                }
            };
        let cache = [blocks, kv, block_size, hd];
        for (l, (kc, vc)) in m.layers.iter().zip(caches) {
            like("attn_norm", &l.attn_norm, &[hidden], "[hidden]")?;
            like("mlp_norm", &l.mlp_norm, &[hidden], "[hidden]")?;
            proj("q", &l.q, heads * hd, hidden)?;
            proj("k", &l.k, kv * hd, hidden)?;
            proj("v", &l.v, kv * hd, hidden)?;
            proj("o", &l.o, hidden, heads * hd)?;
            like("gate", &l.gate, &[ffn, hidden], "[ffn, hidden]")?;
            like("up", &l.up, &[ffn, hidden], "[ffn, hidden]")?;
            like("down", &l.down, &[hidden, ffn], "[hidden, ffn]")?;
            if let Some((qn, kn)) = &l.qk_norm {
                like("q norm", qn, &[hd], "[head_dim]")?;
                like("k norm", kn, &[hd], "[head_dim]")?;
            }
            like("k_cache", kc, &cache, "[rows, kv_heads, max_seq, head_dim]")?;
            like("v_cache", vc, &cache, "k_cache's shape")?;
        }
        like("norm", &m.norm, &[hidden], "[hidden]")?;
        like("head", &m.head, &[vocab, hidden], "[vocab, hidden]")?;
        if batch > MATVEC_ROWS {
            // The projections on tensor cores: each one's weights (and norm) loadable.
            let dtype = m.embed.dtype();
            let aligned = |name, k, ts: &[&Tensor]| -> Result<()> {
                if tensor_cores(dtype, k, ts.iter().copied())? {
                    return Ok(());
                }
                Err(KernelError::Unaligned {
                    op: OP,
                    input: name,
                    rows: batch,
                }
                .into())
            };
            for l in &m.layers {
                let qkv = [&l.attn_norm, &l.q.0, &l.k.0, &l.v.0];
                aligned("the query, key or value weight", hidden, &qkv)?;
                aligned("the output weight", heads * hd, &[&l.o.0])?;
                let mlp = [&l.mlp_norm, &l.gate, &l.up];
                aligned("the gate or up weight", hidden, &mlp)?;
                aligned("the down weight", ffn, &[&l.down])?;
            }
            aligned("the head", hidden, &[&m.norm, &m.head])?;
        }
        like("cos", &m.cos, &[table, half], "[table, head_dim / 2]")?;
        like("sin", &m.sin, &[table, half], "[table, head_dim / 2]")?;
        for (what, size) in [
            ("the hidden size", hidden),
            ("the vocabulary", vocab),
            ("the MLP's width", ffn),
            ("the query width", heads * hd),
        ] {
            check::u32_of(OP, what, size)?;
        }
        Ok(Dims {
            batch,
            index,
            hidden,
            vocab,
            ffn,
            table,
        })
    }
}

/// The custom op over the embedding table, holding the model and the step's device values.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Step {
    model: StepModel,
    caches: Vec<(Tensor, Tensor)>,
    tokens: Tensor,
    positions: Tensor,
    /// `[batch]` u32 cache rows or `[batch, max_blocks]` u32 block ids, or `None`.
    table: Option<Tensor>,
    /// A rank's residual stream, `[batch, hidden]` (with the model's shard; the scratch holds
    /// it otherwise).
    residual: Option<Tensor>,
    dims: Dims,
}

impl CustomOp1 for Step {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // `decode_step` composes this crate's ops on the CPU instead.
        Err(KernelError::CudaOnly { op: OP }.into())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        embed: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, embed, layout)
    }
}

impl Step {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn out_shape(&self) -> Shape {
        Shape::from_dims(&[self.dims.batch, self.dims.vocab])
    }
}
