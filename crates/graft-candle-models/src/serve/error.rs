//! Why the serving engine refused a request or failed a step.

use graft_candle::Error;

/// Why [`crate::serve::Engine::submit`] refused a request. The request comes back in the
/// error, so nothing is lost; every other request is unaffected.
#[derive(Debug, thiserror::Error)]
pub enum Rejected {
    /// The prompt has no tokens.
    #[error("request {id} has an empty prompt: send at least one token")]
    EmptyPrompt { id: u64 },
    /// The request asks for no tokens.
    #[error("request {id} asks for 0 new tokens: ask for at least one")]
    NothingToGenerate { id: u64 },
    /// The sampling parameters are not numbers the sampler takes.
    #[error(
        "request {id} samples with temperature {temperature} and top_p {top_p}: use a finite temperature (0 or less is greedy) and a top_p that is a number"
    )]
    BadSampling {
        id: u64,
        temperature: f32,
        top_p: f32,
    },
    /// Prompt and output together need more positions than a sequence of the kv cache has.
    #[error(
        "request {id} needs {needed} positions ({prompt} prompt + {max_new} new tokens) but a sequence of the kv cache holds {max_seq}: shorten it, or plan the cache with a larger max_seq"
    )]
    TooLong {
        id: u64,
        prompt: usize,
        max_new: usize,
        needed: usize,
        max_seq: usize,
    },
    /// Prompt and output together need more blocks than a paged kv cache has.
    #[error(
        "request {id} needs {needed} blocks of {block_size} positions but the paged kv cache has {blocks}: shorten it, or plan the cache with more blocks"
    )]
    MoreThanTheCache {
        id: u64,
        needed: usize,
        blocks: usize,
        block_size: usize,
    },
}

/// A refused request, given back with the reason.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Refused {
    /// Why.
    #[source]
    pub why: Rejected,
    /// The request, unchanged.
    pub request: crate::serve::Request,
}

/// Why a step of the engine failed. The engine's state is unchanged by a failed step's
/// bookkeeping: requests stay where they were.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A prefill chunk failed.
    #[error("the prefill of request {id} failed: {source}")]
    Prefill {
        id: u64,
        #[source]
        source: Error,
    },
    /// Freeing the cache row of cancelled request `id` (a device copy) failed.
    #[error("freeing the cache row of cancelled request {id} failed: {source}")]
    Cancel {
        id: u64,
        #[source]
        source: Error,
    },
    /// A decode step of `batch` sequences failed.
    #[error("a decode step of {batch} sequences failed: {source}")]
    Decode {
        batch: usize,
        #[source]
        source: Error,
    },
}
