//! What the HTTP handlers share: the model's tokenizer, template and defaults, the engine's
//! handle and the metrics.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokenizers::Tokenizer;

use crate::metrics::Metrics;
use crate::model::{ChatTemplate, Defaults};
use crate::worker::Handle;

/// What the handlers share.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) name: String,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) template: Option<ChatTemplate>,
    pub(crate) defaults: Defaults,
    pub(crate) max_seq: usize,
    /// End tokens (a sequence that ends on one finishes with "stop").
    pub(crate) eos: Vec<u32>,
    pub(crate) handle: Handle,
    pub(crate) metrics: Arc<Metrics>,
    /// When the server started (seconds since the Unix epoch).
    pub(crate) created: u64,
    /// The next request's number.
    pub(crate) next_id: AtomicU64,
    /// Mixed into the seed of a request that sends none, so that such requests differ.
    pub(crate) seeds: u64,
}
