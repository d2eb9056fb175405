//! The port of candle-transformers' `models::qwen3_moe` (`ModelForCausalLM`): the same
//! `Config` and checkpoints, a graph-ready [`Decoder`] with Qwen3's per-head norms whose
//! expert blocks route each token to its top experts on the device. candle's model reads the
//! routing back to the host on the CPU (and, on CUDA, runs a fused kernel that takes f16 and
//! bf16 only); the port runs any float dtype on either, graphed.

use candle_core::Result;
use candle_nn::VarBuilder;
pub use candle_transformers::models::qwen3_moe::Config;

use super::decoder::Decoder;
use super::spec::{Arch, DecoderSpec, MoeNames, MoeSpec};

/// The decoder `cfg` describes: Qwen3's, with experts in every `decoder_sparse_step`-th block
/// (none with `num_experts` 0, as candle's model).
pub fn spec(cfg: &Config) -> DecoderSpec {
    DecoderSpec {
        arch: Arch::Qwen3Moe,
        moe: (cfg.num_experts > 0).then_some(MoeSpec {
            experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            intermediate: cfg.moe_intermediate_size,
            normalize: cfg.norm_topk_prob,
            every: cfg.decoder_sparse_step,
            names: MoeNames::Qwen,
            shared: None,
        }),
        ..super::qwen3::spec(&cfg.into())
    }
}

/// Loads the checkpoint `vb` holds (the tensor names candle-transformers'
/// `ModelForCausalLM::new` reads), in `vb`'s dtype. Like candle's model, refuses
/// `use_sliding_window`.
pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Decoder> {
    if cfg.use_sliding_window {
        candle_core::bail!(
            "qwen3_moe with use_sliding_window is not supported (nor by candle's model)"
        );
    }
    Decoder::load_hf(spec(cfg), &vb)
}
