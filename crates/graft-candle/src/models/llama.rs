//! The port of candle-transformers' `models::llama` (Llama 2 and 3, with Llama 3's rope
//! scaling): the same `Config` and checkpoints, a graph-ready [`Decoder`].

use candle_core::Result;
use candle_nn::{Activation, VarBuilder};
pub use candle_transformers::models::llama::{Config, Llama3RopeType, LlamaConfig};

use super::decoder::Decoder;
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
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers' `Llama::load`
/// reads), in `vb`'s dtype.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    Decoder::load_hf(spec(cfg), &vb)
}
