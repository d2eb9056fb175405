//! A Llama-style causal language model whose parameters are candle `Var`s, in differentiable
//! candle ops only (candle-nn's fused RMSNorm, rotary and softmax kernels have no backward).

use candle_core::{D, DType, Device, Module, Result, Tensor, Var};
use candle_nn::{Embedding, Linear};

use crate::llama::{LlamaConfig, rope_tables};
use crate::rng::SplitMix64;

/// A dropout applied inside [`Llama::forward`].
pub type Dropout<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// One block's parameters.
#[derive(Debug)]
struct Block {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A trainable Llama-style model (RMSNorm, rotary embeddings, grouped-query causal attention,
/// SwiGLU), with random weights from a seed: the same weights on every device.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    vars: Vec<Var>,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    /// `[max_seq, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    /// `[max_seq, max_seq]`: 0 on and below the diagonal, -inf above.
    mask: Tensor,
}

impl Llama {
    /// A model with random weights from `seed`, in `cfg.dtype`, on `device`. `cfg.max_seq`
    /// is the longest sequence a step may train on.
    pub fn new(cfg: LlamaConfig, seed: u64, device: &Device) -> Result<Llama> {
        cfg.validate()?;
        let mut rng = SplitMix64::new(seed);
        let mut vars = Vec::new();
        let mut var = |t: Tensor| -> Result<Tensor> {
            let v = Var::from_tensor(&t.to_dtype(cfg.dtype)?)?;
            let t = v.as_tensor().clone();
            vars.push(v);
            Ok(t)
        };
        let (d, hd, f) = (cfg.d_model, cfg.head_dim(), cfg.ffn);
        let mut matrix = |rows: usize, cols: usize| -> Result<Tensor> {
            let scale = 1.0 / (cols as f32).sqrt();
            Tensor::from_vec(rng.uniform_vec(rows * cols, scale), (rows, cols), device)
        };
        let ones = || Tensor::ones(d, DType::F32, device);
        let embed = Embedding::new(var(matrix(cfg.vocab, d)?)?, d);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            blocks.push(Block {
                attn_norm: var(ones()?)?,
                wq: Linear::new(var(matrix(cfg.heads * hd, d)?)?, None),
                wk: Linear::new(var(matrix(cfg.kv_heads * hd, d)?)?, None),
                wv: Linear::new(var(matrix(cfg.kv_heads * hd, d)?)?, None),
                wo: Linear::new(var(matrix(d, cfg.heads * hd)?)?, None),
                mlp_norm: var(ones()?)?,
                gate: Linear::new(var(matrix(f, d)?)?, None),
                up: Linear::new(var(matrix(f, d)?)?, None),
                down: Linear::new(var(matrix(d, f)?)?, None),
            });
        }
        let norm = var(ones()?)?;
        let lm_head = Linear::new(var(matrix(cfg.vocab, d)?)?, None);
        let (cos, sin) = rope_tables(&cfg, device)?;
        let n = cfg.max_seq;
        let mask: Vec<f32> = (0..n * n)
            .map(|i| {
                if i % n > i / n {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, n), device)?.to_dtype(cfg.dtype)?;
        Ok(Llama {
            cfg,
            vars,
            embed,
            blocks,
            norm,
            lm_head,
            cos,
            sin,
            mask,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The parameters, in a fixed order (for an optimizer).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The constant tensors a step reads (rotary tables and mask), to pass as statics along
    /// with the optimizer's.
    pub fn constants(&self) -> [&Tensor; 3] {
        [&self.cos, &self.sin, &self.mask]
    }

    /// Logits `[batch, seq, vocab]` of `tokens` (`[batch, seq]` u32). `dropout`, when given,
    /// is applied to the output of every attention and MLP before the residual add (for
    /// example `|x| rng.dropout(x, 0.1)` with a [`crate::random::DeviceRng`]).
    pub fn forward(&self, tokens: &Tensor, dropout: Option<&Dropout<'_>>) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let cfg = &self.cfg;
        if s > cfg.max_seq {
            candle_core::bail!(
                "a sequence of {s} tokens is longer than the model's max_seq of {}",
                cfg.max_seq
            );
        }
        let (hd, heads, kv) = (cfg.head_dim(), cfg.heads, cfg.kv_heads);
        let cos = self.cos.narrow(0, 0, s)?;
        let sin = self.sin.narrow(0, 0, s)?;
        let mask = self.mask.narrow(0, 0, s)?.narrow(1, 0, s)?;
        let drop = |x: Tensor| match dropout {
            Some(f) => f(&x),
            None => Ok(x),
        };
        let mut x = self.embed.forward(tokens)?;
        for blk in &self.blocks {
            let h = rms_norm(&x, &blk.attn_norm, cfg.eps)?;
            let split = |l: &Linear, n: usize| -> Result<Tensor> {
                l.forward(&h)?.reshape((b, s, n, hd))?.transpose(1, 2)
            };
            let q = rope(&split(&blk.wq, heads)?, &cos, &sin)?;
            let k = repeat_kv(rope(&split(&blk.wk, kv)?, &cos, &sin)?, heads / kv)?;
            let v = repeat_kv(split(&blk.wv, kv)?, heads / kv)?;
            let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
            let probs = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
            let y = probs.matmul(&v.contiguous()?)?;
            let y = y.transpose(1, 2)?.reshape((b, s, heads * hd))?;
            x = (x + drop(blk.wo.forward(&y)?)?)?;
            let h = rms_norm(&x, &blk.mlp_norm, cfg.eps)?;
            let mlp = (blk.gate.forward(&h)?.silu()? * blk.up.forward(&h)?)?;
            x = (x + drop(blk.down.forward(&mlp)?)?)?;
        }
        self.lm_head.forward(&rms_norm(&x, &self.norm, cfg.eps)?)
    }

    /// The mean cross-entropy of predicting `targets` (`[batch, seq]` u32), as a `[1]` f32
    /// tensor.
    pub fn loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout<'_>>,
    ) -> Result<Tensor> {
        let logits = self.forward(tokens, dropout)?;
        let (b, s, vocab) = logits.dims3()?;
        let logits = logits.reshape((b * s, vocab))?.to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, &targets.reshape(b * s)?)?.reshape(1)
    }
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?;
    x.broadcast_div(&rms)?.broadcast_mul(weight)
}

/// Rotates the halves of `x` (`[batch, heads, seq, head_dim]`) by the position's angles.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x1.broadcast_mul(sin)? + x2.broadcast_mul(cos)?)?;
    Tensor::cat(&[a, b], D::Minus1)
}

/// Repeats each key/value head `n` times along the head axis.
fn repeat_kv(x: Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, kv, s, hd) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n, s, hd))?
        .reshape((b, kv * n, s, hd))
}
