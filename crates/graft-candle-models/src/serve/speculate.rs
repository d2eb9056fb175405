//! Speculation in the engine: each step of the running sequences is one verify pass of their
//! last tokens and up to `max_draft` drafts each from prompt lookup (or a draft model,
//! [`Engine::draft_with`]) instead of a decode step, each sequence's draft count picked by its
//! own [`AdaptiveDraft`]. A pass emits from 1 to k + 1 tokens a sequence, each as a decode
//! step would have made it (the request's sampling, each token at its own draw index), so a
//! request's tokens are the same with speculation on or off wherever the pass's logits agree
//! with the decode step's. A sequence without drafts (its chooser picks none, or its drafter
//! finds none) takes one token in the pass; when no sequence has drafts the step is a decode
//! step.

use super::{Engine, Event, Runner, Running, SampleParams, StepError, model};
use crate::speculate::{AdaptiveDraft, DraftModel, DraftRow, VerifyRow, prompt_lookup};

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
    /// One verify pass of every running sequence: each one's last token and the drafts its
    /// drafter finds, as many as its chooser picks, the tokens left to make and the cache's
    /// room allow (none: the pass is a decode step for it). The pass is as wide as the most
    /// drafts (under graft its sequences padded to a decode bucket); without drafts anywhere
    /// it is a decode step. Emits each sequence's tokens up to its end.
    pub(super) fn speculate(&mut self, events: &mut Vec<Event>) -> Result<(), StepError> {
        let n = self.running.len();
        let fail = |source| StepError::Decode { batch: n, source };
        let Some(spec) = &self.config.speculate else {
            return self.decode(events);
        };
        // Each sequence's draft count.
        let mut ks = Vec::with_capacity(n);
        for row in 0..n {
            let room = self.draft_room(row);
            let r = &mut self.running[row];
            let chooser = r.draft.get_or_insert_with(|| spec.chooser());
            ks.push(
                chooser
                    .next_k()
                    .min(r.max_new.saturating_sub(r.generated + 1))
                    .min(room),
            );
        }
        let rounds = self
            .draft_model
            .as_ref()
            .is_some_and(DraftModel::runs_rounds);
        if rounds {
            // A round's draft steps run as wide for every sequence as for the widest: each
            // sequence's draft row must hold them, so no sequence drafts past the room of the
            // fullest.
            let (max_seq, positions) = (self.cache.max_seq(), self.cache.positions());
            let fit = positions[..n]
                .iter()
                .map(|&p| max_seq.saturating_sub(p as usize + 1))
                .min()
                .unwrap_or(0);
            ks.iter_mut().for_each(|k| *k = (*k).min(fit));
        }
        // The drafts, where the host makes them (prompt lookup, or a draft model that cannot
        // run rounds).
        let mut drafts: Vec<Vec<u32>> = Vec::with_capacity(n);
        if !rounds {
            for (row, &k) in ks.iter().enumerate() {
                let r = &self.running[row];
                drafts.push(match (k, self.draft_model.as_mut()) {
                    (0, _) => Vec::new(),
                    (_, Some(m)) => m.propose(row, &r.history, k).map_err(|e| fail(model(e)))?,
                    (_, None) => prompt_lookup(&r.history, spec.ngram, k),
                });
            }
            ks = drafts.iter().map(Vec::len).collect();
        }
        let width = 1 + ks.iter().copied().max().unwrap_or(0);
        if width == 1 {
            // Nothing to verify: the decode step (a pass of one token a row runs the
            // prefill's kernels, dearer than the step's, for the same tokens).
            for r in &mut self.running {
                if let Some(chooser) = &mut r.draft {
                    chooser.observe(0, 0);
                }
            }
            return self.decode(events);
        }
        let sampling = |r: &Running| SampleParams {
            index: r.generated as u32,
            ..r.sampling
        };
        let segments = match &self.runner {
            Runner::Eager => n,
            Runner::Graft { .. } => self.config.decode_buckets.pick(n).size().max(n),
        };
        let passes = match (&mut self.runner, self.draft_model.as_mut()) {
            (runner, Some(draft)) if rounds => {
                let rows: Vec<DraftRow<'_>> = self
                    .running
                    .iter()
                    .zip(&ks)
                    .enumerate()
                    .map(|(row, (r, &drafts))| DraftRow {
                        row,
                        history: &r.history,
                        drafts,
                        sampling: sampling(r),
                    })
                    .collect();
                match runner {
                    Runner::Eager => draft
                        .round_forward(self.model, &self.cache, &rows, (n, width))
                        .map_err(model),
                    Runner::Graft { graft, round, .. } => {
                        graft.mark_step_begin();
                        draft
                            .round(
                                graft,
                                *round,
                                self.model,
                                &self.cache,
                                &rows,
                                (segments, width),
                            )
                            .map(|pass| pass.rows)
                    }
                }
            }
            (runner, _) => {
                let tokens: Vec<Vec<u32>> = self
                    .running
                    .iter()
                    .zip(&drafts)
                    .map(|(r, d)| [&[r.last][..], d].concat())
                    .collect();
                let rows: Vec<VerifyRow<'_>> = self
                    .running
                    .iter()
                    .zip(&tokens)
                    .enumerate()
                    .map(|(row, (r, tokens))| VerifyRow {
                        row,
                        tokens,
                        sampling: sampling(r),
                    })
                    .collect();
                match runner {
                    Runner::Eager => self
                        .model
                        .verify_rows_forward(&self.cache, &rows, (n, width))
                        .map_err(model),
                    Runner::Graft { graft, verify, .. } => {
                        graft.mark_step_begin();
                        self.model
                            .verify_rows(graft, *verify, &self.cache, &rows, (segments, width))
                            .map(|pass| pass.rows)
                    }
                }
            }
        }
        .map_err(fail)?;
        for (row, (pass, &k)) in passes.iter().zip(&ks).enumerate() {
            if let Some(chooser) = &mut self.running[row].draft {
                chooser.observe(k, pass.accepted);
            }
            // The accepted drafts are the pass's picks before its last.
            let tokens = pass.tokens();
            self.accept_drafts(row, &tokens[..tokens.len() - 1])
                .map_err(|e| fail(model(e)))?;
            let r = &mut self.running[row];
            for &token in tokens {
                r.made(token, events);
                if r.generated >= r.max_new || self.config.eos.contains(&token) {
                    break;
                }
            }
        }
        self.retire(events).map_err(|e| fail(model(e)))
    }
}
