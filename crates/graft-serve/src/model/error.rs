//! Why a model could not be loaded: each message names the file and says what to do.

use std::path::PathBuf;

use super::template::TemplateError;

/// Why [`super::load`] failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file the model needs is not there.
    #[error(
        "no {what} at {}: check the path, and that the model's files are all there (a Hugging Face model directory has config.json, tokenizer.json and its *.safetensors weights)",
        path.display()
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
        /// What the file is and what it is for.
        what: &'static str,
    },
    /// The path is a file, but not a `.gguf` one.
    #[error(
        "{} is neither a directory nor a .gguf file: pass a Hugging Face model directory (config.json, tokenizer.json, *.safetensors) or a .gguf file",
        path.display()
    )]
    NotAModel {
        /// The path given.
        path: PathBuf,
    },
    /// A GGUF file has no `tokenizer.json` beside it.
    #[error(
        "no tokenizer.json at {} beside the gguf file: copy the model's tokenizer.json (from its Hugging Face repository) there; building a tokenizer from the gguf metadata is not supported",
        path.display()
    )]
    GgufTokenizer {
        /// Where `tokenizer.json` was looked for.
        path: PathBuf,
    },
    /// A file is there but could not be read.
    #[error("could not read {}: {source}; check its permissions", path.display())]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON, or its fields have the wrong types.
    #[error("{} is not the json expected: {source}; fix or replace the file", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// `config.json` names no architecture graft-serve serves.
    #[error(
        "{} describes a model of architecture {found:?}, which is not supported: graft-serve serves {supported}",
        path.display()
    )]
    UnknownArchitecture {
        /// The `config.json`.
        path: PathBuf,
        /// `architectures[0]`, else `model_type`, else "none".
        found: String,
        /// The architectures and model types supported.
        supported: &'static str,
    },
    /// `config.json` lacks a field the architecture's config needs, or has one of the wrong
    /// type.
    #[error(
        "{} is not a valid {architecture} config: {source}; compare it with the model's config.json on the Hugging Face hub",
        path.display()
    )]
    Config {
        /// The `config.json`.
        path: PathBuf,
        /// The port its architecture picked.
        architecture: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// The checkpoint could not be mapped or does not match the config (a missing tensor, a
    /// wrong shape), or the GGUF file could not be read.
    #[error(
        "loading the {architecture} weights from {} failed: {source}; check that the checkpoint is complete and matches its config",
        path.display()
    )]
    Weights {
        /// The model directory or GGUF file.
        path: PathBuf,
        /// The port.
        architecture: &'static str,
        /// candle's error.
        source: candle_core::Error,
    },
    /// `tokenizer.json` could not be loaded.
    #[error(
        "{} is not a tokenizer the tokenizers crate loads: {source}; replace it with the model's own tokenizer.json",
        path.display()
    )]
    Tokenizer {
        /// The `tokenizer.json`.
        path: PathBuf,
        /// The tokenizers crate's error.
        source: tokenizers::Error,
    },
    /// `tokenizer_config.json` lists named chat templates but none called "default".
    #[error(
        "{} lists chat templates {names:?} but none named \"default\": name one of them \"default\"",
        path.display()
    )]
    NoDefaultTemplate {
        /// The `tokenizer_config.json`.
        path: PathBuf,
        /// The names it lists.
        names: Vec<String>,
    },
    /// The chat template does not compile.
    #[error("the chat template from {}: {source}", path.display())]
    Template {
        /// Where the template came from.
        path: PathBuf,
        /// The template's error.
        source: TemplateError,
    },
}
