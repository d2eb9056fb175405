//! The port of candle-transformers' `models::mixtral`: the same `config.json` and checkpoints
//! (the `block_sparse_moe` names), a graph-ready [`Decoder`] whose blocks route each token to
//! its top experts on the device. candle's model reads the routing back to the host and runs
//! each expert on the tokens that chose it, which no graph can replay.

use candle_core::Result;
use candle_nn::{Activation, VarBuilder};

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, MoeNames, MoeSpec, RopeSpec, RopeStyle};

/// Mixtral's `config.json`, by the names candle-transformers' `mixtral::Config` reads (whose
/// fields are private to candle, so the port reads the file itself).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Each expert's MLP width.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub sliding_window: usize,
    pub num_experts_per_tok: usize,
    pub num_local_experts: usize,
}

/// The decoder `cfg` describes: every block's MLP is `num_local_experts` experts, each token
/// routed to `num_experts_per_tok` of them, their weights renormalized. The sliding window
/// applies at every step (candle's model applies it to prompts only; the two agree while a
/// sequence is shorter than the window).
pub fn spec(cfg: &Config) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Mixtral,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.hidden_size / cfg.num_attention_heads.max(1),
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
        sliding_window: Some(cfg.sliding_window),
        moe: Some(MoeSpec {
            experts: cfg.num_local_experts,
            top_k: cfg.num_experts_per_tok,
            intermediate: cfg.intermediate_size,
            normalize: true,
            every: 1,
            names: MoeNames::Mixtral,
            shared: None,
        }),
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers' `Model::new`
/// reads), in `vb`'s dtype.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    Decoder::load_hf(spec(cfg), &vb)
}
