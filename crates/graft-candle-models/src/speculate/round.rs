//! A speculation round in one launch: a draft model's greedy steps and the target's verify
//! pass of what they draft, for several sequences, in one recording per shape. The drafts
//! never leave the device: the host learns the round's tokens when it reads the pass.
//!
//! The draft's cache row of a sequence is kept one token behind the target's: before a round
//! it holds every token but the last two (the host catches it up where it does not, as
//! [`DraftModel::propose`] does), and the round's first draft step takes those two, the
//! token before the last and the last, at their positions. That step rewrites the
//! second-to-last token's keys and values when the draft already held them, and writes them
//! when the last round accepted every draft (its last draft was never fed to the draft), so
//! one recording serves every acceptance. Each further step feeds the draft its last pick.

use candle_core::{Result, Tensor};
use graft_candle::{CandleGraft, Error, StepId};
use graft_candle_kernels::{SampleParams, argmax_last};

use super::{DraftModel, Verified, VerifiedRows, VerifyRow, verified};
use crate::cache::KvCache;
use crate::decoder::Decoder;

/// One sequence's part of a round ([`DraftModel::round`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftRow<'a> {
    /// The sequence's cache row in the target's cache, and its slot in the draft's.
    pub row: usize,
    /// The sequence so far (prompt and tokens made, at least two): its last token is the one
    /// at the row's position, not yet in the cache.
    pub history: &'a [u32],
    /// How many of the round's drafts the pass may accept (0 to the round's width - 1): fewer
    /// where the sequence has fewer tokens left to make or less room.
    pub drafts: usize,
    /// How its picks are drawn, as [`VerifyRow::sampling`].
    pub sampling: SampleParams,
}

impl DraftModel<'_> {
    /// Whether rounds can run: the draft's steps need its fused attention (else draft with
    /// [`DraftModel::propose`] and verify with [`Decoder::verify_rows`]).
    pub fn runs_rounds(&self) -> bool {
        self.model.fused_attention
    }

    /// One eager round over `rows` of `target`'s serving `cache`, padded to `shape`
    /// (`(segments, width)`: width - 1 drafts a sequence): the draft model drafts width - 1
    /// tokens after each sequence greedily, and `target` verifies them as
    /// [`Decoder::verify_rows_forward`] does (each sequence accepts at most its
    /// [`DraftRow::drafts`]). Returns each row's result.
    pub fn round_forward(
        &mut self,
        target: &Decoder,
        cache: &KvCache,
        rows: &[DraftRow<'_>],
        shape: (usize, usize),
    ) -> Result<Vec<Verified>> {
        let [pair, at, meta] = self.round_inputs(target, cache, rows, shape)?;
        let out = self.round_next(target, cache, &pair, &at, &meta, shape)?;
        let zeros = vec![0; shape.1];
        let done = verified(cache, &placeholders(rows, &zeros), shape, &out.to_vec1()?)?;
        self.held_after(rows, &done);
        Ok(done)
    }

    /// [`DraftModel::round_forward`] under graft: the sequences' last two tokens, rows and
    /// positions and the pass's meta are the step's inputs; both models' weights and caches
    /// its statics; `[segments, width, target key, draft key]` its keys (register `step` with
    /// batch buckets and pad the segments to one). One replay drafts and verifies; the host
    /// reads the pass once.
    pub fn round(
        &mut self,
        graft: &mut CandleGraft,
        step: StepId,
        target: &Decoder,
        cache: &KvCache,
        rows: &[DraftRow<'_>],
        shape: (usize, usize),
    ) -> std::result::Result<VerifiedRows, Error> {
        let model = |source| Error::Model { source };
        let inputs = self
            .round_inputs(target, cache, rows, shape)
            .map_err(model)?;
        let mut statics = target.statics(cache);
        // A draft made of the target's own layers shares their tensors: each once.
        let mut seen: std::collections::HashSet<_> = statics.iter().map(|t| t.id()).collect();
        statics.extend(
            self.model
                .statics(&self.cache)
                .into_iter()
                .filter(|t| seen.insert(t.id())),
        );
        let keys = [
            shape.0 as u64,
            shape.1 as u64,
            target.key(),
            self.model.key(),
        ];
        let this = &*self;
        let out = graft.call(step, &inputs.each_ref(), &statics, &keys, |i| {
            Ok(vec![
                this.round_next(target, cache, &i[0], &i[1], &i[2], shape)?,
            ])
        })?;
        let read = out.outputs[0].to_vec1().map_err(model)?;
        let zeros = vec![0; shape.1];
        let done = verified(cache, &placeholders(rows, &zeros), shape, &read).map_err(model)?;
        self.held_after(rows, &done);
        Ok(VerifiedRows {
            rows: done,
            outcome: out.outcome,
        })
    }

    /// A round's host side before it: the draft caught up with every sequence but its last
    /// two tokens, then the inputs: each segment's token before the last and its last (`[2 *
    /// segments]` u32), its draft slot and the two tokens' positions (`[3 * segments]`, each
    /// a column: padding in the draft's scratch row at positions 0 and 1; u32 arithmetic on
    /// the device cannot subtract), and the pass's meta (`Decoder::verify_inputs`').
    fn round_inputs(
        &mut self,
        target: &Decoder,
        cache: &KvCache,
        rows: &[DraftRow<'_>],
        (segments, width): (usize, usize),
    ) -> Result<[Tensor; 3]> {
        if !self.runs_rounds() {
            candle_core::bail!(
                "a speculation round needs the draft model's fused attention, which its heads do not fit: draft with DraftModel::propose"
            );
        }
        if rows.is_empty() || rows.len() > segments || width < 2 {
            candle_core::bail!(
                "a round of {} sequences padded to {segments} segments of {width}: pass 1 to {segments} sequences and a width of at least 2 (one draft)",
                rows.len()
            );
        }
        let positions = cache.positions();
        let scratch = self.cache.max_batch() as u32;
        let mut pair = vec![0u32; 2 * segments];
        let mut slots = vec![scratch; segments];
        let mut before = vec![0u32; segments];
        let mut at = vec![1u32; segments];
        for (s, r) in rows.iter().enumerate() {
            let n = r.history.len();
            if n < 2 || r.drafts >= width {
                candle_core::bail!(
                    "a round of row {} with {n} tokens so far and {} drafts of {}: a round needs two tokens and at most width - 1 drafts",
                    r.row,
                    r.drafts,
                    width - 1
                );
            }
            if positions.get(r.row).copied() != Some(n as u32 - 1) {
                candle_core::bail!(
                    "a round of row {} whose history has {n} tokens, but the row's next position is {:?}: pass the sequence's whole history (its last token at the row's position)",
                    r.row,
                    positions.get(r.row)
                );
            }
            if n - 1 + width > self.cache.max_seq() {
                candle_core::bail!(
                    "a round of row {} at position {} drafts past the draft's cache ({} positions): make the draft model with the target's max_seq",
                    r.row,
                    n - 1,
                    self.cache.max_seq()
                );
            }
            self.catch_up(r.row, &r.history[..n - 2])?;
            pair[2 * s] = r.history[n - 2];
            pair[2 * s + 1] = r.history[n - 1];
            slots[s] = r.row as u32;
            before[s] = n as u32 - 2;
            at[s] = n as u32 - 1;
        }
        let zeros = vec![0; width];
        let (_, meta) =
            target.verify_inputs(cache, &placeholders(rows, &zeros), (segments, width))?;
        let device = target.device();
        let at: Vec<u32> = [slots, before, at].concat();
        Ok([
            Tensor::new(pair.as_slice(), device)?,
            Tensor::new(at.as_slice(), device)?,
            meta,
        ])
    }

    /// The round itself (capturable): the draft's steps, then the target's verify pass over
    /// each segment's last token and drafts; `Decoder::verify_next`'s output.
    fn round_next(
        &self,
        target: &Decoder,
        cache: &KvCache,
        pair: &Tensor,
        at: &Tensor,
        meta: &Tensor,
        (segments, width): (usize, usize),
    ) -> Result<Tensor> {
        let slots = at.narrow(0, 0, segments)?;
        let before = at.narrow(0, segments, segments)?;
        let position = at.narrow(0, 2 * segments, segments)?;
        // The first step: the token before the last and the last, at their positions.
        let slots2 = slots
            .unsqueeze(1)?
            .broadcast_as((segments, 2))?
            .contiguous()?
            .flatten_all()?;
        let positions2 = Tensor::stack(&[&before, &position], 1)?.flatten_all()?;
        let logits = self
            .model
            .logits_at(&self.cache, pair, &positions2, &slots2)?;
        // The pick after each segment's last token (the odd rows).
        let second = |t: &Tensor| {
            t.reshape((segments, 2))?
                .narrow(1, 1, 1)?
                .squeeze(1)?
                .contiguous()
        };
        let mut next = second(&argmax_last(&logits)?)?;
        let last = second(pair)?;
        let mut columns = vec![last, next.clone()];
        for i in 1..width - 1 {
            let at = position.affine(1.0, i as f64)?;
            let logits = self.model.logits_at(&self.cache, &next, &at, &slots)?;
            next = argmax_last(&logits)?;
            columns.push(next.clone());
        }
        let tokens = Tensor::stack(&columns, 1)?.flatten_all()?;
        target.verify_next(cache, &tokens, meta, (segments, width))
    }

    /// After a round, what each sequence's draft slot holds: every token but the last two of
    /// its history with the round's tokens (its accepted drafts are there, but for the last
    /// draft, which no step fed the draft).
    fn held_after(&mut self, rows: &[DraftRow<'_>], done: &[Verified]) {
        for (r, v) in rows.iter().zip(done) {
            let held = &mut self.held[r.row];
            held.clear();
            held.extend_from_slice(r.history);
            held.extend_from_slice(v.tokens());
            held.truncate(held.len() - 2);
        }
    }
}

/// The verify rows of a round's sequences: each its last token and its drafts as `zeros`
/// (the pass's meta depends only on their count; the tokens come from the draft on the
/// device). `zeros` is as long as the round is wide.
fn placeholders<'z>(rows: &[DraftRow<'_>], zeros: &'z [u32]) -> Vec<VerifyRow<'z>> {
    rows.iter()
        .map(|r| VerifyRow {
            row: r.row,
            tokens: &zeros[..=r.drafts.min(zeros.len().saturating_sub(1))],
            sampling: r.sampling,
        })
        .collect()
}
