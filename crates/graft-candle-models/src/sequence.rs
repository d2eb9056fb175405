//! Whole sequences through a [`Decoder`] at once, causally masked: the forward pass training
//! runs on the same weights the decode step uses. Two implementations of one function:
//! [`SequenceKernels::Fused`], graft-candle-kernels' differentiable ops (embedding, RMS norm,
//! one-GEMM projections, rotary, flash-style causal attention, SwiGLU, and cross-entropy in the loss),
//! and [`SequenceKernels::Unfused`], candle's differentiable elementwise ops (candle-nn's fused
//! RMSNorm, rotary and softmax kernels have no backward), the reference. [`backward`]: the
//! training step as an explicit program, without candle's autograd.

mod backward;

use candle_core::{D, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_nn::ops::rms_norm_slow;
use graft_candle_kernels::{
    causal_attention, causal_attention_fits, dense, embedding, rms_norm, rotary, swiglu,
};

use super::decoder::{Block, Decoder};
use super::moe::Mlp;
use super::proj::Proj;
use super::spec::DecoderSpec;

pub use backward::SequenceGradients;

/// A dropout applied inside [`Decoder::sequence_logits`].
pub type Dropout<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// Which kernels a whole-sequence forward pass (and its backward) runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SequenceKernels {
    /// graft-candle-kernels' fused ops with their fused backward passes; a part they do not
    /// cover runs unfused (see [`Decoder::fused_sequence_fallbacks`]).
    #[default]
    Fused,
    /// candle's elementwise ops only: the reference.
    Unfused,
}

impl Decoder {
    /// Logits `[batch, seq, vocab]` of `tokens` (`[batch, seq]` u32), every position
    /// attending to itself and the positions before it: `mask` is `[n, n]` for some `n` of at
    /// least `seq`, in the decoder's dtype, 0 on and below the diagonal and -inf above (its
    /// top-left `[seq, seq]` is used). `dropout`, when given, is
    /// applied to the output of every attention and MLP before the residual add. Fails if
    /// `seq` exceeds the rotary tables (`max_position_embeddings`).
    pub fn sequence_logits(
        &self,
        tokens: &Tensor,
        mask: &Tensor,
        dropout: Option<&Dropout<'_>>,
    ) -> Result<Tensor> {
        let (_, seq) = tokens.dims2()?;
        let s = &self.spec;
        self.check_length(seq)?;
        let mask = mask.narrow(0, 0, seq)?.narrow(1, 0, seq)?;
        let drop = |x: Tensor| match dropout {
            Some(f) => f(&x),
            None => Ok(x),
        };
        let mut x = Embedding::new(self.embed.clone(), s.hidden).forward(tokens)?;
        for b in &self.blocks {
            let y = self.attention(b, &x, &mask)?;
            x = (x + drop(b.o.forward(&y)?)?)?;
            let h = rms_norm_slow(&x, &b.mlp_norm, s.eps as f32)?;
            x = (x + drop(b.mlp.forward(&h, s.act)?)?)?;
        }
        self.lm_head
            .forward(&rms_norm_slow(&x, &self.norm, s.eps as f32)?)
    }

    /// [`Decoder::sequence_logits`] with `kernels`: the same logits from the fused ops (to
    /// within f32 rounding), with far fewer kernels forward and backward.
    pub fn sequence_logits_with(
        &self,
        tokens: &Tensor,
        mask: &Tensor,
        dropout: Option<&Dropout<'_>>,
        kernels: SequenceKernels,
    ) -> Result<Tensor> {
        match kernels {
            SequenceKernels::Unfused => self.sequence_logits(tokens, mask, dropout),
            SequenceKernels::Fused => self.fused_logits(tokens, mask, dropout),
        }
    }

    /// The parts of a fused forward pass that run unfused for this decoder, and why (empty
    /// when every part is fused).
    pub fn fused_sequence_fallbacks(&self) -> Vec<String> {
        let s = &self.spec;
        let mut why = self.attention_unfused_because();
        if s.act != candle_nn::Activation::Silu {
            why.push(format!("mlp: {:?} activation (SwiGLU is fused)", s.act));
        }
        why
    }

    /// Why the fused forward's attention runs unfused for this decoder (empty when it is
    /// fused).
    fn attention_unfused_because(&self) -> Vec<String> {
        let s = &self.spec;
        let mut why = Vec::new();
        if let Err(e) = causal_attention_fits(s.head_dim) {
            why.push(format!("attention: {e}"));
        }
        if s.sliding_window.is_some() {
            why.push(
                "attention: a sliding window (the fused kernel attends to every earlier position)"
                    .into(),
            );
        }
        why
    }

    /// Fails if `seq` exceeds the rotary tables (`max_position_embeddings`).
    fn check_length(&self, seq: usize) -> Result<()> {
        let max = self.spec.rope.max_positions;
        if seq > max {
            candle_core::bail!(
                "a sequence of {seq} tokens is longer than the model's max_position_embeddings of {max}"
            );
        }
        Ok(())
    }

    fn fused_logits(
        &self,
        tokens: &Tensor,
        mask: &Tensor,
        dropout: Option<&Dropout<'_>>,
    ) -> Result<Tensor> {
        let (batch, seq) = tokens.dims2()?;
        let s = &self.spec;
        self.check_length(seq)?;
        let fused_attention = self.attention_unfused_because().is_empty();
        let mask = mask.narrow(0, 0, seq)?.narrow(1, 0, seq)?;
        let drop = |x: Tensor| match dropout {
            Some(f) => f(&x),
            None => Ok(x),
        };
        let eps = s.eps as f32;
        let mut x = embedding(tokens, &self.embed)?;
        let (cos, sin) = (&self.rope.cos, &self.rope.sin);
        for b in &self.blocks {
            let h = rms_norm(&x, &b.attn_norm, eps)?;
            let (mut q, mut k, v) = (project(&b.q, &h)?, project(&b.k, &h)?, project(&b.v, &h)?);
            if let Some((qn, kn)) = &b.qk_norm {
                let per_head = |t: &Tensor, w: &Tensor| -> Result<Tensor> {
                    let n = t.dim(2)? / s.head_dim;
                    rms_norm(&t.reshape((batch, seq, n, s.head_dim))?, w, eps)?.reshape((
                        batch,
                        seq,
                        n * s.head_dim,
                    ))
                };
                q = per_head(&q, qn)?;
                k = per_head(&k, kn)?;
            }
            let q = rotary(&q, cos, sin, s.heads, self.rope.style())?;
            let k = rotary(&k, cos, sin, s.kv_heads, self.rope.style())?;
            let y = if fused_attention {
                causal_attention(&q, &k, &v, s.heads, s.kv_heads)?
            } else {
                unfused_attention(&q, &k, &v, &mask, s)?
            };
            x = (x + drop(project(&b.o, &y)?)?)?;
            let h = rms_norm(&x, &b.mlp_norm, eps)?;
            let m = match &b.mlp {
                Mlp::Gated { gate, up, down } if s.act == candle_nn::Activation::Silu => {
                    project(down, &swiglu(&project(gate, &h)?, &project(up, &h)?)?)?
                }
                mlp => mlp.forward(&h, s.act)?,
            };
            x = (x + drop(m)?)?;
        }
        project(&self.lm_head, &rms_norm(&x, &self.norm, eps)?)
    }

    /// Causal grouped-query attention of block `b` over `x` (`[batch, seq, hidden]`), before
    /// the output projection: `[batch, seq, heads * head_dim]`.
    fn attention(&self, b: &Block, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let s = &self.spec;
        let (batch, seq, _) = x.dims3()?;
        let hd = s.head_dim;
        let h = rms_norm_slow(x, &b.attn_norm, s.eps as f32)?;
        let split = |p: &Proj, n: usize| -> Result<Tensor> {
            p.forward(&h)?.reshape((batch, seq, n, hd))?.transpose(1, 2)
        };
        let (mut q, mut k) = (split(&b.q, s.heads)?, split(&b.k, s.kv_heads)?);
        if let Some((qn, kn)) = &b.qk_norm {
            q = rms_norm_slow(&q, qn, s.eps as f32)?;
            k = rms_norm_slow(&k, kn, s.eps as f32)?;
        }
        let q = self.rope.apply_sequence(&q.contiguous()?)?;
        let k = repeat_kv(self.rope.apply_sequence(&k.contiguous()?)?, s)?;
        let v = repeat_kv(split(&b.v, s.kv_heads)?, s)?;
        let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
        let probs = candle_nn::ops::softmax(&scores.broadcast_add(mask)?, D::Minus1)?;
        probs
            .matmul(&v.contiguous()?)?
            .transpose(1, 2)?
            .reshape((batch, seq, s.heads * hd))
    }
}

/// A projection of `x` (`[batch, seq, in]`): one GEMM over all rows for a dense weight (plus
/// its bias), candle's own for a quantized one.
fn project(p: &Proj, x: &Tensor) -> Result<Tensor> {
    match p.dense() {
        Some(l) => {
            let y = dense(x, l.weight())?;
            match l.bias() {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            }
        }
        None => p.forward(x),
    }
}

/// The unfused attention core over rotated token-major `q`, `k`, `v` (`[batch, seq, heads *
/// head_dim]`): for shapes the fused kernel does not cover.
fn unfused_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    s: &DecoderSpec,
) -> Result<Tensor> {
    let (batch, seq, _) = q.dims3()?;
    let hd = s.head_dim;
    let heads = |t: &Tensor, n: usize| {
        t.reshape((batch, seq, n, hd))?
            .transpose(1, 2)?
            .contiguous()
    };
    let q = heads(q, s.heads)?;
    let k = repeat_kv(heads(k, s.kv_heads)?, s)?;
    let v = repeat_kv(heads(v, s.kv_heads)?, s)?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
    let probs = candle_nn::ops::softmax(&scores.broadcast_add(mask)?, D::Minus1)?;
    probs
        .matmul(&v.contiguous()?)?
        .transpose(1, 2)?
        .reshape((batch, seq, s.heads * hd))
}

/// Repeats each key/value head of `x` (`[batch, kv_heads, seq, head_dim]`) for the query
/// heads it serves.
fn repeat_kv(x: Tensor, s: &DecoderSpec) -> Result<Tensor> {
    let n = s.heads / s.kv_heads;
    if n == 1 {
        return Ok(x);
    }
    let (b, kv, seq, hd) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n, seq, hd))?
        .reshape((b, kv * n, seq, hd))
}
