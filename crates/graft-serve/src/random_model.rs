//! A complete Llama model directory with random weights, which `graft-serve serve --model`
//! loads like any Hugging Face model: for trying the server, and for machines with no
//! network. Its tokenizer is byte-level (every byte one token), so any text tokenizes and
//! decodes back exactly; what the model says is noise.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use graft_candle_models::{checkpoint, llama};
use serde_json::json;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The beginning-of-sequence token's id and text.
const BOS: (u32, &str) = (256, "<s>");
/// The end-of-sequence token's id and text.
const EOS: (u32, &str) = (257, "</s>");

/// The ChatML chat template (`<|im_start|>role\ncontent<|im_end|>\n` per message; its markers
/// are plain text to the byte-level tokenizer).
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The sizes of a random model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// 2 layers, d=64, 4/2 heads, ffn 128, vocab 258, 512 positions: loads in milliseconds.
    Tiny,
    /// 4 layers, d=512, 8/4 heads, ffn 1536, vocab 8192, 2048 positions (about 21M parameters:
    /// graft-candle-serve's `small` model).
    Small,
    /// About 1.1B parameters (Llama-3.2-1B-like): 16 layers, d=2048, 32/8 heads, ffn 8192,
    /// vocab 32000, 4096 positions; its weights in two files with an index.
    #[value(name = "1b")]
    OneB,
}

impl Preset {
    fn sizes(self) -> llama::Sizes {
        match self {
            Preset::Tiny => llama::Sizes {
                vocab: 258,
                max_positions: 512,
                ..llama::Sizes::TINY
            },
            Preset::Small => llama::Sizes {
                layers: 4,
                hidden: 512,
                heads: 8,
                kv_heads: 4,
                intermediate: 1536,
                vocab: 8192,
                max_positions: 2048,
                rope_theta: 500_000.0,
                tied: false,
            },
            Preset::OneB => llama::Sizes {
                max_positions: 4096,
                ..llama::Sizes::ONE_B
            },
        }
    }

    /// The safetensors files the weights are split into.
    fn shards(self) -> usize {
        match self {
            Preset::Tiny | Preset::Small => 1,
            Preset::OneB => 2,
        }
    }
}

/// Why [`write_random_model`] failed.
#[derive(Debug, thiserror::Error)]
pub enum RandomModelError {
    /// Weights in a dtype that is not a float one.
    #[error("random weights in {dtype:?} make no model: pass f32, bf16 or f16")]
    Dtype {
        /// The dtype asked for.
        dtype: DType,
    },
    /// A directory or file could not be written.
    #[error("could not write {}: {source}; check the path, the permissions and the free space", path.display())]
    Write {
        /// The directory or file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The random weights could not be made or written.
    #[error("could not make or write the random weights in {}: {source}; check the free memory and space", dir.display())]
    Weights {
        /// The model directory.
        dir: PathBuf,
        /// candle's error.
        source: candle_core::Error,
    },
    /// The tokenizer could not be built or saved.
    #[error("could not build or save the tokenizer {}: {source}; check the path and permissions", path.display())]
    Tokenizer {
        /// The `tokenizer.json`.
        path: PathBuf,
        /// The tokenizers crate's error.
        source: tokenizers::Error,
    },
}

/// Writes a Llama of `preset`'s sizes into `dir` (created if needed): `config.json`, random
/// weights from `seed` in `dtype` ([`checkpoint::random_weights`]; two shards and
/// `model.safetensors.index.json` for [`Preset::OneB`]), a byte-level `tokenizer.json` (ids
/// 0 to 255 the bytes, 256 `<s>`, 257 `</s>`, the rest `<unused{i}>` up to the vocabulary
/// size), `tokenizer_config.json` with a ChatML chat template, and `generation_config.json`
/// (end token 257).
pub fn write_random_model(
    dir: &Path,
    preset: Preset,
    dtype: DType,
    seed: u64,
) -> Result<(), RandomModelError> {
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => return Err(RandomModelError::Dtype { dtype }),
    };
    std::fs::create_dir_all(dir).map_err(|source| RandomModelError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let sizes = preset.sizes();
    let cfg = sizes.config();
    write_json(
        &dir.join("config.json"),
        &json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "bos_token_id": BOS.0,
            "eos_token_id": EOS.0,
            "torch_dtype": torch_dtype,
        }),
    )?;
    write_tokenizer(&dir.join("tokenizer.json"), sizes.vocab)?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": BOS.1,
            "eos_token": EOS.1,
            "chat_template": CHATML,
            "model_max_length": cfg.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({ "bos_token_id": BOS.0, "eos_token_id": EOS.0 }),
    )?;
    let failed = |source| RandomModelError::Weights {
        dir: dir.to_path_buf(),
        source,
    };
    let weights = checkpoint::random_weights(&llama::spec(&cfg), seed, dtype, &Device::Cpu)
        .map_err(failed)?;
    write_weights(dir, weights, preset.shards()).map_err(failed)
}

/// Writes `value` as pretty JSON to `path`.
fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), RandomModelError> {
    let failed = |source| RandomModelError::Write {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(path).map_err(failed)?;
    serde_json::to_writer_pretty(std::io::BufWriter::new(file), value).map_err(|e| failed(e.into()))
}

/// Writes `weights` to `dir`: as `model.safetensors` for one shard; else as
/// `model-0000i-of-0000n.safetensors` of about equal sizes, with
/// `model.safetensors.index.json`.
fn write_weights(
    dir: &Path,
    weights: HashMap<String, Tensor>,
    shards: usize,
) -> candle_core::Result<()> {
    if shards <= 1 {
        return checkpoint::write_safetensors(&weights, &dir.join("model.safetensors"));
    }
    let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    let total: usize = weights.values().map(bytes).sum();
    let mut sorted: Vec<(String, Tensor)> = weights.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut parts = vec![HashMap::new(); shards];
    let mut weight_map = serde_json::Map::new();
    let mut written = 0;
    for (name, t) in sorted {
        // The shard whose share of the bytes this tensor starts in.
        let shard = (written * shards / total.max(1)).min(shards - 1);
        written += bytes(&t);
        let file = format!("model-{:05}-of-{shards:05}.safetensors", shard + 1);
        weight_map.insert(name.clone(), json!(file));
        parts[shard].insert(name, t);
    }
    for (i, part) in parts.iter().enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        checkpoint::write_safetensors(part, &dir.join(file))?;
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let path = dir.join("model.safetensors.index.json");
    let json = serde_json::to_vec_pretty(&index).map_err(candle_core::Error::wrap)?;
    std::fs::write(path, json)?;
    Ok(())
}

/// GPT-2's byte-to-character map of byte-level BPE: printable bytes are themselves, the
/// others the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        chars[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// Writes a byte-level BPE tokenizer with no merges and `vocab` ids to `path`.
fn write_tokenizer(path: &Path, vocab: usize) -> Result<(), RandomModelError> {
    let failed = |source| RandomModelError::Tokenizer {
        path: path.to_path_buf(),
        source,
    };
    let mut tokens: Vocab = byte_chars()
        .iter()
        .zip(0u32..)
        .map(|(c, id)| (c.to_string(), id))
        .collect();
    tokens.insert(BOS.1.to_string(), BOS.0);
    tokens.insert(EOS.1.to_string(), EOS.0);
    // Ids past the bytes and the two special tokens decode to a name of their own; byte-level
    // BPE without merges never produces them from text.
    for (i, id) in (EOS.0 + 1..).take(vocab.saturating_sub(258)).enumerate() {
        tokens.insert(format!("<unused{i}>"), id);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(tokens, Vec::new())
        .build()
        .map_err(failed)?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    tokenizer
        .add_special_tokens([AddedToken::from(BOS.1, true), AddedToken::from(EOS.1, true)])
        .map_err(failed)?;
    tokenizer.save(path, true).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1b_tokenizer_names_every_id() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        write_tokenizer(&path, 32_000).unwrap();
        let t = Tokenizer::from_file(&path).unwrap();
        assert_eq!(t.get_vocab_size(true), 32_000);
        assert_eq!(t.decode(&[31_999], false).unwrap(), "<unused31741>");
        assert_eq!(t.encode("hi <unused3>", false).unwrap().get_ids().len(), 12);
        let one_b = llama::spec(&Preset::OneB.sizes().config()).parameters() as f64;
        assert!((1.0e9..1.2e9).contains(&one_b), "{one_b}");
    }

    #[test]
    fn sharded_weights_have_an_index_naming_every_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let spec = llama::spec(&Preset::Tiny.sizes().config());
        let weights = checkpoint::random_weights(&spec, 1, DType::F32, &Device::Cpu).unwrap();
        let names = weights.len();
        write_weights(dir.path(), weights, 2).unwrap();
        let index = std::fs::read_to_string(dir.path().join("model.safetensors.index.json"));
        let index: serde_json::Value = serde_json::from_str(&index.unwrap()).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), names);
        let mut loaded = 0;
        for i in 1..=2 {
            let file = dir
                .path()
                .join(format!("model-0000{i}-of-00002.safetensors"));
            let part = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
            assert!(!part.is_empty());
            assert!(part.keys().all(|k| {
                map[k]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("model-0000{i}"))
            }));
            loaded += part.len();
        }
        assert_eq!(loaded, names);
    }
}
