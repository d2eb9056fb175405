//! The port of candle-transformers' `models::qwen2_moe`: the same `Config` and checkpoints, a
//! graph-ready [`Decoder`] whose expert blocks route each token on the device and run the
//! shared expert on a side stream beside the routed ones (one recording holds the fork and
//! the join). candle's model reads the routing back to the host.

use candle_core::Result;
use candle_nn::VarBuilder;
pub use candle_transformers::models::qwen2_moe::Config;

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, MoeNames, MoeSpec, RopeSpec, RopeStyle};

/// The decoder `cfg` describes: Qwen2's attention (query, key and value biases), experts in
/// every `decoder_sparse_step`-th block (none with `num_experts` 0) with the shared expert,
/// the gated MLP of `intermediate_size` in the others.
pub fn spec(cfg: &Config) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Qwen2Moe,
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
        // candle's model always loads `lm_head.weight`.
        tied_embeddings: false,
        rope: RopeSpec {
            theta: cfg.rope_theta,
            f64_powers: true,
            llama3: None,
            style: RopeStyle::Half,
            max_positions: cfg.max_position_embeddings,
        },
        sliding_window: cfg.use_sliding_window.then_some(cfg.sliding_window),
        moe: (cfg.num_experts > 0).then_some(MoeSpec {
            experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            intermediate: cfg.moe_intermediate_size,
            normalize: cfg.norm_topk_prob,
            every: cfg.decoder_sparse_step,
            names: MoeNames::Qwen,
            shared: Some(cfg.shared_expert_intermediate_size),
        }),
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers' `Model::new`
/// reads), in `vb`'s dtype.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    Decoder::load_hf(spec(cfg), &vb)
}
