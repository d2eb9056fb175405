//! A Llama-style decoder in plain candle and candle-nn ops whose decode step can be captured.
//!
//! RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP, with random weights
//! from a seed (no downloads). What makes the step capturable is its state: the KV cache is
//! preallocated (`[batch, kv_heads, max_seq, head_dim]` per layer) and written in place with
//! `scatter_set` at a position that lives on the device, the attention mask is built on the
//! device from that position, and the step advances the position on the device. No host value
//! that changes from step to step reaches a kernel, so a recorded graph replays correctly.

use std::fmt;

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

use crate::rng::SplitMix64;

/// Sizes of the decoder.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Query heads (`d_model` must be a multiple).
    pub heads: usize,
    /// Key/value heads (`heads` must be a multiple): grouped-query attention.
    pub kv_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Positions of the KV cache: the steps a [`DecodeState`] can take before a reset.
    pub max_seq: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// Weight and activation dtype (softmax runs in f32 whatever it is).
    pub dtype: DType,
}

impl LlamaConfig {
    /// A small model for tests: 2 layers, d=64, 4 heads over 2 KV heads, ffn 128, vocab 256,
    /// 96 positions, f32.
    pub fn tiny() -> LlamaConfig {
        LlamaConfig {
            layers: 2,
            d_model: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            vocab: 256,
            max_seq: 96,
            eps: 1e-5,
            rope_theta: 10_000.0,
            dtype: DType::F32,
        }
    }

    /// The benchmark model, comparable to graft-tensor's benchmark decoder: 4 layers, d=512,
    /// 8 heads over 4 KV heads, ffn 1536, vocab 8192, 512 positions, f32.
    pub fn bench() -> LlamaConfig {
        LlamaConfig {
            layers: 4,
            d_model: 512,
            heads: 8,
            kv_heads: 4,
            ffn: 1536,
            vocab: 8192,
            max_seq: 512,
            eps: 1e-5,
            rope_theta: 10_000.0,
            dtype: DType::F32,
        }
    }

    /// About 1.1B parameters in bf16 (Llama-3.2-1B-like shapes, smaller vocabulary): 16
    /// layers, d=2048, 32 heads over 8 KV heads, ffn 8192, vocab 32000, 512 positions.
    pub fn one_b() -> LlamaConfig {
        LlamaConfig {
            layers: 16,
            d_model: 2048,
            heads: 32,
            kv_heads: 8,
            ffn: 8192,
            vocab: 32_000,
            max_seq: 512,
            eps: 1e-5,
            rope_theta: 500_000.0,
            dtype: DType::BF16,
        }
    }

    /// Columns per head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads.max(1)
    }

    /// The number of parameters.
    pub fn parameters(&self) -> usize {
        let (d, f, hd) = (self.d_model, self.ffn, self.head_dim());
        let attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2;
        let layer = 2 * d + attn + 3 * d * f;
        2 * self.vocab * d + d + self.layers * layer
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let sizes = [
            self.layers,
            self.d_model,
            self.heads,
            self.kv_heads,
            self.ffn,
            self.vocab,
            self.max_seq,
        ];
        if sizes.contains(&0) {
            candle_core::bail!("llama config {self:?}: every size must be at least 1");
        }
        if !self.d_model.is_multiple_of(self.heads)
            || !self.heads.is_multiple_of(self.kv_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            candle_core::bail!(
                "llama config {self:?}: d_model must be a multiple of heads, heads of kv_heads, and head_dim even"
            );
        }
        if u32::try_from(self.vocab).is_err() || u32::try_from(self.max_seq).is_err() {
            candle_core::bail!("llama config {self:?}: vocab and max_seq must fit in a u32");
        }
        Ok(())
    }
}

/// The rotary tables, `[max_seq, head_dim / 2]` each in `cfg.dtype`: row p holds the cosines
/// and sines of position p.
pub(crate) fn rope_tables(cfg: &LlamaConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let hd = cfg.head_dim();
    let half = hd / 2;
    let mut cos = Vec::with_capacity(cfg.max_seq * half);
    let mut sin = Vec::with_capacity(cfg.max_seq * half);
    for p in 0..cfg.max_seq {
        for i in 0..half {
            let inv_freq = 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32);
            let angle = p as f32 * inv_freq;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (cfg.max_seq, half), device)?.to_dtype(cfg.dtype)?;
    let sin = Tensor::from_vec(sin, (cfg.max_seq, half), device)?.to_dtype(cfg.dtype)?;
    Ok((cos, sin))
}

/// One transformer block's weights.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) attn_norm: Tensor,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    pub(crate) mlp_norm: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// The decoder's weights and rotary tables, on one candle device.
#[derive(Debug)]
pub struct Llama {
    pub(crate) cfg: LlamaConfig,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    /// `[max_seq, head_dim / 2]`, row p: the rotation at position p.
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
}

/// What a decode step reads and updates in place: the KV cache of every layer and the
/// position, all on the device, for one batch size. A graph recorded with a state replays
/// against that state only (its addresses are baked into the graph).
#[derive(Debug)]
pub struct DecodeState {
    batch: usize,
    /// Per layer, `[batch, kv_heads, max_seq, head_dim]`.
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// `[1]` u32: the position the next step writes.
    position: Tensor,
    /// `[max_seq]` u32: 0, 1, ..., for the mask.
    arange: Tensor,
    /// `[1]` u32: 1, to advance the position.
    one: Tensor,
}

impl DecodeState {
    /// The batch size (bucket) this state serves.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The tensors whose device addresses a recorded step depends on (the caches and the
    /// position), for graft-candle's signature keys.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = self.k.iter().chain(self.v.iter()).collect();
        all.push(&self.position);
        all
    }

    /// The position the next step writes, read to the host (synchronizes; not in a step).
    pub fn position(&self) -> Result<u32> {
        self.position
            .to_vec1::<u32>()?
            .first()
            .copied()
            .ok_or_else(|| candle_core::Error::Msg("the position tensor is empty".to_string()).bt())
    }

    /// Starts the sequence over at position 0 (an upload: call it between steps, never
    /// inside one). The cache is not cleared: positions not yet written are masked.
    pub fn reset(&self) -> Result<()> {
        let zero = Tensor::new(&[0u32], self.position.device())?;
        self.position.slice_set(&zero, 0, 0)
    }
}

impl Llama {
    /// A decoder with random weights from `seed` (the same weights on every device), in
    /// `cfg.dtype`.
    pub fn new(cfg: LlamaConfig, seed: u64, device: &Device) -> Result<Llama> {
        cfg.validate()?;
        let mut rng = SplitMix64::new(seed);
        let (d, hd, f) = (cfg.d_model, cfg.head_dim(), cfg.ffn);
        let mut matrix = |rows: usize, cols: usize| -> Result<Tensor> {
            let scale = 1.0 / (cols as f32).sqrt();
            let values = rng.uniform_vec(rows * cols, scale);
            Tensor::from_vec(values, (rows, cols), device)?.to_dtype(cfg.dtype)
        };
        let embed = matrix(cfg.vocab, d)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            blocks.push(Block {
                attn_norm: Tensor::ones(d, cfg.dtype, device)?,
                wq: Linear::new(matrix(cfg.heads * hd, d)?, None),
                wk: Linear::new(matrix(cfg.kv_heads * hd, d)?, None),
                wv: Linear::new(matrix(cfg.kv_heads * hd, d)?, None),
                wo: Linear::new(matrix(d, cfg.heads * hd)?, None),
                mlp_norm: Tensor::ones(d, cfg.dtype, device)?,
                gate: Linear::new(matrix(f, d)?, None),
                up: Linear::new(matrix(f, d)?, None),
                down: Linear::new(matrix(d, f)?, None),
            });
        }
        let norm = Tensor::ones(d, cfg.dtype, device)?;
        let lm_head = Linear::new(matrix(cfg.vocab, d)?, None);
        let (cos, sin) = rope_tables(&cfg, device)?;
        Ok(Llama {
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            cos,
            sin,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// The weights, for graft-candle's signature keys.
    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![
            &self.embed,
            &self.norm,
            self.lm_head.weight(),
            &self.cos,
            &self.sin,
        ];
        for b in &self.blocks {
            all.extend([&b.attn_norm, &b.mlp_norm]);
            for l in [&b.wq, &b.wk, &b.wv, &b.wo, &b.gate, &b.up, &b.down] {
                all.push(l.weight());
            }
        }
        all
    }

    /// A fresh state for `batch` rows at position 0 (zeroed caches).
    pub fn new_state(&self, batch: usize) -> Result<DecodeState> {
        if batch == 0 {
            candle_core::bail!("a decode state needs a batch of at least 1");
        }
        let cfg = &self.cfg;
        let device = self.device();
        let shape = (batch, cfg.kv_heads, cfg.max_seq, cfg.head_dim());
        let cache = || Tensor::zeros(shape, cfg.dtype, device);
        let mut k = Vec::with_capacity(cfg.layers);
        let mut v = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            k.push(cache()?);
            v.push(cache()?);
        }
        let max_seq = u32::try_from(cfg.max_seq)
            .map_err(|_| candle_core::Error::Msg("max_seq does not fit in a u32".to_string()))?;
        Ok(DecodeState {
            batch,
            k,
            v,
            position: Tensor::zeros(1, DType::U32, device)?,
            arange: Tensor::arange(0u32, max_seq, device)?,
            one: Tensor::ones(1, DType::U32, device)?,
        })
    }

    /// One decode step: `tokens` (`[batch]` u32, the token at the state's position for every
    /// row) in, the greedy next tokens (`[batch]` u32) out. Writes the keys and values at the
    /// position and advances it, all on the device. Capturable: no host reads, no host
    /// values that change between steps (the only uploads are the small constant layout
    /// arrays some candle kernels take, which candle's graph upload cache serves).
    pub fn step(&self, state: &DecodeState, tokens: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let batch = tokens.dims1()?;
        if batch != state.batch {
            candle_core::bail!(
                "the step got {batch} tokens for a decode state of batch {}; pad the tokens to the state's batch",
                state.batch
            );
        }
        let (hd, kv) = (cfg.head_dim(), cfg.kv_heads);
        let pos = &state.position;
        let cos = self.cos.index_select(pos, 0)?;
        let sin = self.sin.index_select(pos, 0)?;
        // 0 where a cache position is filled (<= pos), -1e9 where it is not.
        let mask = state
            .arange
            .broadcast_le(pos)?
            .to_dtype(DType::F32)?
            .affine(1e9, -1e9)?;
        let write_at = pos
            .reshape((1, 1, 1, 1))?
            .broadcast_as((batch, kv, 1, hd))?
            .contiguous()?;
        let mut x = self.embed.index_select(tokens, 0)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let (q, k, v) = b.qkv(&x, &cos, &sin, cfg)?;
            state.k[i].scatter_set(&write_at, &k, 2)?;
            state.v[i].scatter_set(&write_at, &v, 2)?;
            let o = attend(&q, &state.k[i], &state.v[i], &mask, cfg)?;
            x = b.finish(&x, &o, cfg)?;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, cfg.eps)?;
        let next = self.lm_head.forward(&x)?.argmax(D::Minus1)?;
        let advanced = pos.add(&state.one)?;
        pos.slice_set(&advanced, 0, 0)?;
        Ok(next)
    }
}

impl Block {
    /// The rotated query `[batch, heads, 1, hd]` and the rotated key and the value
    /// `[batch, kv, 1, hd]` of the block's input `x` `[batch, d]`, at the rotation `cos`/`sin`
    /// (`[1, hd / 2]`).
    pub(crate) fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cfg: &LlamaConfig,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let batch = x.dim(0)?;
        let (hd, heads, kv) = (cfg.head_dim(), cfg.heads, cfg.kv_heads);
        let h = candle_nn::ops::rms_norm(x, &self.attn_norm, cfg.eps)?;
        let q = self.wq.forward(&h)?.reshape((batch, heads, 1, hd))?;
        let k = self.wk.forward(&h)?.reshape((batch, kv, 1, hd))?;
        let v = self.wv.forward(&h)?.reshape((batch, kv, 1, hd))?;
        let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
        Ok((q, k, v))
    }

    /// The block's output from its input `x` and the attention result `o`: the attention
    /// projection and the SwiGLU MLP, each added to the residual stream.
    pub(crate) fn finish(&self, x: &Tensor, o: &Tensor, cfg: &LlamaConfig) -> Result<Tensor> {
        let x = (x + self.wo.forward(o)?)?;
        let h = candle_nn::ops::rms_norm(&x, &self.mlp_norm, cfg.eps)?;
        let mlp = (candle_nn::ops::silu(&self.gate.forward(&h)?)? * self.up.forward(&h)?)?;
        x + self.down.forward(&mlp)?
    }
}

impl fmt::Display for LlamaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers, d={}, heads {}/{} (query/kv), ffn {}, vocab {}, ctx {}, {:?}, {:.1} M parameters",
            self.layers,
            self.d_model,
            self.heads,
            self.kv_heads,
            self.ffn,
            self.vocab,
            self.max_seq,
            self.dtype,
            self.parameters() as f64 / 1e6
        )
    }
}

/// Grouped-query attention of one query position over a cache: `q` `[batch, heads, 1, hd]`,
/// caches `[batch, kv, len, hd]`, `mask` `[len]` f32 (added to the scores); returns
/// `[batch, heads * hd]`.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    cfg: &LlamaConfig,
) -> Result<Tensor> {
    let batch = q.dim(0)?;
    let (heads, kv, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim());
    let scale = 1.0 / (hd as f64).sqrt();
    // The query heads of one KV head side by side: one matmul per KV head, no repeated cache.
    let q = q.reshape((batch, kv, heads / kv, hd))?;
    let scores = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let scores = (scores * scale)?.broadcast_add(mask)?;
    let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(cfg.dtype)?;
    p.matmul(v)?.reshape((batch, heads * hd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_have_the_documented_sizes() {
        let one_b = LlamaConfig::one_b().parameters() as f64;
        assert!((1.0e9..1.2e9).contains(&one_b), "{one_b}");
        assert_eq!(LlamaConfig::bench().head_dim(), 64);
        let shown = LlamaConfig::bench().to_string();
        assert!(shown.starts_with("4 layers, d=512"), "{shown}");
    }

    #[test]
    fn bad_configs_and_batches_are_errors_not_panics() {
        let device = Device::Cpu;
        let odd = LlamaConfig {
            kv_heads: 3,
            ..LlamaConfig::tiny()
        };
        let e = Llama::new(odd, 1, &device).unwrap_err().to_string();
        assert!(e.contains("heads of kv_heads"), "{e}");
        let model = Llama::new(LlamaConfig::tiny(), 1, &device).unwrap();
        assert!(model.new_state(0).is_err());
        let state = model.new_state(2).unwrap();
        // The weights and the state's tensors are what a step's signature keys on.
        assert_eq!(model.weights().len(), 5 + 9 * LlamaConfig::tiny().layers);
        assert_eq!(state.tensors().len(), 2 * LlamaConfig::tiny().layers + 1);
        let three = Tensor::new(&[1u32, 2, 3], &device).unwrap();
        let e = model.step(&state, &three).unwrap_err().to_string();
        assert!(e.contains("pad the tokens"), "{e}");
    }
}
