//! The decoder's decode step as graft-candle-kernels' `decode_step` chain: the model in the
//! chain's terms, when the decoder is one the chain runs, and the logits of a step (or of a
//! verify pass's rows) through it.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use candle_nn::Activation;
use graft_candle_kernels::{
    StepLayer, StepModel, StepShard, decode_step, decode_step_fits, decode_step_paged,
};

use super::{Decoder, Mlp, Proj};
use crate::cache::{KvCache, Lookup};

impl Decoder {
    /// The decoder as `decode_step` takes it, if it is one it runs.
    pub(super) fn step_model(&self) -> Option<StepModel> {
        let s = &self.spec;
        if !self.fused_attention || s.act != Activation::Silu {
            return None;
        }
        // A rank's part sums its blocks' outputs over the ranks between the chain's kernels
        // (and its embedding after the first, with a split vocabulary).
        let shard = self.shard.as_ref().map(|sh| {
            let vocab_first = sh
                .splits_vocab()
                .then(|| sh.rank() * (s.vocab / sh.world()));
            let sh = sh.clone();
            StepShard {
                adds_residual: sh.rank() == 0,
                reduce: Arc::new(move |part| sh.reduce(part)),
                vocab_first,
            }
        });
        let dense = |p: &Proj| p.dense().map(|l| (l.weight().clone(), l.bias().cloned()));
        let unbiased = |p: &Proj| match dense(p) {
            Some((w, None)) => Some(w),
            _ => None,
        };
        let mut layers = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let Mlp::Gated { gate, up, down } = &b.mlp else {
                return None;
            };
            layers.push(StepLayer {
                attn_norm: b.attn_norm.clone(),
                q: dense(&b.q)?,
                k: dense(&b.k)?,
                v: dense(&b.v)?,
                qk_norm: b.qk_norm.clone(),
                o: dense(&b.o)?,
                mlp_norm: b.mlp_norm.clone(),
                gate: unbiased(gate)?,
                up: unbiased(up)?,
                down: unbiased(down)?,
            });
        }
        Some(StepModel {
            embed: self.embed.clone(),
            layers,
            norm: self.norm.clone(),
            head: unbiased(&self.lm_head)?,
            cos: self.rope.cos.clone(),
            sin: self.rope.sin.clone(),
            style: self.rope.style(),
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            eps: s.eps as f32,
            window: s.sliding_window,
            shard,
        })
    }

    /// The logits (`[batch, vocab]` f32) of `tokens` (`[batch]` u32) at `positions` through
    /// graft-candle-kernels' `decode_step` chain, writing their keys and values into cache
    /// rows `rows` (any of the cache's rows; a verify pass gives one row k + 1 times at
    /// consecutive positions, which the chain's cache write before its attention makes
    /// causal) or into rows `0..batch`; `None` where the chain does not take this decoder or
    /// this many rows. Advances no position.
    pub(crate) fn chain_logits(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        positions: &Tensor,
        rows: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let batch = tokens.dims1()?;
        let s = &self.spec;
        let fits = |m: &&StepModel| {
            decode_step_fits(
                m.embed.device(),
                m.embed.dtype(),
                batch,
                s.heads,
                s.kv_heads,
                s.head_dim,
            )
            .is_ok()
        };
        let Some(step) = self.step.as_ref().filter(fits) else {
            return Ok(None);
        };
        let lookup = cache.lookup(rows, batch)?;
        let caches = (0..s.layers)
            .map(|i| cache.layer_at(i, &lookup, batch))
            .collect::<Result<Vec<_>>>()?;
        let logits = match &lookup {
            Lookup::Rows(rows) => decode_step(step, &caches, tokens, positions, rows.as_ref())?,
            Lookup::Pages(table) => decode_step_paged(step, &caches, tokens, positions, table)?,
        };
        // A rank of a split vocabulary has its columns: the whole row gathered, as `head`.
        let logits = match &self.shard {
            Some(sh) if sh.splits_vocab() => sh.gather_vocab(&logits)?,
            _ => logits,
        };
        Ok(Some(logits.to_dtype(DType::F32)?))
    }
}
