//! A draft model: a smaller decoder over the target's vocabulary that proposes a sequence's
//! next tokens greedily from a cache of its own, kept in step with the sequence whatever the
//! verify passes accept.

use candle_core::{Result, Tensor};
use graft_candle_kernels::{SampleParams, argmax_last};

use crate::cache::KvCache;
use crate::decoder::Decoder;

/// Why [`DraftModel::new`] refused a model.
#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    /// The draft's tokens would not mean the target's.
    #[error(
        "the draft model has a vocabulary of {draft} tokens and the target {target}: draft with a model of the target's tokenizer"
    )]
    Vocab { draft: usize, target: usize },
    /// The draft's cache could not be made.
    #[error("the draft model's cache of {max_seq} positions could not be made: {source}")]
    Cache {
        max_seq: usize,
        source: candle_core::Error,
    },
}

/// Greedy drafts from a smaller model ([`DraftModel::propose`]), to verify with
/// [`Decoder::verify`] or [`Decoder::verify_forward`]. The draft keeps one cache row and the
/// tokens whose keys and values it holds; before each proposal it keeps the longest prefix of
/// those that the sequence still starts with (what the last pass accepted), sets its position
/// back to it (the rest is masked and overwritten, as the target's rejected drafts are) and
/// feeds it the sequence's tokens after that in one prefill chunk. So a proposal never
/// depends on what the caller did between two of them: it may verify fewer drafts than were
/// proposed, skip a pass, or draft a different sequence.
///
/// Drafts are a guess, verified by the target's rule: greedy and sampled output stays the
/// target's whatever the draft proposes (the draft's greedy pick is its single token, see the
/// module's documentation).
#[derive(Debug)]
pub struct DraftModel<'m> {
    model: &'m Decoder,
    cache: KvCache,
    /// The tokens whose keys and values the cache's row holds, at positions 0, 1, ...
    held: Vec<u32>,
}

impl<'m> DraftModel<'m> {
    /// A drafter over `model` for sequences of up to `max_seq` tokens (a cache of one row),
    /// drafting for a target of `target_vocab` tokens.
    pub fn new(
        model: &'m Decoder,
        target_vocab: usize,
        max_seq: usize,
    ) -> std::result::Result<Self, DraftError> {
        let draft = model.spec().vocab;
        if draft != target_vocab {
            return Err(DraftError::Vocab {
                draft,
                target: target_vocab,
            });
        }
        let cache = model
            .new_serving_cache(1, max_seq)
            .map_err(|source| DraftError::Cache { max_seq, source })?;
        Ok(DraftModel {
            model,
            cache,
            held: Vec::new(),
        })
    }

    /// Up to `k` drafts after `history` (the sequence so far; its last token is the one the
    /// next verify pass starts from): the draft model's greedy continuation. Fewer when the
    /// draft's cache has no room for more; none for an empty history.
    pub fn propose(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
        let Some((&last, before)) = history.split_last() else {
            return Ok(Vec::new());
        };
        let max_seq = self.cache.max_seq();
        if k == 0 || before.len() >= max_seq {
            return Ok(Vec::new());
        }
        // What the cache holds that is still the sequence's; the rest goes.
        let keep = self
            .held
            .iter()
            .zip(before)
            .take_while(|(a, b)| a == b)
            .count();
        self.held.truncate(keep);
        self.cache.set_position(0, keep as u32)?;
        let device = self.model.device();
        if keep < before.len() {
            let rest = &before[keep..];
            let tokens = Tensor::new(rest, device)?;
            self.model.prefill_forward(
                &self.cache,
                0,
                &tokens,
                rest.len(),
                SampleParams::GREEDY,
            )?;
            self.held.extend_from_slice(rest);
        }
        let mut drafts = Vec::with_capacity(k);
        let mut token = last;
        while drafts.len() < k && self.held.len() < max_seq {
            let logits = self
                .model
                .forward(&self.cache, &Tensor::new(&[token], device)?)?;
            self.held.push(token);
            token = argmax_last(&logits)?.to_vec1::<u32>()?[0];
            drafts.push(token);
        }
        Ok(drafts)
    }
}
