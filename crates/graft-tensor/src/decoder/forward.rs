//! The decoder's forward pass: embed, blocks (with the tensor-parallel all-reduces), final
//! norm, logits, and the token pick (greedy or sampled) with the position increment.

use super::model::Decoder;
use super::weights::Weights;
use crate::backend::Backend;
use crate::error::Result;
use crate::ops;
use crate::sampling::Sampling;
use crate::tensor::{Alloc, Tensor};

impl<D: Backend> Decoder<D> {
    /// Tensor-parallel: sums a partial product over the ranks (nothing on one device).
    pub(super) fn all_reduce(&self, partial: &Tensor) -> Result<()> {
        match &self.shard {
            Some(comm) => comm.all_reduce_sum(partial),
            None => Ok(()),
        }
    }

    /// The step itself: embed, blocks, final norm, logits, greedy argmax, position + 1.
    pub(super) fn forward<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
    ) -> Result<Tensor> {
        let logits = self.logits(cx, tokens, pos, w, kv)?;
        ops::argmax_step(
            &self.kernels,
            cx,
            &logits,
            Some(&w.lm_b),
            pos,
            self.config.ctx as i32,
        )
    }

    /// The step, picking the next tokens as `sampling` says: greedy is [`Decoder::forward`]'s
    /// argmax (which leaves the generator `rng` as it is), otherwise a sampling step drawing
    /// from `rng` and advancing it. Position + 1 either way.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_sampled<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
        rng: &Tensor,
        sampling: Sampling,
    ) -> Result<Tensor> {
        if sampling.is_greedy() {
            return self.forward(cx, tokens, pos, w, kv);
        }
        let logits = self.logits(cx, tokens, pos, w, kv)?;
        let limit = self.config.ctx as i32;
        let k = &self.kernels;
        ops::sample_step(k, cx, &logits, Some(&w.lm_b), pos, rng, limit, sampling)
    }

    /// Embed, blocks, final norm and the LM head's product: the logits `[bucket, vocab]`
    /// (without the LM head's bias, which the token pick adds).
    pub(super) fn logits<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
    ) -> Result<Tensor> {
        let c = &self.config;
        let k = &self.kernels;
        let (_, heads) = self.local_dims();
        let first = w
            .layers
            .first()
            .map_or((&w.lnf_g, &w.lnf_b), |l| (&l.ln1_g, &l.ln1_b));
        let (mut x, mut h) = ops::embed_norm(
            k, cx, tokens, &w.tok_emb, &w.pos_emb, pos, first.0, first.1, c.eps,
        )?;
        // Biases ride in the kernel after each product (attention, the residual add + norm,
        // the argmax), so a product is one GEMM; only the MLP's GELU needs its own epilogue.
        for (i, (l, (k_cache, v_cache))) in w.layers.iter().zip(kv).enumerate() {
            let qkv = ops::linear(k, cx, &h, &l.wqkv, None, None, false)?;
            drop(h);
            let a = ops::attention_step(k, cx, &qkv, Some(&l.bqkv), k_cache, v_cache, pos, heads)?;
            drop(qkv);
            let o = ops::linear(k, cx, &a, &l.wo, None, None, false)?;
            drop(a);
            self.all_reduce(&o)?;
            let (x1, h2) = ops::add_norm(k, cx, &x, &o, Some(&l.bo), &l.ln2_g, &l.ln2_b, c.eps)?;
            drop(o);
            let g = ops::linear(k, cx, &h2, &l.w1, Some(&l.b1), None, true)?;
            drop(h2);
            let f = ops::linear(k, cx, &g, &l.w2, None, None, false)?;
            drop(g);
            self.all_reduce(&f)?;
            let (gamma, beta) = match w.layers.get(i + 1) {
                Some(n) => (&n.ln1_g, &n.ln1_b),
                None => (&w.lnf_g, &w.lnf_b),
            };
            (x, h) = ops::add_norm(k, cx, &x1, &f, Some(&l.b2), gamma, beta, c.eps)?;
        }
        drop(x);
        ops::linear(k, cx, &h, &w.lm_w, None, None, false)
    }
}
