//! The files of a Hugging Face model directory beside the weights: reading them, and what
//! graft-serve takes from `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`; and which safetensors files hold the weights.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use tokenizers::Tokenizer;

use super::Defaults;
use super::error::LoadError;
use super::template::ChatTemplate;

/// The index of a sharded checkpoint.
pub(super) const INDEX: &str = "model.safetensors.index.json";

/// The contents of `path`, or [`LoadError::Missing`] (saying it is `what`) if there is none.
pub(super) fn read(path: &Path, what: &'static str) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => LoadError::Missing {
            path: path.to_path_buf(),
            what,
        },
        _ => LoadError::Read {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// `path` parsed as `T`.
pub(super) fn json<T: DeserializeOwned>(path: &Path, what: &'static str) -> Result<T, LoadError> {
    serde_json::from_str(&read(path, what)?).map_err(|source| LoadError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// [`json`] of an optional file: `None` when there is none.
pub(super) fn optional_json<T: DeserializeOwned>(
    path: &Path,
    what: &'static str,
) -> Result<Option<T>, LoadError> {
    if !path.exists() {
        return Ok(None);
    }
    json(path, what).map(Some)
}

/// The tokenizer of `path`.
pub(super) fn tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    if !path.exists() {
        return Err(LoadError::Missing {
            path: path.to_path_buf(),
            what: "tokenizer.json (the model's tokenizer)",
        });
    }
    Tokenizer::from_file(path).map_err(|source| LoadError::Tokenizer {
        path: path.to_path_buf(),
        source,
    })
}

/// An end token id or several (`eos_token_id` of `config.json` and
/// `generation_config.json`).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(untagged)]
pub(super) enum Ids {
    One(u32),
    Many(Vec<u32>),
}

impl Ids {
    pub(super) fn into_vec(self) -> Vec<u32> {
        match self {
            Ids::One(id) => vec![id],
            Ids::Many(ids) => ids,
        }
    }
}

/// A special token of `tokenizer_config.json`: its text, or an added token's object.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum TokenText {
    Plain(String),
    Added { content: String },
}

impl TokenText {
    fn into_string(self) -> String {
        match self {
            TokenText::Plain(s) | TokenText::Added { content: s } => s,
        }
    }
}

/// A named template of a `chat_template` list.
#[derive(Debug, serde::Deserialize)]
struct Named {
    name: String,
    template: String,
}

/// `chat_template`: one template, or a list of named ones.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<Named>),
}

/// The fields of `tokenizer_config.json` graft-serve reads.
#[derive(Debug, Default, serde::Deserialize)]
struct RawTokenizerConfig {
    chat_template: Option<TemplateField>,
    bos_token: Option<TokenText>,
    eos_token: Option<TokenText>,
}

/// What `tokenizer_config.json` says (all absent without one).
#[derive(Debug, Default)]
pub(super) struct TokenizerConfig {
    /// The chat template's source and the file it came from.
    pub(super) chat_template: Option<(String, PathBuf)>,
    pub(super) bos_token: Option<String>,
    pub(super) eos_token: Option<String>,
}

/// `dir`'s `tokenizer_config.json`, if any; its chat template, else `chat_template.jinja`'s
/// (where recent transformers saves it).
pub(super) fn tokenizer_config(dir: &Path) -> Result<TokenizerConfig, LoadError> {
    let path = dir.join("tokenizer_config.json");
    let raw: RawTokenizerConfig =
        optional_json(&path, "tokenizer_config.json")?.unwrap_or_default();
    let chat_template = match raw.chat_template {
        Some(TemplateField::One(t)) => Some((t, path)),
        Some(TemplateField::Named(named)) => {
            let names: Vec<String> = named.iter().map(|n| n.name.clone()).collect();
            match named.into_iter().find(|n| n.name == "default") {
                Some(n) => Some((n.template, path)),
                None => return Err(LoadError::NoDefaultTemplate { path, names }),
            }
        }
        None => {
            let jinja = dir.join("chat_template.jinja");
            if jinja.exists() {
                Some((read(&jinja, "chat_template.jinja")?, jinja))
            } else {
                None
            }
        }
    };
    Ok(TokenizerConfig {
        chat_template,
        bos_token: raw.bos_token.map(TokenText::into_string),
        eos_token: raw.eos_token.map(TokenText::into_string),
    })
}

/// The chat template `source`, compiled with `bos` and `eos`; `path` is where it came from.
pub(super) fn compile(
    source: &str,
    path: &Path,
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<ChatTemplate, LoadError> {
    ChatTemplate::new(source, bos, eos).map_err(|source| LoadError::Template {
        path: path.to_path_buf(),
        source,
    })
}

/// The fields of `generation_config.json` graft-serve reads.
#[derive(Debug, Default, serde::Deserialize)]
struct RawGenerationConfig {
    eos_token_id: Option<Ids>,
    do_sample: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    max_new_tokens: Option<usize>,
}

/// `dir`'s `generation_config.json` (everything absent without one): its defaults and end
/// tokens. `do_sample: false` means greedy (temperature 0), as transformers generates.
pub(super) fn generation_config(dir: &Path) -> Result<(Defaults, Option<Vec<u32>>), LoadError> {
    let raw: RawGenerationConfig = optional_json(
        &dir.join("generation_config.json"),
        "generation_config.json",
    )?
    .unwrap_or_default();
    let greedy = raw.do_sample == Some(false);
    let defaults = Defaults {
        temperature: if greedy { Some(0.0) } else { raw.temperature },
        top_p: raw.top_p.filter(|_| !greedy),
        top_k: raw.top_k.filter(|_| !greedy),
        max_new_tokens: raw.max_new_tokens,
    };
    Ok((defaults, raw.eos_token_id.map(Ids::into_vec)))
}

/// The end tokens: `generation`'s, else `config`'s, else the id of `eos_token` in `tokenizer`
/// (none if none of them says).
pub(super) fn end_tokens(
    generation: Option<Vec<u32>>,
    config: Option<Vec<u32>>,
    eos_token: Option<&str>,
    tokenizer: &Tokenizer,
) -> Vec<u32> {
    generation
        .or(config)
        .or_else(|| {
            eos_token
                .and_then(|t| tokenizer.token_to_id(t))
                .map(|id| vec![id])
        })
        .unwrap_or_default()
}

/// The index of a sharded checkpoint: which file holds each tensor.
#[derive(Debug, serde::Deserialize)]
struct Index {
    weight_map: std::collections::BTreeMap<String, String>,
}

/// The safetensors files of `dir`'s checkpoint: the files `model.safetensors.index.json`
/// names, else `model.safetensors`, else every `*.safetensors` in `dir` (sorted).
pub(super) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join(INDEX);
    if index.exists() {
        let index: Index = json(&index, INDEX)?;
        let files: BTreeSet<String> = index.weight_map.into_values().collect();
        let files: Vec<PathBuf> = files.into_iter().map(|f| dir.join(f)).collect();
        if let Some(absent) = files.iter().find(|f| !f.exists()) {
            return Err(LoadError::Missing {
                path: absent.clone(),
                what: "a weight file model.safetensors.index.json names",
            });
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|source| LoadError::Read {
                path: dir.to_path_buf(),
                source,
            })?
            .path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(LoadError::Missing {
            path: single,
            what: "model.safetensors (the weights; or model.safetensors.index.json with its shards, or any *.safetensors)",
        });
    }
    files.sort();
    Ok(files)
}
