//! What tests/model.rs writes and loads to compare with graft-serve's loading: each port's
//! small config (the port tests' sizes) and random checkpoint, the port loaded directly,
//! greedy decoding, a sharded checkpoint and a GGUF file with extra metadata.

use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use graft_candle_models::{
    Decoder, DecoderSpec, checkpoint, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe,
};
use graft_serve::random_model::{Preset, write_random_model};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The port tests' sizes: 2 layers, d=64, 4/2 heads, ffn 128, vocab 256.
const SIZES: &str = r#""vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "hidden_act": "silu""#;
const QWEN: &str = r#""sliding_window": 4096, "max_window_layers": 2, "rope_theta": 1000000.0,
    "use_sliding_window": false"#;

/// Each architecture's `config.json` (Mistral named by its `model_type` only, to check the
/// fallback).
pub(crate) fn configs() -> Vec<(&'static str, String)> {
    vec![
        (
            "llama",
            format!(
                r#"{{"architectures": ["LlamaForCausalLM"], {SIZES}, "rope_theta": 500000.0,
                "rope_scaling": {{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_type": "llama3"}},
                "eos_token_id": [7, 9]}}"#
            ),
        ),
        (
            "mistral",
            format!(
                r#"{{"model_type": "mistral", {SIZES}, "rope_theta": 10000.0,
                "sliding_window": 4096, "head_dim": 16}}"#
            ),
        ),
        (
            "qwen2",
            format!(
                r#"{{"architectures": ["Qwen2ForCausalLM"], {SIZES}, {QWEN},
                "tie_word_embeddings": false}}"#
            ),
        ),
        (
            "qwen3",
            format!(
                r#"{{"architectures": ["Qwen3ForCausalLM"], {SIZES}, {QWEN},
                "tie_word_embeddings": false, "head_dim": 32, "attention_bias": true}}"#
            ),
        ),
        (
            "mixtral",
            format!(
                r#"{{"architectures": ["MixtralForCausalLM"], {SIZES}, "rope_theta": 10000.0,
                "sliding_window": 4096, "num_experts_per_tok": 2, "num_local_experts": 4}}"#
            ),
        ),
        (
            "qwen2_moe",
            format!(
                r#"{{"architectures": ["Qwen2MoeForCausalLM"], {SIZES}, {QWEN},
                "tie_word_embeddings": false, "decoder_sparse_step": 1,
                "moe_intermediate_size": 40, "shared_expert_intermediate_size": 96,
                "num_experts_per_tok": 2, "num_experts": 5, "norm_topk_prob": true}}"#
            ),
        ),
        (
            "qwen3_moe",
            format!(
                r#"{{"architectures": ["Qwen3MoeForCausalLM"], {SIZES}, {QWEN},
                "tie_word_embeddings": false, "head_dim": 32, "attention_bias": false,
                "decoder_sparse_step": 2, "moe_intermediate_size": 48,
                "num_experts_per_tok": 3, "num_experts": 6, "norm_topk_prob": false}}"#
            ),
        ),
    ]
}

/// The checkpoint of port `name` with `config`.
pub(crate) fn spec(name: &str, config: &str) -> TestResult<DecoderSpec> {
    Ok(match name {
        "llama" => {
            llama::spec(&serde_json::from_str::<llama::LlamaConfig>(config)?.into_config(false))
        }
        "mistral" => mistral::spec(&serde_json::from_str(config)?),
        "qwen2" => qwen2::spec(&serde_json::from_str(config)?, false),
        "qwen3" => qwen3::spec(&serde_json::from_str(config)?),
        "mixtral" => mixtral::spec(&serde_json::from_str(config)?),
        "qwen2_moe" => qwen2_moe::spec(&serde_json::from_str(config)?),
        "qwen3_moe" => qwen3_moe::spec(&serde_json::from_str(config)?),
        _ => return Err(format!("no port {name}").into()),
    })
}

/// Port `name` loaded directly from `files`, as graft-candle-models' users load it.
pub(crate) fn direct(name: &str, config: &str, files: &[PathBuf]) -> TestResult<Decoder> {
    // SAFETY: the files are this test's own, written once and never modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(files, DType::F32, &Device::Cpu)? };
    Ok(match name {
        "llama" => llama::load(
            vb,
            &serde_json::from_str::<llama::LlamaConfig>(config)?.into_config(false),
        )?,
        "mistral" => mistral::load(vb, &serde_json::from_str(config)?)?,
        "qwen2" => qwen2::load(vb, &serde_json::from_str(config)?)?,
        "qwen3" => qwen3::load(vb, &serde_json::from_str(config)?)?,
        "mixtral" => mixtral::load(vb, &serde_json::from_str(config)?)?,
        "qwen2_moe" => qwen2_moe::load(vb, &serde_json::from_str(config)?)?,
        "qwen3_moe" => qwen3_moe::load(vb, &serde_json::from_str(config)?)?,
        _ => return Err(format!("no port {name}").into()),
    })
}

/// The prompt and `new` greedy tokens after it, one eager step at a time.
pub(crate) fn greedy(model: &Decoder, prompt: &[u32], new: usize) -> TestResult<Vec<u32>> {
    let cache = model.new_cache(1, prompt.len() + new)?;
    let mut next = 0;
    let mut out = Vec::new();
    for i in 0..prompt.len() + new - 1 {
        let token = prompt.get(i).copied().unwrap_or(next);
        next = model
            .greedy(&cache, &Tensor::new(&[token], &Device::Cpu)?)?
            .to_vec1()?[0];
        if i + 1 >= prompt.len() {
            out.push(next);
        }
    }
    Ok(out)
}

pub(crate) const PROMPT: [u32; 4] = [5, 36, 67, 98];

/// A tiny random model written to `parent`/tiny.
pub(crate) fn tiny(parent: &Path) -> TestResult<PathBuf> {
    let dir = parent.join("tiny");
    write_random_model(&dir, Preset::Tiny, DType::F32, 11)?;
    Ok(dir)
}

/// Splits `dir`'s model.safetensors into two files with an index.
pub(crate) fn shard(dir: &Path) -> TestResult {
    let single = dir.join("model.safetensors");
    let all = candle_core::safetensors::load(&single, &Device::Cpu)?;
    std::fs::remove_file(&single)?;
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (mut map, mut parts) = (serde_json::Map::new(), [Vec::new(), Vec::new()]);
    for (i, name) in names.iter().enumerate() {
        let part = usize::from(i >= names.len() / 2);
        let file = format!("model-{:05}-of-00002.safetensors", part + 1);
        map.insert((*name).clone(), file.into());
        parts[part].push(((*name).clone(), all[*name].clone()));
    }
    for (i, part) in parts.into_iter().enumerate() {
        let part: std::collections::HashMap<String, Tensor> = part.into_iter().collect();
        let file = dir.join(format!("model-{:05}-of-00002.safetensors", i + 1));
        checkpoint::write_safetensors(&part, &file)?;
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;
    Ok(())
}

/// Writes a Llama GGUF file (Q8_0, the port tests' sizes) to `path` with `extra` metadata.
pub(crate) fn gguf(path: &Path, extra: &[(&str, gguf_file::Value)]) -> TestResult {
    let cfg: llama::LlamaConfig = serde_json::from_str(&format!("{{{SIZES}}}"))?;
    let spec = llama::spec(&cfg.into_config(false));
    let weights = checkpoint::random_weights(&spec, 5, DType::F32, &Device::Cpu)?;
    let plain = path.with_extension("plain");
    checkpoint::write_gguf(&spec, &weights, GgmlDType::Q8_0, &plain)?;
    // Again, with `extra` in its metadata.
    let mut file = std::fs::File::open(&plain)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in content.tensor_infos.keys() {
        tensors.push((name.clone(), content.tensor(&mut file, name, &Device::Cpu)?));
    }
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.extend(extra.iter().map(|(k, v)| (*k, v)));
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
    let mut out = std::fs::File::create(path)?;
    gguf_file::write(&mut out, &metadata, &tensors)?;
    std::fs::remove_file(plain)?;
    Ok(())
}
