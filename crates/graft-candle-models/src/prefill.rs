//! A serving cache's prefill: a prompt's chunk written into its sequence's cache row in one
//! step. With the fused attention a chunk is a batch of tokens of one row, each at its own
//! position (padding in the scratch row), through the decode step's block
//! ([`Decoder::blocks_at`]); otherwise the chunk runs as one sequence with its keys and values
//! scattered and the whole row attended, masked.

use candle_core::{DType, Result, Tensor};
use graft_candle::{CandleGraft, Error, Step, StepId};
use graft_candle_kernels::{SAMPLE_WORDS, SampleParams, sample_rows};

use super::cache::{KvCache, PrefillPlan};
use super::decoder::{Decoder, Slots};
use super::spec::DecoderSpec;

impl Decoder {
    /// One eager prefill chunk of sequence `row` of a serving cache: `tokens` (`[chunk]` u32)
    /// holds the next `len` tokens of its prompt, padded to `chunk` with any token. Writes
    /// their keys and values at the sequence's position and advances it by `len`; returns
    /// the token that follows the last of them (`[1]` u32), picked by `sampling`
    /// ([`SampleParams::GREEDY`]: the most likely).
    pub fn prefill_forward(
        &self,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
        len: usize,
        sampling: SampleParams,
    ) -> Result<Tensor> {
        cache.check_prefill(row, len, tokens.dims1()?)?;
        let meta = self.prefill_meta(row, len, sampling)?;
        let next = self.prefill_next(cache, tokens, &meta)?;
        cache.advance_row(row, len);
        Ok(next)
    }

    /// [`Decoder::prefill_forward`] under graft: `tokens` and the row, length and sampling
    /// parameters (uploaded as one `[2 + SAMPLE_WORDS]` u32 input) are the step's inputs, the
    /// weights and `cache` its statics, `[chunk, key]` its keys: register `step` with
    /// token-count buckets and pad `tokens` to one. One recording per bucket serves every
    /// sequence, position, length and sampling.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
        len: usize,
        sampling: SampleParams,
    ) -> std::result::Result<Step, Error> {
        let model = |source| Error::Model { source };
        let chunk = tokens.dims1().map_err(model)?;
        cache.check_prefill(row, len, chunk).map_err(model)?;
        let meta = self.prefill_meta(row, len, sampling).map_err(model)?;
        let statics = self.statics(cache);
        let out = graft.call(
            step,
            &[tokens, &meta],
            &statics,
            &[chunk as u64, self.key()],
            |inputs| Ok(vec![self.prefill_next(cache, &inputs[0], &inputs[1])?]),
        )?;
        cache.advance_row(row, len);
        Ok(out)
    }

    /// The `[2 + SAMPLE_WORDS]` u32 a prefill reads: the row, the real tokens, the sampling.
    fn prefill_meta(&self, row: usize, len: usize, sampling: SampleParams) -> Result<Tensor> {
        let mut meta = [0u32; 2 + SAMPLE_WORDS];
        meta[0] = row as u32;
        meta[1] = len as u32;
        meta[2..].copy_from_slice(&sampling.words());
        Tensor::new(&meta, self.device())
    }

    /// The prefill and its token choice (capturable).
    fn prefill_next(&self, cache: &KvCache, tokens: &Tensor, meta: &Tensor) -> Result<Tensor> {
        let logits = self.prefill_logits(cache, tokens, meta)?;
        let sampling = meta
            .narrow(0, 2, SAMPLE_WORDS)?
            .reshape((1, SAMPLE_WORDS))?;
        sample_rows(&logits, &sampling)
    }

    /// The prefill itself (no host-side checks): capturable. `meta` starts with the row and
    /// the number of real tokens (u32). Returns the last real token's logits (`[1, vocab]`
    /// f32).
    fn prefill_logits(&self, cache: &KvCache, tokens: &Tensor, meta: &Tensor) -> Result<Tensor> {
        let plan = cache.prefill_plan(meta, tokens.dims1()?)?;
        let h = self.prefill_hidden(cache, tokens, &plan)?;
        let logits = self
            .head(&h.index_select(&plan.last, 0)?)?
            .squeeze(1)?
            .to_dtype(DType::F32)?;
        cache.step_row(&plan, &meta.narrow(0, 1, 1)?)?;
        Ok(logits)
    }

    /// A chunk's blocks (no host-side checks: capturable): writes its keys and values as
    /// `plan` says and returns every position's final norm, `[chunk, 1, hidden]`. With the
    /// fused attention the chunk is a batch of tokens of one cache row, each at its own
    /// position (padding in the scratch row), through the decode step's kernels.
    pub(crate) fn prefill_hidden(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        plan: &PrefillPlan,
    ) -> Result<Tensor> {
        if !self.fused_attention {
            return self.prefill_unfused(cache, tokens, plan);
        }
        // [chunk, 1, hidden]: the decode step's shape, one token per "sequence".
        let x = self.embed_tokens(tokens)?.unsqueeze(1)?;
        let n = tokens.dims1()?;
        let at = Slots {
            positions: &plan.positions,
            lookup: &cache.lookup(Some(&plan.rows), n)?,
            mask: None,
        };
        self.blocks_at(x, &at, |i, lookup| cache.layer_at(i, lookup, n))
    }

    /// The prefill's blocks for heads the fused attention does not take: the chunk as one
    /// sequence, its keys and values scattered into the cache, attention over the whole row
    /// masked. Returns every position's final norm (`[chunk, 1, hidden]`).
    fn prefill_unfused(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        plan: &PrefillPlan,
    ) -> Result<Tensor> {
        let s = &self.spec;
        let chunk = tokens.dims1()?;
        let (mask, write_at) = cache.prefill_unfused(plan, s.head_dim)?;
        let (cos, sin) = self.rope.at(&plan.positions)?;
        let (cos, sin) = (cos.squeeze(1)?, sin.squeeze(1)?);
        let mut x = self.embed_tokens(tokens)?.unsqueeze(0)?;
        let mut h = self.first_norm(&x)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let (q, k, v) = b.qkv(&h, s, &self.rope, &cos, &sin)?;
            let (k_flat, v_flat) = cache.flat(i)?;
            let rows = s.kv_heads * chunk;
            k_flat.scatter_set(&write_at, &k.reshape((rows, s.head_dim))?, 0)?;
            v_flat.scatter_set(&write_at, &v.reshape((rows, s.head_dim))?, 0)?;
            let (k_row, v_row) = cache.row(i, &plan.row)?;
            let o = attend_chunk(&q, &k_row, &v_row, &mask, s)?;
            (x, h) = b.finish(&x, &o, self.norm_after(i), s, self.shard.as_ref())?;
        }
        // `h` is the final norm of every position, `[1, chunk, hidden]`.
        h.transpose(0, 1)
    }
}

/// Grouped-query attention of a prefill chunk of one sequence over its whole cache row: `q`
/// `[1, heads, chunk, hd]`, the row's caches `[1, kv, max_seq, hd]`, `mask` `[chunk,
/// max_seq]`; returns `[1, chunk, heads * hd]`.
fn attend_chunk(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    s: &DecoderSpec,
) -> Result<Tensor> {
    let (_, heads, chunk, hd) = q.dims4()?;
    let kv = s.kv_heads;
    let group = heads / kv;
    let max_seq = k.dim(2)?;
    let q = q.reshape((1, kv, group * chunk, hd))?;
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? / (hd as f64).sqrt())?;
    let scores = scores
        .reshape((1, kv, group, chunk, max_seq))?
        .broadcast_add(mask)?;
    let p = candle_nn::ops::softmax_last_dim(&scores)?
        .to_dtype(q.dtype())?
        .reshape((1, kv, group * chunk, max_seq))?;
    p.matmul(v)?
        .reshape((1, heads, chunk, hd))?
        .transpose(1, 2)?
        .reshape((1, chunk, heads * hd))
}
