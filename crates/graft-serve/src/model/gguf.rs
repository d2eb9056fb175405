//! A Llama GGUF file as the quantized Llama port, with the `tokenizer.json` beside it; the
//! chat template and end token from the file's metadata, else from the
//! `tokenizer_config.json` and `generation_config.json` beside it.

use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file;
use graft_candle_models::quantized_llama;

use super::error::LoadError;
use super::{Loaded, files};

/// The port's name in [`Loaded::architecture`].
const ARCHITECTURE: &str = "quantized_llama";

/// [`super::load`] of the GGUF file `path`, whose model is called `name`.
pub(super) fn load(path: &Path, name: String, device: &Device) -> Result<Loaded, LoadError> {
    let dir = parent(path);
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.exists() {
        return Err(LoadError::GgufTokenizer {
            path: tokenizer_path,
        });
    }
    let tokenizer = files::tokenizer(&tokenizer_path)?;
    let failed = |source| LoadError::Weights {
        path: path.to_path_buf(),
        architecture: ARCHITECTURE,
        source,
    };
    let mut file = std::fs::File::open(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let content = gguf_file::Content::read(&mut file).map_err(failed)?;
    let number = |key: &str| {
        let value = content.metadata.get(key)?.to_u64().ok()?;
        u32::try_from(value).ok()
    };
    let tokenizer_config = files::tokenizer_config(&dir)?;
    let token = |key: &str| number(key).and_then(|id| tokenizer.id_to_token(id));
    let bos = token("tokenizer.ggml.bos_token_id").or(tokenizer_config.bos_token);
    let eos_text = token("tokenizer.ggml.eos_token_id").or(tokenizer_config.eos_token);
    let embedded = content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .map(|t| (t.clone(), path.to_path_buf()));
    let template = match embedded.or(tokenizer_config.chat_template) {
        Some((source, from)) => Some(files::compile(
            &source,
            &from,
            bos.as_deref(),
            eos_text.as_deref(),
        )?),
        None => None,
    };
    let (defaults, generation_eos) = files::generation_config(&dir)?;
    let eos = match number("tokenizer.ggml.eos_token_id") {
        Some(id) => vec![id],
        None => files::end_tokens(generation_eos, None, eos_text.as_deref(), &tokenizer),
    };
    let context = number("llama.context_length");
    let decoder = quantized_llama::load(&content, &mut file, device).map_err(failed)?;
    let covered = decoder.spec().rope.max_positions;
    Ok(Loaded {
        name,
        max_position: context.map(|c| (c as usize).min(covered)),
        decoder,
        tokenizer,
        template,
        defaults,
        eos,
        architecture: ARCHITECTURE,
    })
}

/// The directory a file is in (`.` for a bare file name).
fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
