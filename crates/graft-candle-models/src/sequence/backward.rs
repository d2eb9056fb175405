//! The decoder's training step as an explicit program, as llm.c writes one: a forward pass
//! that keeps what the backward pass reads, then a backward pass over graft-candle-kernels'
//! backward ops, without candle's autograd.
//!
//! candle's autograd gives every tensor's gradient a zeroed buffer and adds each contribution
//! into it (the first too): 130 add kernels and as many memsets in a step of the four-layer
//! bench model, 2.1 ms of 14.6 at batch 32 on an H100. Here each weight's gradient is the
//! output of the one kernel that computes it (a GEMM, or a norm's column sum); the input
//! gradients of projections that share an input (q, k, v; gate, up) are one output that the
//! GEMMs add into (`dense_sum`); the residual stream's gradient is added by the norm's
//! backward kernel that produces the block's input gradient. The one add left is a tied
//! embedding's, whose two uses each give it a gradient.

use candle_core::{Result, Tensor};
use candle_nn::Activation;
use graft_candle_kernels::{
    ClassifierGrads, SavedAttention, causal_attention_saved, classifier_with_grad, dense,
    dense_sum, dense_weight_grad, embedding, embedding_backward, rms_norm, rms_norm_backward,
    rotary, rotary_backward, swiglu, swiglu_backward,
};

use crate::decoder::{Block, Decoder};
use crate::moe::Mlp;
use crate::proj::Proj;

/// A training step's loss and gradients from [`Decoder::sequence_gradients`].
#[derive(Debug)]
pub struct SequenceGradients {
    /// The mean cross-entropy over every position, `[1]` f32.
    pub loss: Tensor,
    /// Each weight the decoder reads (the tensor itself, so a `Var` holding it finds its
    /// gradient by id) with its gradient, every weight once.
    pub grads: Vec<(Tensor, Tensor)>,
}

/// A block's weights, detached (no op on them is tracked by candle's autograd).
struct Weights {
    attn_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    mlp_norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

/// What a block's forward pass keeps for its backward pass.
struct Kept {
    x: Tensor,
    h1: Tensor,
    attention: SavedAttention,
    x_mid: Tensor,
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

impl Decoder {
    /// Why [`Decoder::sequence_gradients`] does not take this decoder (empty when it does):
    /// it knows dense, unbiased projections, SiLU-gated MLPs, no per-head query and key norms,
    /// and the fused causal attention, on one rank.
    pub fn sequence_gradients_unsupported(&self) -> Vec<String> {
        let s = &self.spec;
        let mut why = self.attention_unfused_because();
        if s.act != Activation::Silu {
            why.push(format!("mlp: {:?} activation (SwiGLU only)", s.act));
        }
        if self.shard.is_some() {
            why.push("a decoder split over ranks".into());
        }
        let unbiased = |p: &Proj| p.dense().is_some_and(|l| l.bias().is_none());
        if !unbiased(&self.lm_head) {
            why.push("the head: a quantized or biased projection".into());
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if b.qk_norm.is_some() {
                why.push(format!("block {i}: per-head query and key norms"));
            }
            let mlp_dense = match &b.mlp {
                Mlp::Gated { gate, up, down } => [gate, up, down].into_iter().all(unbiased),
                Mlp::Experts { .. } => {
                    why.push(format!("block {i}: a mixture of experts"));
                    true
                }
            };
            if !mlp_dense || ![&b.q, &b.k, &b.v, &b.o].into_iter().all(unbiased) {
                why.push(format!("block {i}: a quantized or biased projection"));
            }
        }
        why
    }

    /// The mean cross-entropy of predicting `targets` from `tokens` (both `[batch, seq]`
    /// u32), and every weight's gradient, by the explicit program (see the module
    /// documentation): the same forward kernels as [`Decoder::sequence_logits_with`]'s fused
    /// pass and the same backward kernels as its autograd, but each gradient written by the
    /// kernel that computes it, not added into a zeroed buffer. Fails, saying why, for a
    /// decoder [`Decoder::sequence_gradients_unsupported`] names reasons for.
    pub fn sequence_gradients(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<SequenceGradients> {
        let why = self.sequence_gradients_unsupported();
        if !why.is_empty() {
            candle_core::bail!(
                "the explicit backward pass does not take this decoder ({}): train it through candle's autograd",
                why.join("; ")
            );
        }
        let (_, seq) = tokens.dims2()?;
        self.check_length(seq)?;
        let s = &self.spec;
        let eps = s.eps as f32;
        let (cos, sin, style) = (&self.rope.cos, &self.rope.sin, self.rope.style());
        let weight = |p: &Proj| -> Result<Tensor> {
            match p.dense() {
                Some(l) => Ok(l.weight().detach()),
                None => candle_core::bail!("a quantized projection has no trainable weight"),
            }
        };
        let blocks = self
            .blocks
            .iter()
            .map(|b| block_weights(b, &weight))
            .collect::<Result<Vec<_>>>()?;
        let (embed, norm, head) = (
            self.embed.detach(),
            self.norm.detach(),
            weight(&self.lm_head)?,
        );

        // Forward, keeping what the backward pass reads.
        let mut x = embedding(tokens, &embed)?;
        let mut kept = Vec::with_capacity(blocks.len());
        for w in &blocks {
            let h1 = rms_norm(&x, &w.attn_norm, eps)?;
            let q = rotary(&dense(&h1, &w.q)?, cos, sin, s.heads, style)?;
            let k = rotary(&dense(&h1, &w.k)?, cos, sin, s.kv_heads, style)?;
            let v = dense(&h1, &w.v)?;
            let attention = causal_attention_saved(&q, &k, &v, s.heads, s.kv_heads)?;
            let x_mid = (&x + dense(attention.output(), &w.o)?)?;
            let h2 = rms_norm(&x_mid, &w.mlp_norm, eps)?;
            let (gate, up) = (dense(&h2, &w.gate)?, dense(&h2, &w.up)?);
            let act = swiglu(&gate, &up)?;
            let next = (&x_mid + dense(&act, &w.down)?)?;
            kept.push(Kept {
                x,
                h1,
                attention,
                x_mid,
                h2,
                gate,
                up,
                act,
            });
            x = next;
        }
        let hf = rms_norm(&x, &norm, eps)?;
        // The classifier and its backward pass over chunks of rows, one chunk's logits (and
        // their gradient, written over them) at a time.
        let row_bytes = head.dim(0)? * head.dtype().size_in_bytes();
        let chunk = classifier_chunk_rows(targets.elem_count(), row_bytes);
        let ClassifierGrads {
            loss,
            dh: dhf,
            dhead: d_head,
        } = classifier_with_grad(&hf, &head, targets, chunk)?;

        // Backward: every weight's gradient once, in the reverse order of the forward pass.
        let mut grads = Vec::with_capacity(2 + 9 * blocks.len());
        let (mut dx, d_norm) = rms_norm_backward(&x, &norm, &dhf, eps, None)?;
        grads.push((self.norm.clone(), d_norm));
        for ((b, w), k) in self.blocks.iter().zip(&blocks).zip(kept).rev() {
            let d_act = dense_sum(&[(&dx, &w.down)])?;
            let d_down = dense_weight_grad(&dx, &k.act)?;
            let (d_gate_out, d_up_out) = swiglu_backward(&k.gate, &k.up, &d_act)?;
            let dh2 = dense_sum(&[(&d_gate_out, &w.gate), (&d_up_out, &w.up)])?;
            let (d_gate, d_up) = (
                dense_weight_grad(&d_gate_out, &k.h2)?,
                dense_weight_grad(&d_up_out, &k.h2)?,
            );
            let (dx_mid, d_mlp_norm) =
                rms_norm_backward(&k.x_mid, &w.mlp_norm, &dh2, eps, Some(&dx))?;
            let d_o = dense_weight_grad(&dx_mid, k.attention.output())?;
            let (dq, dk, dv) = k.attention.backward(&dense_sum(&[(&dx_mid, &w.o)])?)?;
            let dq = rotary_backward(&dq, cos, sin, s.heads, style)?;
            let dk = rotary_backward(&dk, cos, sin, s.kv_heads, style)?;
            let dh1 = dense_sum(&[(&dq, &w.q), (&dk, &w.k), (&dv, &w.v)])?;
            let (d_q, d_k, d_v) = (
                dense_weight_grad(&dq, &k.h1)?,
                dense_weight_grad(&dk, &k.h1)?,
                dense_weight_grad(&dv, &k.h1)?,
            );
            let (dx_in, d_attn_norm) =
                rms_norm_backward(&k.x, &w.attn_norm, &dh1, eps, Some(&dx_mid))?;
            dx = dx_in;
            let Mlp::Gated { gate, up, down } = &b.mlp else {
                candle_core::bail!("a block's MLP changed kind");
            };
            for (p, g) in [
                (&b.q, d_q),
                (&b.k, d_k),
                (&b.v, d_v),
                (&b.o, d_o),
                (gate, d_gate),
                (up, d_up),
                (down, d_down),
            ] {
                grads.push((original(p)?, g));
            }
            grads.push((b.attn_norm.clone(), d_attn_norm));
            grads.push((b.mlp_norm.clone(), d_mlp_norm));
        }
        let d_embed = embedding_backward(&dx, tokens, embed.dim(0)?)?;
        let head_w = original(&self.lm_head)?;
        if head_w.id() == self.embed.id() {
            grads.push((self.embed.clone(), (d_embed + d_head)?));
        } else {
            grads.push((self.embed.clone(), d_embed));
            grads.push((head_w, d_head));
        }
        Ok(SequenceGradients { loss, grads })
    }
}

/// Block `b`'s weights through `weight` (detached).
fn block_weights(b: &Block, weight: &impl Fn(&Proj) -> Result<Tensor>) -> Result<Weights> {
    let Mlp::Gated { gate, up, down } = &b.mlp else {
        candle_core::bail!("the explicit backward pass takes SiLU-gated MLPs only");
    };
    Ok(Weights {
        attn_norm: b.attn_norm.detach(),
        q: weight(&b.q)?,
        k: weight(&b.k)?,
        v: weight(&b.v)?,
        o: weight(&b.o)?,
        mlp_norm: b.mlp_norm.detach(),
        gate: weight(gate)?,
        up: weight(up)?,
        down: weight(down)?,
    })
}

/// The weight tensor of a dense projection as the decoder holds it (its id is the `Var`'s).
fn original(p: &Proj) -> Result<Tensor> {
    match p.dense() {
        Some(l) => Ok(l.weight().clone()),
        None => candle_core::bail!("a quantized projection has no trainable weight"),
    }
}

/// The most bytes one chunk of the classifier's logits takes in the explicit backward pass.
/// Each chunk past the first costs a few small kernels and a re-read of the head's gradient:
/// on an H200, GPT-2's sizes at batch 8 in bf16 (824 MB of logits) stepped in 21.2 ms in four
/// chunks of 256 MiB against 20.9 ms in one, for a peak 532 MiB lower. So logits up to 1 GiB
/// stay one chunk, and larger ones (batch 32, or f32) split into chunks this size, of
/// thousands of rows each.
const CLASSIFIER_CHUNK_BYTES: usize = 1 << 30;

/// The rows of each of the classifier's chunks for `rows` rows of `row_bytes` of logits: as
/// few chunks as keep each one's logits within [`CLASSIFIER_CHUNK_BYTES`], the rows split
/// evenly between them.
fn classifier_chunk_rows(rows: usize, row_bytes: usize) -> usize {
    let most = (CLASSIFIER_CHUNK_BYTES / row_bytes.max(1)).max(1);
    let chunks = rows.div_ceil(most).max(1);
    rows.div_ceil(chunks).max(1)
}

#[cfg(test)]
mod tests {
    use super::classifier_chunk_rows;

    #[test]
    fn classifier_chunks_are_few_and_even() {
        let (gpt2_bf16, gpt2_f32) = (50_304 * 2, 50_304 * 4);
        // Eight sequences of 1,024 positions in bf16 fit (786 MiB); 32 take four chunks of
        // 8,192 rows, not three of 10,672 and a short fourth; in f32, two and seven.
        assert_eq!(classifier_chunk_rows(8 * 1024, gpt2_bf16), 8192);
        assert_eq!(classifier_chunk_rows(32 * 1024, gpt2_bf16), 8192);
        assert_eq!(classifier_chunk_rows(8 * 1024, gpt2_f32), 4096);
        assert_eq!(classifier_chunk_rows(32 * 1024, gpt2_f32), 4682);
        // The bench model's largest batch: one chunk, the step as before.
        assert_eq!(classifier_chunk_rows(32 * 128, 8192 * 4), 4096);
        // Rows wider than the budget: one row a chunk, never none.
        assert_eq!(classifier_chunk_rows(3, usize::MAX), 1);
        assert_eq!(classifier_chunk_rows(0, 4), 1);
    }
}
