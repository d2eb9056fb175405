//! Speculation in the engine: while a sequence runs alone (nothing else decoding or
//! prefilling), each step is a verify pass of its last token and up to `max_draft` drafts from
//! prompt lookup (or a draft model, [`Engine::draft_with`]) instead of a decode step, the draft count picked by an [`AdaptiveDraft`] per
//! sequence. A pass emits from 1 to k + 1 tokens, each as a decode step would have made it
//! (the request's sampling, each token at its own draw index), so a request's tokens are the
//! same with speculation on or off wherever the pass's logits agree with the decode step's.
//! With others beside it, or when it has no drafts (its chooser picks none, or prompt lookup
//! finds none), the sequence decodes as usual.

use candle_core::Tensor;

use super::{Engine, Event, Runner, Running, SampleParams, StepError, model};
use crate::speculate::{AdaptiveDraft, prompt_lookup};

/// Speculative decoding with prompt lookup or a draft model
/// ([`ServeConfig::speculate`](super::ServeConfig)).
#[derive(Clone, Debug, PartialEq)]
pub struct Speculate {
    /// The most drafts one pass verifies (the engine picks fewer as acceptance falls, and
    /// none when it falls too low).
    pub max_draft: usize,
    /// The longest n-gram prompt lookup matches.
    pub ngram: usize,
    /// What a pass of k drafts costs against a decode step, for k = 0..=max_draft (a pass of
    /// 0 drafts is taken as 1); missing entries repeat the last.
    pub pass_costs: Vec<f64>,
    /// The acceptance a sequence starts from (0 to 1).
    pub prior: f64,
}

impl Speculate {
    /// Up to `max_draft` drafts from 3-grams, a pass of k drafts costing 1 + 0.05 k decode
    /// steps (few rows cost little more than one on a GPU: the ~1B Llama's step at 8 rows was
    /// 1.17x one row on an H200), starting from an acceptance of 0.5.
    pub fn prompt_lookup(max_draft: usize) -> Self {
        Speculate {
            max_draft,
            ngram: 3,
            pass_costs: (0..=max_draft).map(|k| 1.0 + 0.05 * k as f64).collect(),
            prior: 0.5,
        }
    }

    /// Up to `max_draft` drafts from a draft model ([`Engine::draft_with`]),
    /// whose step costs `draft_cost` target decode steps: a pass of k drafts costs 1 + 0.05 k
    /// + k draft_cost, starting from an acceptance of 0.5.
    pub fn draft_model(max_draft: usize, draft_cost: f64) -> Self {
        Speculate {
            pass_costs: (0..=max_draft)
                .map(|k| 1.0 + (0.05 + draft_cost) * k as f64)
                .collect(),
            ..Speculate::prompt_lookup(max_draft)
        }
    }

    /// A new sequence's chooser of draft counts.
    fn chooser(&self) -> AdaptiveDraft {
        let last = self.pass_costs.last().copied().unwrap_or(1.0);
        let costs = (0..=self.max_draft)
            .map(|k| self.pass_costs.get(k).copied().unwrap_or(last))
            .collect();
        AdaptiveDraft::new(costs, self.prior, 0.8, 16)
    }
}

impl Running {
    /// Records token `token`, the sequence's next: its event, its count, its history.
    pub(super) fn made(&mut self, token: u32, events: &mut Vec<Event>) {
        events.push(Event::Token {
            id: self.id,
            token,
            index: self.generated,
        });
        self.generated += 1;
        self.last = token;
        self.history.push(token);
    }
}

impl Engine<'_> {
    /// One verify pass of the only running sequence (row 0): its last token and the drafts
    /// prompt lookup finds, as many as its chooser picks, the tokens left to make and the
    /// cache's room allow. Emits the pass's tokens up to the sequence's end.
    pub(super) fn speculate(&mut self, events: &mut Vec<Event>) -> Result<(), StepError> {
        let fail = |source| StepError::Decode { batch: 1, source };
        let Some(spec) = &self.config.speculate else {
            return Ok(());
        };
        let room = self.draft_room();
        let r = &mut self.running[0];
        let draft = r.draft.get_or_insert_with(|| spec.chooser());
        let k = draft
            .next_k()
            .min(r.max_new.saturating_sub(r.generated + 1))
            .min(room);
        let drafts = match (k, self.draft_model.as_mut()) {
            (0, _) => Vec::new(),
            (_, Some(d)) => d.propose(&r.history, k).map_err(|e| fail(model(e)))?,
            (_, None) => prompt_lookup(&r.history, spec.ngram, k),
        };
        if drafts.is_empty() {
            // Nothing to verify: the decode step (a pass of one row would run the prefill's
            // kernels, dearer than the step's, for the same token).
            draft.observe(0, 0);
            return self.decode(events);
        }
        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        tokens.push(r.last);
        tokens.extend(&drafts);
        let tokens =
            Tensor::new(tokens.as_slice(), self.model.device()).map_err(|e| fail(model(e)))?;
        let sampling = SampleParams {
            index: r.generated as u32,
            ..r.sampling
        };
        let pass = match &mut self.runner {
            Runner::Eager => self
                .model
                .verify_forward(&self.cache, 0, &tokens, sampling)
                .map_err(model),
            Runner::Graft { graft, verify, .. } => {
                graft.mark_step_begin();
                self.model
                    .verify(graft, *verify, &self.cache, 0, &tokens, sampling)
            }
        }
        .map_err(fail)?;
        draft.observe(drafts.len(), pass.accepted);
        self.accept_drafts(&drafts[..pass.accepted])
            .map_err(|e| fail(model(e)))?;
        let r = &mut self.running[0];
        for &token in pass.tokens() {
            r.made(token, events);
            if r.generated >= r.max_new || self.config.eos.contains(&token) {
                break;
            }
        }
        self.retire(events).map_err(|e| fail(model(e)))
    }
}
