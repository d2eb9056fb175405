//! A draft model: a smaller decoder over the target's vocabulary that proposes a sequence's
//! next tokens greedily from a cache of its own, kept in step with the sequence whatever the
//! verify passes accept.

use candle_core::{Result, Tensor};
use graft_candle_kernels::SampleParams;

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
    pub(super) model: &'m Decoder,
    pub(super) cache: KvCache,
    /// Per slot, the tokens whose keys and values its cache row holds, at positions 0, 1, ...
    pub(super) held: Vec<Vec<u32>>,
}

impl<'m> DraftModel<'m> {
    /// A drafter over `model` for `slots` sequences of up to `max_seq` tokens (a cache of
    /// `slots` rows), drafting for a target of `target_vocab` tokens.
    pub fn new(
        model: &'m Decoder,
        target_vocab: usize,
        slots: usize,
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
            .new_serving_cache(slots, max_seq)
            .map_err(|source| DraftError::Cache { max_seq, source })?;
        Ok(DraftModel {
            model,
            cache,
            held: vec![Vec::new(); slots],
        })
    }

    /// Up to `k` drafts after `history` (the sequence so far; its last token is the one the
    /// next verify pass starts from) from slot `slot`: the draft model's greedy continuation.
    /// Fewer when the draft's cache has no room for more; none for an empty history.
    pub fn propose(&mut self, slot: usize, history: &[u32], k: usize) -> Result<Vec<u32>> {
        let Some((&last, before)) = history.split_last() else {
            return Ok(Vec::new());
        };
        let max_seq = self.cache.max_seq();
        if k == 0 || before.len() >= max_seq {
            return Ok(Vec::new());
        }
        self.catch_up(slot, before)?;
        let held = &mut self.held[slot];
        let mut drafts = Vec::with_capacity(k);
        let mut token = last;
        while drafts.len() < k && held.len() < max_seq {
            // A verify pass without drafts: one greedy decode step of the slot's row.
            let v = self
                .model
                .verify_forward(&self.cache, slot, &[token], SampleParams::GREEDY)?;
            held.push(token);
            token = v.targets[0];
            drafts.push(token);
        }
        Ok(drafts)
    }

    /// Makes slot `slot`'s cache row hold the keys and values of `before` at positions 0, 1,
    /// ...: keeps the longest prefix of what it holds that `before` starts with and feeds it
    /// the rest in one prefill chunk; its position is then `before.len()`.
    pub(super) fn catch_up(&mut self, slot: usize, before: &[u32]) -> Result<()> {
        let Some(held) = self.held.get_mut(slot) else {
            candle_core::bail!(
                "draft slot {slot} of a draft model of {} slots: make it with more",
                self.held.len()
            );
        };
        // What the cache holds that is still the sequence's; the rest goes.
        let keep = held.iter().zip(before).take_while(|(a, b)| a == b).count();
        held.truncate(keep);
        self.cache.set_position(slot, keep as u32)?;
        if keep < before.len() {
            let rest = &before[keep..];
            let tokens = Tensor::new(rest, self.model.device())?;
            self.model.prefill_forward(
                &self.cache,
                slot,
                &tokens,
                rest.len(),
                SampleParams::GREEDY,
            )?;
            held.extend_from_slice(rest);
        }
        Ok(())
    }
}
