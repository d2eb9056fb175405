//! What `graft-serve serve --model DIR_OR_GGUF` loads: a Hugging Face model directory
//! (`config.json`, `tokenizer.json`, safetensors weights, and optionally
//! `tokenizer_config.json` and `generation_config.json`) or a Llama GGUF file with a
//! `tokenizer.json` beside it, as one of graft-candle-models' ports with its tokenizer, chat
//! template, generation defaults and end tokens.
//!
//! The safetensors files are memory-mapped while the weights load: they must not be modified
//! (written, truncated) until [`load`] returns. That is the caller's contract; candle copies
//! every tensor out of the mapping, so nothing stays mapped afterwards.

mod arch;
mod error;
mod files;
mod gguf;
mod template;

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use graft_candle_models::Decoder;
use serde_json::Value;

pub use error::LoadError;
pub use template::{ChatTemplate, Message, TemplateError};

use arch::{Port, SUPPORTED};
use files::Ids;

/// Sampling defaults of the model's `generation_config.json` (each absent when it does not
/// say; `do_sample: false` gives temperature 0 and no top-p or top-k, as transformers
/// generates greedily then).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Defaults {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k`.
    pub top_k: Option<usize>,
    /// `max_new_tokens`.
    pub max_new_tokens: Option<usize>,
}

/// A model ready to serve.
#[derive(Debug)]
pub struct Loaded {
    /// The model's id for `/v1/models`: the directory's name, or the GGUF file's stem.
    pub name: String,
    /// The port's decoder, its weights on the device.
    pub decoder: Decoder,
    /// The model's tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// The chat template, if the model has one.
    pub template: Option<ChatTemplate>,
    /// Sampling defaults from `generation_config.json`.
    pub defaults: Defaults,
    /// The end tokens: `generation_config.json`'s `eos_token_id` (one or a list), else
    /// `config.json`'s, else `tokenizer_config.json`'s `eos_token` looked up in the tokenizer
    /// (a GGUF file: its `tokenizer.ggml.eos_token_id` first). Empty when nothing says.
    pub eos: Vec<u32>,
    /// The longest sequence: `max_position_embeddings` (a GGUF file: its `context_length`,
    /// capped at the positions the port's rotary tables cover).
    pub max_position: Option<usize>,
    /// The port picked: "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
    /// "qwen3_moe", or "quantized_llama" for a GGUF file.
    pub architecture: &'static str,
}

/// Loads the model at `path` (a Hugging Face model directory or a `.gguf` file) onto
/// `device`, its safetensors weights in `dtype` (a GGUF file keeps its quantized projections
/// and runs in f32: `dtype` does not apply). The safetensors files must not be modified
/// while this runs (they are memory-mapped).
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Loaded, LoadError> {
    let canonical = path.canonicalize().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => LoadError::Missing {
            path: path.to_path_buf(),
            what: "model (a directory or a .gguf file)",
        },
        _ => LoadError::Read {
            path: path.to_path_buf(),
            source,
        },
    })?;
    if canonical.is_dir() {
        let name = canonical.file_name().map_or_else(
            || canonical.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        return load_dir(path, name, dtype, device);
    }
    if canonical.extension().is_some_and(|e| e == "gguf") {
        let name = canonical
            .file_stem()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        return gguf::load(path, name, device);
    }
    Err(LoadError::NotAModel {
        path: path.to_path_buf(),
    })
}

/// [`load`] of a Hugging Face model directory.
fn load_dir(dir: &Path, name: String, dtype: DType, device: &Device) -> Result<Loaded, LoadError> {
    let config_path = dir.join("config.json");
    let config: Value = files::json(&config_path, "config.json (the model's architecture)")?;
    let port = Port::pick(&config).map_err(|found| LoadError::UnknownArchitecture {
        path: config_path.clone(),
        found,
        supported: SUPPORTED,
    })?;
    let config_eos = config
        .get("eos_token_id")
        .and_then(|v| serde_json::from_value::<Ids>(v.clone()).ok())
        .map(Ids::into_vec);
    let port_config = port.parse(config).map_err(|source| LoadError::Config {
        path: config_path,
        architecture: port.name(),
        source,
    })?;
    let tokenizer = files::tokenizer(&dir.join("tokenizer.json"))?;
    let tokenizer_config = files::tokenizer_config(dir)?;
    let template = match &tokenizer_config.chat_template {
        Some((source, from)) => Some(files::compile(
            source,
            from,
            tokenizer_config.bos_token.as_deref(),
            tokenizer_config.eos_token.as_deref(),
        )?),
        None => None,
    };
    let (defaults, generation_eos) = files::generation_config(dir)?;
    let eos = files::end_tokens(
        generation_eos,
        config_eos,
        tokenizer_config.eos_token.as_deref(),
        &tokenizer,
    );
    let weights = files::weight_files(dir)?;
    let failed = |source| LoadError::Weights {
        path: dir.to_path_buf(),
        architecture: port.name(),
        source,
    };
    // SAFETY: the files are not modified while mapped: the caller's contract, documented on
    // `load` and in this module's docs (the mapping lives only until the port has copied the
    // tensors out, before `load` returns).
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&weights, dtype, device) }.map_err(failed)?;
    let decoder = port_config.load(vb).map_err(failed)?;
    Ok(Loaded {
        name,
        max_position: Some(decoder.spec().rope.max_positions),
        decoder,
        tokenizer,
        template,
        defaults,
        eos,
        architecture: port.name(),
    })
}
