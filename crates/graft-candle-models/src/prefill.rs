//! A serving cache's prefill: prompts' chunks written into their sequences' cache rows in
//! one step. With the fused attention a chunk is a batch of tokens, each of its own sequence's
//! row at its own position (one or several sequences, padding in the scratch row), through the
//! decode step's block ([`Decoder::blocks_at`]); otherwise the chunk is one sequence's, run
//! with its keys and values scattered and the whole row attended, masked.

use candle_core::{DType, Result, Tensor};
use graft_candle::{CandleGraft, Error, Step, StepId};
use graft_candle_kernels::{SAMPLE_WORDS, SampleParams, sample_rows};

use super::cache::{KvCache, PrefillPlan};
use super::decoder::{Decoder, Slots};
use super::spec::DecoderSpec;

/// The most sequences one prefill chunk takes ([`Decoder::prefill_segments`]): each recording
/// samples this many rows, unused ones ignored.
pub const PREFILL_SEGMENTS: usize = 16;

/// One sequence's part of a prefill chunk: its next `len` prompt tokens, written at its
/// position in cache row `row`; the token after them is picked by `sampling`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillSegment {
    /// The sequence's cache row.
    pub row: usize,
    /// Its tokens in the chunk (at least 1).
    pub len: usize,
    /// How the token after them is picked.
    pub sampling: SampleParams,
}

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
        let segment = PrefillSegment { row, len, sampling };
        self.prefill_segments_forward(cache, &[segment], tokens)?
            .narrow(0, 0, 1)
    }

    /// [`Decoder::prefill_forward`] under graft: `tokens` and the rows, lengths and sampling
    /// parameters (uploaded as one u32 input) are the step's inputs, the weights and `cache`
    /// its statics, `[chunk, key]` its keys: register `step` with token-count buckets and pad
    /// `tokens` to one. One recording per bucket serves every sequence, position, length and
    /// sampling (it is [`Decoder::prefill_segments`]'s, with one segment).
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
        let segment = PrefillSegment { row, len, sampling };
        let mut out = self.prefill_segments(graft, step, cache, &[segment], tokens)?;
        out.outputs[0] = out.outputs[0]
            .narrow(0, 0, 1)
            .map_err(|source| Error::Model { source })?;
        Ok(out)
    }

    /// One eager prefill chunk of several sequences (at most [`PREFILL_SEGMENTS`], in distinct
    /// rows of a serving cache): `tokens` (`[chunk]` u32) holds each segment's tokens in turn,
    /// padded to `chunk` with any token. Writes their keys and values at each sequence's
    /// position and advances it by its length; returns the token that follows each segment
    /// (`[segments]` u32). A later segment may read keys and values an earlier one writes
    /// (each layer writes the whole chunk's before it attends). More than one segment needs
    /// the fused attention.
    pub fn prefill_segments_forward(
        &self,
        cache: &KvCache,
        segments: &[PrefillSegment],
        tokens: &Tensor,
    ) -> Result<Tensor> {
        let chunk = tokens.dims1()?;
        self.check_segments(cache, segments, chunk)?;
        let meta = self.segments_meta(cache, segments, chunk)?;
        let next = self.prefill_next(cache, tokens, &meta)?;
        for s in segments {
            cache.advance_row(s.row, s.len);
        }
        next.narrow(0, 0, segments.len())
    }

    /// [`Decoder::prefill_segments_forward`] under graft: `tokens` and the segments (uploaded
    /// as one u32 input) are the step's inputs, the weights and `cache` its statics, `[chunk,
    /// key]` its keys. Its output is `[PREFILL_SEGMENTS]` u32, the first `segments.len()` the
    /// segments' next tokens. One recording per bucket serves every split into segments.
    pub fn prefill_segments(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        segments: &[PrefillSegment],
        tokens: &Tensor,
    ) -> std::result::Result<Step, Error> {
        let model = |source| Error::Model { source };
        let chunk = tokens.dims1().map_err(model)?;
        self.check_segments(cache, segments, chunk).map_err(model)?;
        let meta = self.segments_meta(cache, segments, chunk).map_err(model)?;
        let statics = self.statics(cache);
        let out = graft.call(
            step,
            &[tokens, &meta],
            &statics,
            &[chunk as u64, self.key()],
            |inputs| Ok(vec![self.prefill_next(cache, &inputs[0], &inputs[1])?]),
        )?;
        for s in segments {
            cache.advance_row(s.row, s.len);
        }
        Ok(out)
    }

    /// The host's checks of a chunk's segments: each fits its row, the rows differ, the
    /// lengths fit the chunk, and several need the fused attention.
    fn check_segments(
        &self,
        cache: &KvCache,
        segments: &[PrefillSegment],
        chunk: usize,
    ) -> Result<()> {
        let total: usize = segments.iter().map(|s| s.len).sum();
        if segments.is_empty() || segments.len() > PREFILL_SEGMENTS || total > chunk {
            candle_core::bail!(
                "a prefill chunk of {} segments and {total} tokens padded to {chunk}: pass 1 to {PREFILL_SEGMENTS} segments of at most {chunk} tokens together",
                segments.len()
            );
        }
        if segments.len() > 1 && !self.fused_attention {
            candle_core::bail!(
                "a prefill chunk of several sequences needs the fused attention, which this model's heads do not fit: prefill one sequence a chunk"
            );
        }
        for (i, s) in segments.iter().enumerate() {
            if segments[..i].iter().any(|t| t.row == s.row) {
                candle_core::bail!(
                    "two segments of one prefill chunk name cache row {}: give each sequence one segment",
                    s.row
                );
            }
            cache.check_prefill(s.row, s.len, chunk)?;
        }
        Ok(())
    }

    /// The u32 meta a chunk of `segments` reads (see `KvCache::segments_plan`), then each
    /// segment's sampling words (greedy for unused ones).
    fn segments_meta(
        &self,
        cache: &KvCache,
        segments: &[PrefillSegment],
        chunk: usize,
    ) -> Result<Tensor> {
        let n = PREFILL_SEGMENTS;
        let scratch = cache.max_batch() as u32;
        let mut rows = Vec::with_capacity(chunk);
        let mut offsets = Vec::with_capacity(chunk);
        let mut last = vec![0u32; n];
        let mut seg_rows = vec![scratch; n];
        let mut lens = vec![0u32; n];
        let mut words = Vec::with_capacity(n * SAMPLE_WORDS);
        for (i, s) in segments.iter().enumerate() {
            rows.extend(std::iter::repeat_n(s.row as u32, s.len));
            offsets.extend(0..s.len as u32);
            last[i] = (rows.len() - 1) as u32;
            seg_rows[i] = s.row as u32;
            lens[i] = s.len as u32;
            words.extend(s.sampling.words());
        }
        // Padding: the scratch row, each token at a place of its own.
        for i in rows.len()..chunk {
            rows.push(scratch);
            offsets.push(i as u32);
        }
        for _ in segments.len()..n {
            words.extend(SampleParams::GREEDY.words());
        }
        let meta: Vec<u32> = [rows, offsets, last, seg_rows, lens, words].concat();
        Tensor::new(meta.as_slice(), self.device())
    }

    /// The prefill and its token choices (capturable): `[PREFILL_SEGMENTS]` u32.
    fn prefill_next(&self, cache: &KvCache, tokens: &Tensor, meta: &Tensor) -> Result<Tensor> {
        let chunk = tokens.dims1()?;
        let n = PREFILL_SEGMENTS;
        let (plan, lens) = cache.segments_plan(meta, chunk, n)?;
        let h = self.prefill_hidden(cache, tokens, &plan)?;
        let logits = self
            .head(&h.index_select(&plan.last, 0)?)?
            .squeeze(1)?
            .to_dtype(DType::F32)?;
        cache.step_row(&plan, &lens)?;
        let sampling = meta
            .narrow(0, 2 * chunk + 3 * n, n * SAMPLE_WORDS)?
            .reshape((n, SAMPLE_WORDS))?;
        sample_rows(&logits, &sampling)
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
        self.hidden_at(cache, tokens, &plan.positions, &plan.rows, true)
    }

    /// The fused blocks over `tokens` (`[n]` u32), each in its own cache row of `rows` at its
    /// own position of `positions` (capturable): writes their keys and values and returns
    /// every token's final norm, `[n, 1, hidden]`. Tokens of one row at consecutive
    /// positions attend causally (each layer writes them all before it attends); with `runs`
    /// they come in long runs so (a prefill chunk), and the attention takes tiles of them.
    pub(crate) fn hidden_at(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        positions: &Tensor,
        rows: &Tensor,
        runs: bool,
    ) -> Result<Tensor> {
        // [n, 1, hidden]: the decode step's shape, one token per "sequence".
        let x = self.embed_tokens(tokens)?.unsqueeze(1)?;
        let n = tokens.dims1()?;
        let at = Slots {
            positions,
            lookup: &cache.lookup(Some(rows), n)?,
            mask: None,
            runs,
        };
        self.blocks_at(x, &at, |i, lookup| cache.layer_at(i, lookup, n))
    }

    /// The logits (`[n, vocab]` f32) of [`Decoder::hidden_at`]'s tokens: through the decode
    /// step's chain where it takes them, else the fused blocks and the head, one query a
    /// block in the attention (a verify pass's or a draft step's runs are a few tokens: a
    /// tile of them would take its runs one after another). Needs the fused attention.
    pub(crate) fn logits_at(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        positions: &Tensor,
        rows: &Tensor,
    ) -> Result<Tensor> {
        if let Some(logits) = self.chain_logits(cache, tokens, positions, Some(rows))? {
            return Ok(logits);
        }
        let h = self.hidden_at(cache, tokens, positions, rows, false)?;
        self.head(&h)?.squeeze(1)?.to_dtype(DType::F32)
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
            // The one segment's row.
            let (k_row, v_row) = cache.row(i, &plan.row.narrow(0, 0, 1)?)?;
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
