//! The ports graft-serve loads from a Hugging Face directory, picked by `config.json`'s
//! `architectures[0]` (else its `model_type`), and their configs parsed from it.

use candle_nn::VarBuilder;
use graft_candle_models::{Decoder, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe};
use serde_json::Value;

/// A port of graft-candle-models that loads safetensors checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Port {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
}

/// Every port.
const PORTS: [Port; 7] = [
    Port::Llama,
    Port::Mistral,
    Port::Qwen2,
    Port::Qwen3,
    Port::Mixtral,
    Port::Qwen2Moe,
    Port::Qwen3Moe,
];

/// The architectures [`Port::pick`] knows, for error messages.
pub(super) const SUPPORTED: &str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (model_type llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe), or a Llama-architecture .gguf file";

impl Port {
    /// The port `config` names: by `architectures[0]`, else by `model_type`. Otherwise the
    /// name found (`architectures[0]`, else `model_type`, else "none").
    pub(super) fn pick(config: &Value) -> Result<Port, String> {
        let architecture = config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str);
        let model_type = config.get("model_type").and_then(Value::as_str);
        let by_arch = architecture.and_then(|a| PORTS.iter().find(|p| p.architecture() == a));
        let by_type = model_type.and_then(|t| PORTS.iter().find(|p| p.name() == t));
        match by_arch.or(by_type) {
            Some(port) => Ok(*port),
            None => Err(architecture.or(model_type).unwrap_or("none").to_string()),
        }
    }

    /// The port's name (its `model_type`).
    pub(super) fn name(self) -> &'static str {
        match self {
            Port::Llama => "llama",
            Port::Mistral => "mistral",
            Port::Qwen2 => "qwen2",
            Port::Qwen3 => "qwen3",
            Port::Mixtral => "mixtral",
            Port::Qwen2Moe => "qwen2_moe",
            Port::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The port's `architectures` name in `config.json`.
    fn architecture(self) -> &'static str {
        match self {
            Port::Llama => "LlamaForCausalLM",
            Port::Mistral => "MistralForCausalLM",
            Port::Qwen2 => "Qwen2ForCausalLM",
            Port::Qwen3 => "Qwen3ForCausalLM",
            Port::Mixtral => "MixtralForCausalLM",
            Port::Qwen2Moe => "Qwen2MoeForCausalLM",
            Port::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// `config` parsed as the port's config.
    pub(super) fn parse(self, config: Value) -> Result<PortConfig, serde_json::Error> {
        Ok(match self {
            Port::Llama => {
                let cfg: llama::LlamaConfig = serde_json::from_value(config)?;
                PortConfig::Llama(cfg.into_config(false))
            }
            Port::Mistral => PortConfig::Mistral(serde_json::from_value(config)?),
            Port::Qwen2 => PortConfig::Qwen2(serde_json::from_value(config)?),
            Port::Qwen3 => PortConfig::Qwen3(serde_json::from_value(config)?),
            Port::Mixtral => PortConfig::Mixtral(serde_json::from_value(config)?),
            Port::Qwen2Moe => PortConfig::Qwen2Moe(serde_json::from_value(config)?),
            Port::Qwen3Moe => PortConfig::Qwen3Moe(serde_json::from_value(config)?),
        })
    }
}

/// A port's config, parsed from `config.json`.
#[derive(Debug)]
pub(super) enum PortConfig {
    Llama(llama::Config),
    Mistral(mistral::Config),
    Qwen2(qwen2::Config),
    Qwen3(qwen3::Config),
    Mixtral(mixtral::Config),
    Qwen2Moe(qwen2_moe::Config),
    Qwen3Moe(qwen3_moe::Config),
}

impl PortConfig {
    /// The port's decoder over the checkpoint `vb` holds.
    pub(super) fn load(&self, vb: VarBuilder) -> candle_core::Result<Decoder> {
        match self {
            PortConfig::Llama(cfg) => llama::load(vb, cfg),
            PortConfig::Mistral(cfg) => mistral::load(vb, cfg),
            PortConfig::Qwen2(cfg) => qwen2::load(vb, cfg),
            PortConfig::Qwen3(cfg) => qwen3::load(vb, cfg),
            PortConfig::Mixtral(cfg) => mixtral::load(vb, cfg),
            PortConfig::Qwen2Moe(cfg) => qwen2_moe::load(vb, cfg),
            PortConfig::Qwen3Moe(cfg) => qwen3_moe::load(vb, cfg),
        }
    }
}
