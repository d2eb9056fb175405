//! Whole sequences through a [`Decoder`] at once, causally masked, in differentiable candle ops
//! only (candle-nn's fused RMSNorm, rotary and softmax kernels have no backward): the forward
//! pass training runs on the same weights the decode step uses.

use candle_core::{D, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_nn::ops::rms_norm_slow;

use super::decoder::{Block, Decoder};
use super::proj::Proj;
use super::spec::DecoderSpec;

/// A dropout applied inside [`Decoder::sequence_logits`].
pub type Dropout<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

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
        if seq > s.rope.max_positions {
            candle_core::bail!(
                "a sequence of {seq} tokens is longer than the model's max_position_embeddings of {}",
                s.rope.max_positions
            );
        }
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
