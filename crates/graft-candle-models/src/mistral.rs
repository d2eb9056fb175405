//! The port of candle-transformers' `models::mistral`: the same `Config` and checkpoints, a
//! graph-ready [`Decoder`].

use candle_core::Result;
use candle_nn::VarBuilder;
pub use candle_transformers::models::mistral::Config;

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, RopeSpec, RopeStyle};

/// The decoder `cfg` describes. The sliding window applies at every step (candle's model
/// applies it to prompts only; the two agree while a sequence is shorter than the window).
pub fn spec(cfg: &Config) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Mistral,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg
            .head_dim
            .unwrap_or(cfg.hidden_size / cfg.num_attention_heads.max(1)),
        eps: cfg.rms_norm_eps,
        act: cfg.hidden_act,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        tied_embeddings: false,
        rope: RopeSpec {
            theta: cfg.rope_theta,
            f64_powers: false,
            llama3: None,
            style: RopeStyle::Half,
            max_positions: cfg.max_position_embeddings,
        },
        sliding_window: cfg.sliding_window,
        moe: None,
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers' `Model::new`
/// reads), in `vb`'s dtype.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    Decoder::load_hf(spec(cfg), &vb)
}
