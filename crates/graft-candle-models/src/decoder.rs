//! The decoder every port builds: embedding, blocks of grouped-query attention over the
//! shared [`KvCache`] and a gated MLP, a final norm and the output projection. One decode
//! step reads the positions on the device, rotates at them, writes the new keys and values in
//! place, attends up to them (graft-candle-kernels' `decode_attention`, which reads the cache
//! only that far; the masked attention over the whole row where the heads do not fit it), and
//! advances the positions on the device: no host value that changes between steps reaches a
//! kernel, so a recorded step replays correctly at every position. The step's kernels are
//! graft-candle-kernels': q, k and v projected in one launch (`linear_cat`), rotated and
//! stored in one (`rope_store`), each residual add with the norm after it (`add_rms_norm`), a
//! SiLU-gated MLP's gate, up and SwiGLU in one (`linear_swiglu`). A prefill chunk runs the
//! same block (`prefill.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{D, DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use graft_candle_kernels::{
    QkNorm, SideStream, StepModel, add_rms_norm, argmax_last, decode_attention_fits, linear_cat,
};

use super::cache::{KvCache, Lookup};
use super::moe::Mlp;

use super::proj::{Proj, dense};
use super::rope::Rope;
use super::shard::Shard;
use super::spec::DecoderSpec;
use graft_candle::{CandleGraft, Error, Step, StepId, StepOutcome};

mod chain;
mod slots;

pub(crate) use slots::Slots;

/// One transformer block.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) attn_norm: Tensor,
    pub(crate) q: Proj,
    pub(crate) k: Proj,
    pub(crate) v: Proj,
    pub(crate) o: Proj,
    /// Per-head norms of queries and keys (Qwen3).
    pub(crate) qk_norm: Option<(Tensor, Tensor)>,
    pub(crate) mlp_norm: Tensor,
    pub(crate) mlp: Mlp,
}

/// A graph-ready decoder ported from one of candle-transformers' models (see
/// [the crate's docs](crate)): load it with the port's `load`, make a cache with
/// [`Decoder::new_cache`], and step it under graft with [`Decoder::decode`].
#[derive(Debug)]
pub struct Decoder {
    pub(crate) spec: DecoderSpec,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Proj,
    pub(crate) rope: Rope,
    /// The dtype of activations and of the cache.
    dtype: DType,
    /// A decode step attends with graft-candle-kernels' `decode_attention` (reading the cache
    /// only up to each position); `false` when the heads do not fit it (the unfused attention
    /// over the whole row, masked, then).
    pub(crate) fused_attention: bool,
    /// This rank's place when the decoder is one part of a tensor-parallel model: its
    /// blocks then sum their attention and MLP outputs over the ranks. `None`: the whole.
    pub(crate) shard: Option<Shard>,
    /// The model as graft-candle-kernels' `decode_step` takes it (its tensors shared), when
    /// the decoder is one it runs (dense, SiLU-gated, the fused attention, its vocabulary
    /// not split over ranks) and the chain is on ([`Decoder::set_chained_step`]): a decode
    /// step of up to `MATVEC_ROWS` rows is then that one chain of kernels.
    pub(crate) step: Option<StepModel>,
    /// Unique per decoder in this process: a signature key, so that a graph recorded for one
    /// decoder never replays for another (block-quantized weights cannot be statics).
    id: u64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Decoder {
    /// A decoder from its parts (the ports' loaders call this).
    pub(crate) fn from_parts(
        spec: DecoderSpec,
        embed: Tensor,
        blocks: Vec<Block>,
        norm: Tensor,
        lm_head: Proj,
        device: &Device,
    ) -> Result<Decoder> {
        let dtype = embed.dtype();
        let rope = Rope::new(&spec.rope, spec.head_dim, dtype, device)?;
        let fused_attention = match decode_attention_fits(spec.heads, spec.kv_heads, spec.head_dim)
        {
            Ok(()) => true,
            Err(why) => {
                tracing::debug!(%why, "decode steps attend unfused");
                false
            }
        };
        let mut decoder = Decoder {
            spec,
            embed,
            blocks,
            norm,
            lm_head,
            rope,
            dtype,
            fused_attention,
            shard: None,
            step: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        decoder.set_chained_step(true);
        Ok(decoder)
    }

    /// Whether a decode step of up to `MATVEC_ROWS` rows runs as graft-candle-kernels'
    /// `decode_step`, one chain of kernels each launched as a programmatic dependent of the
    /// one before (on, the default, where the decoder is one it runs: dense projections, a
    /// SiLU-gated MLP, the fused attention; a rank's part too, its vocabulary whole or split), or op by op
    /// (off). Steps recorded before the change keep what they recorded: register a new step
    /// to record the other way.
    pub fn set_chained_step(&mut self, on: bool) {
        self.step = if on { self.step_model() } else { None };
    }

    /// Loads a decoder of `spec` from a checkpoint in the Hugging Face layout (the tensor
    /// names [`DecoderSpec::checkpoint_tensors`] lists), in `vb`'s dtype.
    pub(crate) fn load_hf(spec: DecoderSpec, vb: &VarBuilder) -> Result<Decoder> {
        Decoder::load_hf_part(spec, vb, None)
    }

    /// [`Decoder::load_hf`] of rank `shard`'s part of the decoder (see [`Shard`]): the split
    /// weights narrowed to the rank's rows or columns of the whole checkpoint's, the rest
    /// whole. The decoder's spec is then the rank's (its heads, key/value heads and MLP
    /// width divided by the world), and so is its cache's.
    pub(crate) fn load_hf_part(
        spec: DecoderSpec,
        vb: &VarBuilder,
        shard: Option<Shard>,
    ) -> Result<Decoder> {
        spec.validate()?;
        if shard.is_some() && spec.moe.is_some() {
            candle_core::bail!(
                "{:?}: splitting a mixture-of-experts decoder over ranks is not supported; run it on one GPU",
                spec.arch
            );
        }
        // The rank's spec, checked before any weight is split.
        let local = shard.as_ref().map(|sh| sh.local(&spec)).transpose()?;
        let (d, hd) = (spec.hidden, spec.head_dim);
        let (q, kv) = (spec.heads * hd, spec.kv_heads * hd);
        // Splits a projection's weight (and bias) along `dim`, 0 for rows, 1 for columns.
        let split = |p: Proj, dim: usize| -> Result<Proj> {
            let (Some(sh), Proj::Dense(l)) = (&shard, &p) else {
                return Ok(p);
            };
            let bias = l.bias().map(|b| sh.part(b, 0)).transpose()?;
            Ok(Proj::Dense(Linear::new(sh.part(l.weight(), dim)?, bias)))
        };
        let embed = vb.get((spec.vocab, d), "model.embed_tokens.weight")?;
        // A split vocabulary: the rank's rows of the embedding (and so of a tied head).
        let vocab_split = shard.as_ref().filter(|sh| sh.splits_vocab());
        let embed = match vocab_split {
            Some(sh) => sh.part(&embed, 0)?,
            None => embed,
        };
        // One side stream for the decoder's shared experts, if it has any.
        let side = match spec.moe {
            Some(m) if m.shared.is_some() => SideStream::new(vb.device())?,
            _ => SideStream::none(),
        };
        let mut blocks = Vec::with_capacity(spec.layers);
        for i in 0..spec.layers {
            let l = vb.pp(format!("model.layers.{i}"));
            let attn = l.pp("self_attn");
            let qk_norm = if spec.qk_norm {
                Some((
                    attn.get(hd, "q_norm.weight")?,
                    attn.get(hd, "k_norm.weight")?,
                ))
            } else {
                None
            };
            blocks.push(Block {
                attn_norm: l.get(d, "input_layernorm.weight")?,
                q: split(dense(&attn.pp("q_proj"), q, d, spec.qkv_bias)?, 0)?,
                k: split(dense(&attn.pp("k_proj"), kv, d, spec.qkv_bias)?, 0)?,
                v: split(dense(&attn.pp("v_proj"), kv, d, spec.qkv_bias)?, 0)?,
                o: split(dense(&attn.pp("o_proj"), d, q, spec.o_bias)?, 1)?,
                qk_norm,
                mlp_norm: l.get(d, "post_attention_layernorm.weight")?,
                mlp: Mlp::load(&spec, i, &l, split, &side)?,
            });
        }
        let norm = vb.get(d, "model.norm.weight")?;
        let lm_head = if spec.tied_embeddings {
            Proj::Dense(Linear::new(embed.clone(), None))
        } else {
            let head = dense(&vb.pp("lm_head"), spec.vocab, d, false)?;
            match vocab_split {
                Some(_) => split(head, 0)?,
                None => head,
            }
        };
        let spec = local.unwrap_or(spec);
        let mut decoder = Decoder::from_parts(spec, embed, blocks, norm, lm_head, vb.device())?;
        decoder.shard = shard;
        // The chain again, now with the rank's sums between its kernels.
        decoder.set_chained_step(true);
        Ok(decoder)
    }

    /// Whether the shared experts (Qwen2-MoE) run on a side stream beside the routed ones
    /// (the default on CUDA) or on the device's stream after them. Steps recorded before the
    /// change keep what they recorded: register a new step to record the other way.
    pub fn set_side_stream(&mut self, on: bool) -> Result<()> {
        let side = if on {
            SideStream::new(self.device())?
        } else {
            SideStream::none()
        };
        for b in &mut self.blocks {
            b.mlp.set_side_stream(&side);
        }
        Ok(())
    }

    /// The rotary tables, cosines and sines, `[max_position_embeddings, head_dim / 2]` each:
    /// statics of any step that runs [`Decoder::sequence_logits`].
    pub fn rope_tables(&self) -> [&Tensor; 2] {
        [&self.rope.cos, &self.rope.sin]
    }

    /// What the decoder is (for one rank's part of a tensor-parallel model, that part: see
    /// [`Shard`]).
    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    /// The device its weights live on.
    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// The dtype of its activations and cache.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// A key unique to this decoder in this process; [`Decoder::decode`] passes it as
    /// `keys[1]`.
    pub fn key(&self) -> u64 {
        self.id
    }

    /// A zeroed cache for up to `max_batch` sequences of `max_seq` positions each, every
    /// position at 0. `max_seq` may not exceed the model's `max_position_embeddings`.
    pub fn new_cache(&self, max_batch: usize, max_seq: usize) -> Result<KvCache> {
        self.cache(max_batch, max_seq, false, None)
    }

    /// A zeroed cache for serving: [`Decoder::new_cache`]'s, plus one scratch row that
    /// [`Decoder::prefill`]'s padding tokens write (so a prefill chunk padded to its bucket
    /// never writes past a sequence's real tokens).
    pub fn new_serving_cache(&self, max_batch: usize, max_seq: usize) -> Result<KvCache> {
        self.cache(max_batch, max_seq, true, None)
    }

    /// A zeroed paged cache for serving: `blocks` blocks of `block_size` positions shared by
    /// up to `max_batch` sequences of up to `max_seq` positions each, each sequence's blocks
    /// named by [`KvCache::set_blocks`] (none at first), plus a scratch block for prefill
    /// padding. Its memory is `blocks` blocks' whatever `max_batch` and `max_seq` are. Decode
    /// steps, prefills and verify passes run on it as on [`Decoder::new_serving_cache`]'s,
    /// through the same kernels (a static row is a table of one block), so they give the same
    /// bits. Needs the fused decode attention: a model whose heads do not fit it is refused.
    pub fn new_paged_cache(
        &self,
        max_batch: usize,
        max_seq: usize,
        blocks: usize,
        block_size: usize,
    ) -> Result<KvCache> {
        if !self.fused_attention {
            candle_core::bail!(
                "a paged kv cache is read only by the fused decode attention, which does not take this model's heads ({} query, {} kv, head dim {}): use Decoder::new_serving_cache",
                self.spec.heads,
                self.spec.kv_heads,
                self.spec.head_dim
            );
        }
        self.cache(max_batch, max_seq, true, Some((blocks, block_size)))
    }

    fn cache(
        &self,
        max_batch: usize,
        max_seq: usize,
        serving: bool,
        paged: Option<(usize, usize)>,
    ) -> Result<KvCache> {
        if max_seq > self.spec.rope.max_positions {
            candle_core::bail!(
                "a kv cache of {max_seq} positions for a model of max_position_embeddings {}: use at most that many",
                self.spec.rope.max_positions
            );
        }
        let shape = (max_batch, self.spec.kv_heads, max_seq, self.spec.head_dim);
        let window = self.spec.sliding_window;
        KvCache::new(
            self.spec.layers,
            shape,
            window,
            serving,
            paged,
            self.dtype,
            self.device(),
        )
    }

    /// The tensors a decode step uses in place: the weights that are tensors and `cache`'s
    /// tensors. Pass them as the step's statics ([`Decoder::decode`] does).
    pub fn statics<'a>(&'a self, cache: &'a KvCache) -> Vec<&'a Tensor> {
        let mut all = vec![&self.embed, &self.norm, &self.rope.cos, &self.rope.sin];
        all.extend(self.lm_head.tensors());
        for b in &self.blocks {
            all.extend([&b.attn_norm, &b.mlp_norm]);
            if let Some((qn, kn)) = &b.qk_norm {
                all.extend([qn, kn]);
            }
            for p in [&b.q, &b.k, &b.v, &b.o] {
                all.extend(p.tensors());
            }
            all.extend(b.mlp.tensors());
        }
        all.extend(cache.tensors());
        all
    }

    /// One eager decode step: `tokens` (`[batch]` u32, the token at each sequence's position)
    /// in, the logits (`[batch, vocab]` f32) out; writes sequences `0..batch` of `cache` and
    /// advances their positions.
    pub fn forward(&self, cache: &KvCache, tokens: &Tensor) -> Result<Tensor> {
        let batch = tokens.dims1()?;
        cache.check_room(batch)?;
        let logits = self.logits(cache, tokens)?;
        cache.advance(batch);
        Ok(logits)
    }

    /// One eager greedy decode step: the next token of every sequence (`[batch]` u32).
    pub fn greedy(&self, cache: &KvCache, tokens: &Tensor) -> Result<Tensor> {
        argmax_last(&self.forward(cache, tokens)?)
    }

    /// One greedy decode step under graft: `tokens` (`[batch]` u32) is the step's input, the
    /// weights and `cache` its statics, and `[batch, key]` its keys, so `step` may be
    /// registered with buckets (`batch` is then the bucket: pad the tokens to it). The output
    /// is the next token of every sequence. Records once per bucket and cache, then replays
    /// at every position.
    pub fn decode(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        tokens: &Tensor,
    ) -> std::result::Result<Step, Error> {
        self.decode_with(graft, step, cache, &[tokens], |logits, _| {
            argmax_last(logits)
        })
    }

    /// [`Decoder::decode`] writing the next tokens into `next` (`[batch]` u32, made once;
    /// `tokens` itself decodes in place, as a hand-made graph does) through
    /// `CandleGraft::call_into`, with `statics` made once by [`Decoder::statics`]: a step on
    /// the same tensors as the last one allocates nothing on the host (no output tensor, no
    /// statics list). Returns what the call did.
    pub fn decode_into(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        statics: &[&Tensor],
        tokens: &Tensor,
        next: &Tensor,
    ) -> std::result::Result<StepOutcome, Error> {
        let batch = tokens
            .dims1()
            .and_then(|b| cache.check_room(b).map(|()| b))
            .map_err(|source| Error::Model { source })?;
        let outcome = graft.call_into(
            step,
            &[tokens],
            statics,
            &[batch as u64, self.id],
            std::slice::from_ref(next),
            |inputs| Ok(vec![argmax_last(&self.logits(cache, &inputs[0])?)?]),
        )?;
        cache.advance(batch);
        Ok(outcome)
    }

    /// A decode step under graft whose inputs are `inputs` (the tokens first) and whose
    /// output is `head(logits, inputs)`.
    pub(crate) fn decode_with(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        inputs: &[&Tensor],
        head: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
    ) -> std::result::Result<Step, Error> {
        let batch = inputs[0]
            .dims1()
            .and_then(|b| cache.check_room(b).map(|()| b))
            .map_err(|source| Error::Model { source })?;
        let statics = self.statics(cache);
        let out = graft.call(step, inputs, &statics, &[batch as u64, self.id], |inputs| {
            Ok(vec![head(&self.logits(cache, &inputs[0])?, inputs)?])
        })?;
        cache.advance(batch);
        Ok(out)
    }

    /// The embedding rows of `tokens` (`[n]` u32), `[n, hidden]`: the table's, or, with the
    /// vocabulary split over ranks, each rank's share summed over them.
    pub(crate) fn embed_tokens(&self, tokens: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(sh) if sh.splits_vocab() => sh.embed(&self.embed, tokens),
            _ => self.embed.index_select(tokens, 0),
        }
    }

    /// The output head over `h`: the whole vocabulary's logits, gathered over the ranks when
    /// the vocabulary is split.
    pub(crate) fn head(&self, h: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.decode(h)?;
        match &self.shard {
            Some(sh) if sh.splits_vocab() => sh.gather_vocab(&logits),
            _ => Ok(logits),
        }
    }

    /// The step itself (no host-side checks): capturable.
    pub(crate) fn logits(&self, cache: &KvCache, tokens: &Tensor) -> Result<Tensor> {
        let batch = tokens.dims1()?;
        let positions = cache.positions_of(batch)?;
        if let Some(logits) = self.chain_logits(cache, tokens, &positions, None)? {
            cache.step_positions(batch)?;
            return Ok(logits);
        }
        let mask = if self.fused_attention {
            None
        } else {
            Some(cache.mask(batch)?)
        };
        // [batch, 1, hidden]: one new position per sequence, shaped as candle's models do.
        let x = self.embed_tokens(tokens)?.unsqueeze(1)?;
        let at = Slots {
            positions: &positions,
            lookup: &cache.lookup(None, batch)?,
            mask: mask.as_ref(),
            runs: false,
        };
        let h = self.blocks_at(x, &at, |i, lookup| cache.layer_at(i, lookup, batch))?;
        let logits = self.head(&h)?.squeeze(1)?.to_dtype(DType::F32)?;
        cache.step_positions(batch)?;
        Ok(logits)
    }

    /// The blocks over `x` (`[n, 1, hidden]`, n tokens each at its own cache slot `at`), with
    /// `layer(i, lookup)` the caches of layer i that `at`'s lookup indexes. Each block: one launch for the query, key and value projections, one for the
    /// rotary embedding and the cache writes, the attention, the output projection, the
    /// residual add with the MLP's norm, one launch for the gate, up and SwiGLU, the down
    /// projection, and the add with the next norm. Returns the final norm (`[n, 1,
    /// hidden]`).
    pub(crate) fn blocks_at(
        &self,
        mut x: Tensor,
        at: &Slots<'_>,
        layer: impl Fn(usize, &Lookup) -> Result<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let s = &self.spec;
        let n = x.dim(0)?;
        let mut h = self.first_norm(&x)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let (k_cache, v_cache) = layer(i, at.lookup)?;
            let qkv = b.qkv_decode(&h)?.reshape((n, ()))?;
            let norm = b.qk_norm.as_ref().map(|(q, k)| QkNorm {
                q,
                k,
                eps: s.eps as f32,
            });
            // The rotated queries; the rotated keys and the values written at the slots.
            let caches = (&k_cache, &v_cache);
            let q = at.store(&qkv, &self.rope, caches, s.heads, norm)?;
            let o = match at.mask {
                Some(mask) => attend(&q, &k_cache, &v_cache, mask, s)?,
                None => at.attend(&q, caches, s)?,
            };
            (x, h) = b.finish(&x, &o, self.norm_after(i), s, self.shard.as_ref())?;
        }
        Ok(h)
    }
}

impl Decoder {
    /// The first block's input norm of the residual stream `x` (the final norm without
    /// blocks); every later norm comes fused with the residual add before it.
    pub(crate) fn first_norm(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.blocks.first().map_or(&self.norm, |b| &b.attn_norm);
        candle_nn::ops::rms_norm(x, w, self.spec.eps as f32)
    }

    /// The norm that follows block `i`: the next block's input norm, or the final one.
    pub(crate) fn norm_after(&self, i: usize) -> &Tensor {
        self.blocks.get(i + 1).map_or(&self.norm, |b| &b.attn_norm)
    }
}

impl Block {
    /// A decode step's query, key and value projections side by side, `[batch, 1, (heads +
    /// 2 kv_heads) * head_dim]`: one matrix-vector launch over the three dense weights in
    /// place; a quantized block's three projections, concatenated.
    fn qkv_decode(&self, h: &Tensor) -> Result<Tensor> {
        match (self.q.dense(), self.k.dense(), self.v.dense()) {
            (Some(q), Some(k), Some(v)) => linear_cat(
                h,
                &[
                    (q.weight(), q.bias()),
                    (k.weight(), k.bias()),
                    (v.weight(), v.bias()),
                ],
            ),
            _ => Tensor::cat(
                &[self.q.decode(h)?, self.k.decode(h)?, self.v.decode(h)?],
                D::Minus1,
            ),
        }
    }

    /// The rotated queries `[batch, heads, t, hd]`, rotated keys and values `[batch, kv, t,
    /// hd]` of the block's normed input `h` `[batch, t, hidden]` (t = 1 for a decode step).
    pub(crate) fn qkv(
        &self,
        h: &Tensor,
        s: &DecoderSpec,
        rope: &Rope,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (batch, len, _) = h.dims3()?;
        let heads = |t: Tensor, n: usize| {
            if len == 1 {
                // One position: `[batch, 1, n, hd]` and `[batch, n, 1, hd]` are the same
                // memory, so no transpose copy.
                t.reshape((batch, n, 1, s.head_dim))
            } else {
                t.reshape((batch, len, n, s.head_dim))?
                    .transpose(1, 2)?
                    .contiguous()
            }
        };
        let mut q = heads(self.q.forward(h)?, s.heads)?;
        let mut k = heads(self.k.forward(h)?, s.kv_heads)?;
        let v = heads(self.v.forward(h)?, s.kv_heads)?;
        if let Some((qn, kn)) = &self.qk_norm {
            let norm = |t: &Tensor, w: &Tensor, n: usize| {
                candle_nn::ops::rms_norm(&t.flatten(0, 2)?, w, s.eps as f32)?
                    .reshape((batch, n, len, s.head_dim))
            };
            q = norm(&q, qn, s.heads)?;
            k = norm(&k, kn, s.kv_heads)?;
        }
        Ok((rope.apply(&q, cos, sin)?, rope.apply(&k, cos, sin)?, v))
    }

    /// The block's output from its input `x` and the attention result `o` (`[batch, t,
    /// heads * hd]`): the output projection and the gated MLP, each added to the residual
    /// stream, with the norm that follows each add in the same launch (`add_rms_norm`): the
    /// MLP's own, then `next_norm` (the next block's input norm, or the final one). Returns
    /// the residual stream and its `next_norm`. On a rank of a tensor-parallel model each of
    /// the two is summed over the ranks first. The projections are graft-candle-kernels'
    /// (a matrix-vector kernel for a few rows; a SiLU-gated MLP's gate and up in one launch
    /// with the SwiGLU).
    pub(crate) fn finish(
        &self,
        x: &Tensor,
        o: &Tensor,
        next_norm: &Tensor,
        s: &DecoderSpec,
        shard: Option<&Shard>,
    ) -> Result<(Tensor, Tensor)> {
        let whole = |partial: Tensor| match shard {
            Some(sh) => sh.reduce(partial),
            None => Ok(partial),
        };
        let eps = s.eps as f32;
        let (x, h) = add_rms_norm(&whole(self.o.decode(o)?)?, x, &self.mlp_norm, eps)?;
        add_rms_norm(&whole(self.mlp.decode(&h, s.act)?)?, &x, next_norm, eps)
    }
}

/// Grouped-query attention of one new position per sequence over the whole cache: `q`
/// `[batch, heads, 1, hd]`, caches `[batch, kv, max_seq, hd]`, `mask` `[batch, 1, 1,
/// max_seq]` (added to the scores, which are f32); returns `[batch, 1, heads * hd]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, s: &DecoderSpec) -> Result<Tensor> {
    let batch = q.dim(0)?;
    let (heads, kv, hd) = (s.heads, s.kv_heads, s.head_dim);
    // The query heads of one KV head side by side: one matmul per KV head, no repeated cache.
    let q = q.reshape((batch, kv, heads / kv, hd))?;
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? / (hd as f64).sqrt())?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(mask)?)?.to_dtype(q.dtype())?;
    p.matmul(v)?.reshape((batch, 1, heads * hd))
}
