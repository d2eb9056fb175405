//! The port of candle-transformers' `models::qwen3` (`ModelForCausalLM`): the same `Config`
//! and checkpoints, a graph-ready [`Decoder`] (with Qwen3's per-head query and key norms).

use candle_core::Result;
use candle_nn::VarBuilder;
pub use candle_transformers::models::qwen3::Config;

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, RopeSpec, RopeStyle};

/// The decoder `cfg` describes.
pub fn spec(cfg: &Config) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Qwen3,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        eps: cfg.rms_norm_eps,
        act: cfg.hidden_act,
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: true,
        tied_embeddings: cfg.tie_word_embeddings,
        rope: RopeSpec {
            theta: cfg.rope_theta,
            f64_powers: true,
            llama3: None,
            style: RopeStyle::Half,
            max_positions: cfg.max_position_embeddings,
        },
        sliding_window: None,
        moe: None,
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers'
/// `ModelForCausalLM::new` reads), in `vb`'s dtype. Like candle's model, refuses
/// `use_sliding_window`.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    if cfg.use_sliding_window {
        candle_core::bail!(
            "qwen3 with use_sliding_window is not supported (nor by candle's model)"
        );
    }
    Decoder::load_hf(spec(cfg), &vb)
}
