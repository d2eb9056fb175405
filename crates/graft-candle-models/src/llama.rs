//! The port of candle-transformers' `models::llama` (Llama 2 and 3, with Llama 3's rope
//! scaling): the same `Config` and checkpoints, a graph-ready [`Decoder`]; and Llamas of
//! given [`Sizes`] with random weights, built in code (tests, benchmarks, training).

use std::fmt;

use candle_core::{DType, Device, Result};
use candle_nn::{Activation, VarBuilder};
pub use candle_transformers::models::llama::{Config, Llama3RopeType, LlamaConfig};

use super::checkpoint;
use super::decoder::Decoder;
use super::shard::Shard;
use super::spec::{Arch, DecoderSpec, Llama3Scaling, RopeSpec, RopeStyle};

/// The decoder `cfg` describes (`use_flash_attn` is ignored: attention runs over the static
/// cache).
pub fn spec(cfg: &Config) -> DecoderSpec {
    let llama3 = cfg.rope_scaling.as_ref().and_then(|r| match r.rope_type {
        Llama3RopeType::Llama3 => Some(Llama3Scaling {
            factor: r.factor,
            low_freq_factor: r.low_freq_factor,
            high_freq_factor: r.high_freq_factor,
            original_max_positions: r.original_max_position_embeddings,
        }),
        Llama3RopeType::Default => None,
    });
    DecoderSpec {
        arch: Arch::Llama,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.hidden_size / cfg.num_attention_heads.max(1),
        eps: cfg.rms_norm_eps,
        act: Activation::Silu,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        tied_embeddings: cfg.tie_word_embeddings,
        rope: RopeSpec {
            theta: f64::from(cfg.rope_theta),
            f64_powers: false,
            llama3,
            style: RopeStyle::Half,
            max_positions: cfg.max_position_embeddings,
        },
        sliding_window: None,
        moe: None,
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers' `Llama::load`
/// reads), in `vb`'s dtype.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    Decoder::load_hf(spec(cfg), &vb)
}

/// Loads rank `shard`'s part of the checkpoint `vb` holds, for tensor parallelism (see
/// [`Shard`]): the attention heads and the MLP split over the ranks, the embedding, norms and
/// output head whole on every rank. Fails unless the world divides the query heads, the
/// key/value heads and the MLP width.
pub fn load_sharded(vb: VarBuilder, cfg: &Config, shard: Shard) -> Result<Decoder> {
    Decoder::load_hf_part(spec(cfg), &vb, Some(shard))
}

/// The sizes of a Llama built in code (Llama 2 style: no rope scaling; an output projection of
/// its own, or the embedding's with `tied`).
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Sizes {
    /// Transformer blocks.
    pub layers: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Query heads (`hidden` must be a multiple).
    pub heads: usize,
    /// Key/value heads (`heads` must be a multiple): grouped-query attention.
    pub kv_heads: usize,
    /// Hidden width of the gated MLP.
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Positions the rotary tables cover: the longest cache or training sequence.
    pub max_positions: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// The output head is the embedding's table (`tie_word_embeddings`).
    pub tied: bool,
}

impl Sizes {
    /// A small model for tests: 2 layers, d=64, 4 heads over 2 KV heads, ffn 128, vocab 256,
    /// 96 positions.
    pub const TINY: Sizes = Sizes {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        intermediate: 128,
        vocab: 256,
        max_positions: 96,
        rope_theta: 10_000.0,
        tied: false,
    };

    /// The benchmark model, comparable to graft-tensor's benchmark decoder: 4 layers, d=512,
    /// 8 heads over 4 KV heads, ffn 1536, vocab 8192, 512 positions.
    pub const BENCH: Sizes = Sizes {
        layers: 4,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        intermediate: 1536,
        vocab: 8192,
        max_positions: 512,
        rope_theta: 10_000.0,
        tied: false,
    };

    /// About 1.1B parameters (Llama-3.2-1B-like shapes, smaller vocabulary): 16 layers,
    /// d=2048, 32 heads over 8 KV heads, ffn 8192, vocab 32000, 512 positions.
    pub const ONE_B: Sizes = Sizes {
        layers: 16,
        hidden: 2048,
        heads: 32,
        kv_heads: 8,
        intermediate: 8192,
        vocab: 32_000,
        max_positions: 512,
        rope_theta: 500_000.0,
        tied: false,
    };

    /// Llama-3-8B's shapes (8.0B parameters): 32 layers, d=4096, 32 heads over 8 KV heads,
    /// ffn 14336, vocab 128256; 512 positions.
    pub const EIGHT_B: Sizes = Sizes {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        intermediate: 14_336,
        vocab: 128_256,
        max_positions: 512,
        rope_theta: 500_000.0,
        tied: false,
    };

    /// GPT-2 124M's sizes as Llama blocks, llm.c's training anchor (124 M parameters): 12
    /// layers, d=768, 12 heads over 12 KV heads, SwiGLU ffn 2048, vocab 50304 (50257 padded as
    /// llm.c does), the head tied to the embedding, 1,024 positions.
    pub const GPT2_124M: Sizes = Sizes {
        layers: 12,
        hidden: 768,
        heads: 12,
        kv_heads: 12,
        intermediate: 2048,
        vocab: 50_304,
        max_positions: 1024,
        rope_theta: 10_000.0,
        tied: true,
    };

    /// candle-transformers' config of these sizes (RMSNorm epsilon 1e-5).
    pub fn config(&self) -> Config {
        Config {
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            vocab_size: self.vocab,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            use_flash_attn: false,
            rms_norm_eps: 1e-5,
            rope_theta: self.rope_theta,
            bos_token_id: None,
            eos_token_id: None,
            rope_scaling: None,
            max_position_embeddings: self.max_positions,
            tie_word_embeddings: self.tied,
        }
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers, d={}, heads {}/{} (query/kv), ffn {}, vocab {}{}, ctx {}, {:.1} M parameters",
            self.layers,
            self.hidden,
            self.heads,
            self.kv_heads,
            self.intermediate,
            self.vocab,
            if self.tied { " (head tied)" } else { "" },
            self.max_positions,
            spec(&self.config()).parameters() as f64 / 1e6
        )
    }
}

/// A Llama of `sizes` with [`checkpoint::random_weights`] from `seed` (the same weights on
/// every device), in `dtype`, on `device`.
pub fn random(sizes: &Sizes, seed: u64, dtype: DType, device: &Device) -> Result<Decoder> {
    let cfg = sizes.config();
    let weights = checkpoint::random_weights(&spec(&cfg), seed, dtype, device)?;
    load(VarBuilder::from_tensors(weights, dtype, device), &cfg)
}

/// Rank `shard`'s part of [`random`]'s Llama of the same `sizes` and `seed`: exactly the
/// rows and columns of those weights that [`load_sharded`] takes.
pub fn random_sharded(
    sizes: &Sizes,
    seed: u64,
    dtype: DType,
    device: &Device,
    shard: Shard,
) -> Result<Decoder> {
    let cfg = sizes.config();
    let weights = checkpoint::random_weights(&spec(&cfg), seed, dtype, device)?;
    load_sharded(
        VarBuilder::from_tensors(weights, dtype, device),
        &cfg,
        shard,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_have_the_documented_parameters() {
        let one_b = spec(&Sizes::ONE_B.config()).parameters() as f64;
        assert!((1.0e9..1.2e9).contains(&one_b), "{one_b}");
        let eight_b = spec(&Sizes::EIGHT_B.config()).parameters() as f64;
        assert!((7.9e9..8.1e9).contains(&eight_b), "{eight_b}");
        assert_eq!(spec(&Sizes::BENCH.config()).head_dim, 64);
        let shown = Sizes::BENCH.to_string();
        assert!(shown.starts_with("4 layers, d=512"), "{shown}");
    }

    #[test]
    fn bad_sizes_and_batches_are_errors_not_panics() {
        let device = Device::Cpu;
        let odd = Sizes {
            kv_heads: 3,
            ..Sizes::TINY
        };
        let e = random(&odd, 1, DType::F32, &device)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of num_key_value_heads"), "{e}");
        let model = random(&Sizes::TINY, 1, DType::F32, &device).unwrap();
        let cache = model.new_cache(2, 16).unwrap();
        let three = candle_core::Tensor::new(&[1u32, 2, 3], &device).unwrap();
        assert!(model.greedy(&cache, &three).is_err());
    }
}
