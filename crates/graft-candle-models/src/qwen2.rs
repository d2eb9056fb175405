//! The port of candle-transformers' `models::qwen2` (`ModelForCausalLM`): the same `Config`
//! and checkpoints, a graph-ready [`Decoder`].

use candle_core::Result;
use candle_nn::VarBuilder;
pub use candle_transformers::models::qwen2::Config;

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, RopeSpec, RopeStyle};

/// The decoder `cfg` describes; `tied`: the checkpoint has no `lm_head.weight`, so the
/// embedding is the output projection (how candle's `ModelForCausalLM` decides).
pub fn spec(cfg: &Config, tied: bool) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Qwen2,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.hidden_size / cfg.num_attention_heads.max(1),
        eps: cfg.rms_norm_eps,
        act: cfg.hidden_act,
        qkv_bias: true,
        o_bias: false,
        qk_norm: false,
        tied_embeddings: tied,
        rope: RopeSpec {
            theta: cfg.rope_theta,
            f64_powers: true,
            llama3: None,
            style: RopeStyle::Half,
            max_positions: cfg.max_position_embeddings,
        },
        sliding_window: cfg.use_sliding_window.then_some(cfg.sliding_window),
        moe: None,
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers'
/// `ModelForCausalLM::new` reads), in `vb`'s dtype. The rotary tables are computed in f32
/// and then converted (candle's model computes them in the model's dtype, which rounds the
/// positions in bf16).
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    let tied = !vb.contains_tensor("lm_head.weight");
    Decoder::load_hf(spec(cfg, tied), &vb)
}
