//! graft-serve: an OpenAI-compatible HTTP server over graft-candle-models' continuous-batching
//! engine, pointed at a Hugging Face model directory or a GGUF file.
//!
//! [`model::load`] reads the directory (config.json picks the port; sharded safetensors, the
//! tokenizer, the chat template and generation_config.json's defaults); [`Server::start`]
//! starts the engine on a thread of its own with every bucket recorded, and
//! [`Server::serve`] answers `POST /v1/completions` and `POST /v1/chat/completions` (whole or
//! streamed as server-sent events), `GET /v1/models`, `/health` and `/metrics`. Each request
//! samples by its own temperature, top_k, top_p and seed on the device, inside the recorded
//! step, beside requests that sample differently.

mod api;
mod error;
mod flow;
mod http;
mod metrics;
pub mod model;
pub mod random_model;
mod server;
mod state;
mod text;
mod worker;

pub use error::{ApiError, ServeError};
pub use server::{ServeOptions, Server};
