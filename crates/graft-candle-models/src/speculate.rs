//! Speculative decoding with drafts that are a guess, not a distribution (prompt lookup, an
//! n-gram table, a smaller model's greedy pick, a user's hint): a drafter proposes the next
//! tokens of a sequence ([`prompt_lookup`]: the tokens that followed the latest earlier
//! occurrence of its last n-gram; [`DraftModel`]: a smaller decoder's greedy continuation), and one verify pass of the model over the last token and the drafts
//! ([`Decoder::verify`], or [`Decoder::verify_forward`] eagerly) writes their keys and values,
//! picks the model's token after each with the request's sampling, and keeps the longest
//! prefix of drafts equal to the picks, plus the model's own next pick: from 1 to k + 1 tokens
//! for one pass. The picks, the acceptance and the rollback (the sequence's position advanced
//! by the accepted count only, so the rejected drafts' keys and values are masked and
//! overwritten later) happen on the device, inside the one recording per draft count; the
//! host reads the tokens after it. [`AdaptiveDraft`] picks each pass's draft count.
//!
//! Lossless: a draft that is a single token d is accepted with the target's probability p(d)
//! when the pass draws the position's token from p and compares (the standard rejection rule
//! for a draft distribution concentrated on d); on a rejection the drawn token is p's draw
//! conditioned on not being d, the rule's residual. So the output's distribution is the
//! model's, greedy or sampled, and each position draws with the index plain decoding would
//! give that token (the request's count of tokens so far): where the pass's logits equal the
//! decode step's, speculative and plain decoding emit the same tokens, seed for seed. The pass
//! runs the decode step's chain over k + 1 rows where the chain takes them (else the
//! prefill's kernels), and the decode step the chain over one row, so the logits agree to the
//! dtype's rounding, not always bit for bit (see the batch-invariance decision in
//! docs/architecture.md).

mod draft;
mod round;

use candle_core::{Result, Tensor};
use graft_candle::{CandleGraft, Error, StepId, StepOutcome};
use graft_candle_kernels::{SAMPLE_WORDS, SampleParams, sample_rows};

use super::cache::KvCache;
use super::decoder::Decoder;

pub use draft::{DraftError, DraftModel};
pub use round::DraftRow;

/// What one verify pass gives a sequence: the model's pick after its last token and after
/// each of its drafts, and how many drafts it accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The model's pick after the last token and after each draft.
    pub targets: Vec<u32>,
    /// Leading drafts equal to the model's picks (0 to k).
    pub accepted: usize,
}

impl Verified {
    /// The tokens the pass decoded: the accepted drafts, then the model's next pick.
    pub fn tokens(&self) -> &[u32] {
        &self.targets[..=self.accepted]
    }
}

/// A verify pass under graft ([`Decoder::verify_rows`]): each sequence's result, in order,
/// and what graft did with the call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedRows {
    /// Each sequence's result.
    pub rows: Vec<Verified>,
    /// Replayed, recorded, or run eagerly (warming up or refused).
    pub outcome: StepOutcome,
}

/// One sequence's part of a verify pass ([`Decoder::verify_rows`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VerifyRow<'a> {
    /// The sequence's cache row.
    pub row: usize,
    /// Its last token (the one at its position, not yet in the cache), then its drafts of the
    /// tokens after it (none: the pass is a decode step for this sequence).
    pub tokens: &'a [u32],
    /// How its picks are drawn; `index` is the first pick's draw index (the request's count
    /// of tokens so far), the i-th pick draws with `index + i`.
    pub sampling: SampleParams,
}

impl Decoder {
    /// One verify pass of sequence `row` of a serving cache: `tokens` holds the sequence's
    /// last token (the one at its position, not yet in the cache) and k drafts of the tokens
    /// after it. Writes the keys and values of all k + 1 at the sequence's next positions,
    /// picks the model's token after each by `sampling`, accepts the longest prefix of drafts
    /// equal to the picks, and advances the sequence's position by the accepted drafts plus
    /// one (on the device; the cache's host copy after reading the count): the next pass
    /// starts from [`Verified::tokens`]' last. Needs room for k + 1 positions. The
    /// one-sequence case of [`Decoder::verify_rows_forward`].
    pub fn verify_forward(
        &self,
        cache: &KvCache,
        row: usize,
        tokens: &[u32],
        sampling: SampleParams,
    ) -> Result<Verified> {
        let one = [VerifyRow {
            row,
            tokens,
            sampling,
        }];
        let mut v = self.verify_rows_forward(cache, &one, (1, tokens.len()))?;
        Ok(v.remove(0))
    }

    /// [`Decoder::verify_forward`] under graft: the one-sequence case of
    /// [`Decoder::verify_rows`].
    pub fn verify(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        row: usize,
        tokens: &[u32],
        sampling: SampleParams,
    ) -> std::result::Result<Verified, Error> {
        let one = [VerifyRow {
            row,
            tokens,
            sampling,
        }];
        let mut v = self.verify_rows(graft, step, cache, &one, (1, tokens.len()))?;
        Ok(v.rows.remove(0))
    }

    /// One eager verify pass of several sequences (in distinct rows of a serving cache), each
    /// as [`Decoder::verify_forward`] does it, padded to `shape`: `(segments, width)`, at
    /// least as many segments as `rows` and at least as wide as the longest of their tokens
    /// (padding costs work, never tokens: a padding position is never accepted). Returns each
    /// row's result, in order. Several rows need the fused attention.
    pub fn verify_rows_forward(
        &self,
        cache: &KvCache,
        rows: &[VerifyRow<'_>],
        shape: (usize, usize),
    ) -> Result<Vec<Verified>> {
        let (tokens, meta) = self.verify_inputs(cache, rows, shape)?;
        let out = self.verify_next(cache, &tokens, &meta, shape)?;
        verified(cache, rows, shape, &out.to_vec1()?)
    }

    /// [`Decoder::verify_rows_forward`] under graft: the tokens and the rows, lengths, draft
    /// masks and sampling words (one u32 input) are the step's inputs, the weights and
    /// `cache` its statics, `[segments, width, key]` its keys: one recording per shape serves
    /// every set of sequences, positions, draft counts, samplings and acceptances (register
    /// `step` with batch buckets and pad the segments to one). The host reads the picks and
    /// counts once after the replay (and advances the cache's host copy of each position).
    pub fn verify_rows(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        rows: &[VerifyRow<'_>],
        shape: (usize, usize),
    ) -> std::result::Result<VerifiedRows, Error> {
        let model = |source| Error::Model { source };
        let (tokens, meta) = self.verify_inputs(cache, rows, shape).map_err(model)?;
        let statics = self.statics(cache);
        let out = graft.call(
            step,
            &[&tokens, &meta],
            &statics,
            &[shape.0 as u64, shape.1 as u64, self.key()],
            |inputs| {
                Ok(vec![
                    self.verify_next(cache, &inputs[0], &inputs[1], shape)?,
                ])
            },
        )?;
        let read = out.outputs[0].to_vec1().map_err(model)?;
        Ok(VerifiedRows {
            rows: verified(cache, rows, shape, &read).map_err(model)?,
            outcome: out.outcome,
        })
    }

    /// A pass's host-side checks and its inputs: the tokens (`[segments * width]` u32, each
    /// row's at the start of its segment) and the meta `KvCache::segments_plan` reads, then
    /// each draft slot's mask (`[segments, width - 1]`: 1 where the segment has that draft)
    /// and each position's sampling words (`[segments * width, SAMPLE_WORDS]`).
    fn verify_inputs(
        &self,
        cache: &KvCache,
        rows: &[VerifyRow<'_>],
        (segments, width): (usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let longest = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0);
        if rows.is_empty() || rows.len() > segments || longest > width {
            candle_core::bail!(
                "a verify pass of {} sequences of up to {longest} tokens padded to {segments} segments of {width}: pass 1 to {segments} sequences of at most {width} tokens",
                rows.len()
            );
        }
        if rows.len() > 1 && !self.fused_attention {
            candle_core::bail!(
                "a verify pass of several sequences needs the fused attention, which this model's heads do not fit: verify one sequence a pass"
            );
        }
        for (i, r) in rows.iter().enumerate() {
            if r.tokens.is_empty() {
                candle_core::bail!(
                    "verify: no tokens for cache row {}; pass the sequence's last token and its drafts",
                    r.row
                );
            }
            if rows[..i].iter().any(|s| s.row == r.row) {
                candle_core::bail!(
                    "two sequences of one verify pass name cache row {}: give each sequence one segment",
                    r.row
                );
            }
            cache.check_prefill(r.row, r.tokens.len(), width)?;
        }
        let chunk = segments * width;
        let scratch = cache.max_batch() as u32;
        let max_seq = cache.max_seq();
        let mut tokens = vec![0u32; chunk];
        // Padding: the scratch row, at a place of its own while the chunk fits a row (the
        // fused ops' padding writes are never read, so a wider chunk may share places).
        let mut token_rows = vec![scratch; chunk];
        let mut offsets: Vec<u32> = (0..chunk).map(|i| (i % max_seq) as u32).collect();
        let mut last = vec![0u32; segments];
        let mut seg_rows = vec![scratch; segments];
        let mut lens = vec![0u32; segments];
        let mut drafts = vec![0u32; segments * (width - 1)];
        let mut words = Vec::with_capacity(chunk * SAMPLE_WORDS);
        for s in 0..segments {
            let r = rows.get(s);
            let len = r.map_or(0, |r| r.tokens.len());
            let at = s * width;
            if let Some(r) = r {
                tokens[at..at + len].copy_from_slice(r.tokens);
                token_rows[at..at + len].fill(r.row as u32);
                for (j, o) in offsets[at..at + len].iter_mut().enumerate() {
                    *o = j as u32;
                }
                last[s] = (at + len - 1) as u32;
                seg_rows[s] = r.row as u32;
                lens[s] = len as u32;
                drafts[s * (width - 1)..][..len - 1].fill(1);
            }
            for j in 0..width {
                let sampling = match r {
                    Some(r) if j < len => SampleParams {
                        index: r.sampling.index.wrapping_add(j as u32),
                        ..r.sampling
                    },
                    _ => SampleParams::GREEDY,
                };
                words.extend(sampling.words());
            }
        }
        let meta: Vec<u32> = [token_rows, offsets, last, seg_rows, lens, drafts, words].concat();
        let device = self.device();
        Ok((
            Tensor::new(tokens.as_slice(), device)?,
            Tensor::new(meta.as_slice(), device)?,
        ))
    }

    /// The verify pass itself (no host read, nothing uploaded: capturable): the model's pick
    /// after each of `tokens` (`[segments * width]` u32) by its sampling words, then each
    /// segment's accepted count, as one `[segments * width + segments]` u32; each row's
    /// position advanced by its count plus one. `meta` is [`Decoder::verify_inputs`]'.
    fn verify_next(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        meta: &Tensor,
        (segments, width): (usize, usize),
    ) -> Result<Tensor> {
        let chunk = segments * width;
        let (plan, _) = cache.segments_plan(meta, chunk, segments)?;
        // A segment is its row at consecutive positions, which each layer writes before it
        // attends: the pass is causal.
        let logits = if self.fused_attention {
            self.logits_at(cache, tokens, &plan.positions, &plan.rows)?
        } else {
            let h = self.prefill_hidden(cache, tokens, &plan)?;
            self.head(&h)?
                .squeeze(1)?
                .to_dtype(candle_core::DType::F32)?
        };
        let mask_at = 2 * chunk + 3 * segments;
        let drafts = segments * (width - 1);
        let words = meta
            .narrow(0, mask_at + drafts, chunk * SAMPLE_WORDS)?
            .reshape((chunk, SAMPLE_WORDS))?;
        let targets = sample_rows(&logits, &words)?;
        // Draft j of a segment (its token j + 1) is accepted when it and every draft before
        // it are real and equal the model's pick after the position before it: the count of
        // leading ones. Without draft slots there is nothing to compare (CUDA refuses a
        // launch over no elements).
        let accepted = if width > 1 {
            let t = tokens.reshape((segments, width))?;
            let p = targets.reshape((segments, width))?;
            let real = meta
                .narrow(0, mask_at, drafts)?
                .reshape((segments, width - 1))?;
            let agree = t
                .narrow(1, 1, width - 1)?
                .eq(&p.narrow(1, 0, width - 1)?)?
                .to_dtype(candle_core::DType::U32)?;
            leading_ones(&(agree * real)?)?
        } else {
            Tensor::zeros(segments, candle_core::DType::U32, tokens.device())?
        };
        cache.step_row(&plan, &(&accepted + 1.0)?)?;
        Tensor::cat(&[&targets, &accepted], 0)
    }
}

/// Each row's result from a pass's output (`[segments * width]` picks, then `[segments]`
/// counts), the cache's host positions advanced by them.
fn verified(
    cache: &KvCache,
    rows: &[VerifyRow<'_>],
    (segments, width): (usize, usize),
    out: &[u32],
) -> Result<Vec<Verified>> {
    let counts = &out[segments * width..];
    rows.iter()
        .enumerate()
        .map(|(s, r)| {
            let accepted = counts[s] as usize;
            if accepted >= r.tokens.len() {
                candle_core::bail!(
                    "a verify pass accepted {accepted} of the {} drafts of cache row {}",
                    r.tokens.len() - 1,
                    r.row
                );
            }
            cache.advance_row(r.row, accepted + 1);
            Ok(Verified {
                targets: out[s * width..][..r.tokens.len()].to_vec(),
                accepted,
            })
        })
        .collect()
}

/// The number of leading ones of each row of `flags` (`[rows, k]` u32 of 0 and 1, k at least
/// 1), as `[rows]` u32, on the device: the sum of the running product, one column at a time
/// (k is a few drafts), so that nothing is uploaded from the host inside a recording.
fn leading_ones(flags: &Tensor) -> Result<Tensor> {
    let k = flags.dim(1)?;
    let mut run = flags.narrow(1, 0, 1)?;
    let mut count = run.clone();
    for i in 1..k {
        run = (run * flags.narrow(1, i, 1)?)?;
        count = (count + &run)?;
    }
    count.squeeze(1)
}

/// Up to `k` drafts for a sequence whose tokens so far are `history`: the tokens that followed
/// the latest earlier occurrence of its last `n`-gram, trying `n` from `max_ngram` down to 1
/// (prompt-lookup decoding). Empty when no n-gram recurs.
pub fn prompt_lookup(history: &[u32], max_ngram: usize, k: usize) -> Vec<u32> {
    for n in (1..=max_ngram.min(history.len().saturating_sub(1))).rev() {
        let tail = &history[history.len() - n..];
        // Latest start of an earlier occurrence, with at least one token after it.
        let found = (0..history.len() - n)
            .rev()
            .find(|&i| &history[i..i + n] == tail);
        if let Some(i) = found {
            let from = i + n;
            return history[from..(from + k).min(history.len())].to_vec();
        }
    }
    Vec::new()
}

/// How many drafts to verify next, chosen from the acceptance seen so far: the k that
/// maximizes the tokens a pass gives over what it costs, (1 - a^(k+1)) / ((1 - a) cost(k)),
/// with a the estimated chance that a draft is accepted and cost(k) a pass of k drafts
/// against a plain decode step. k = 0 is plain decoding: speculation switches off when
/// acceptance falls so low that no k pays, and a single draft is tried again every
/// `probe_every` passes so that it switches back on when drafts start to match.
#[derive(Debug, Clone)]
pub struct AdaptiveDraft {
    /// cost(k) for k = 0..=max_k (cost(0) = 1).
    costs: Vec<f64>,
    /// Decayed counts of drafts accepted and drafts tried (tried until the first rejection).
    accepted: f64,
    tried: f64,
    decay: f64,
    probe_every: u32,
    /// Passes since the last one with drafts.
    plain: u32,
}

impl AdaptiveDraft {
    /// A chooser of k in `0..costs.len()`, `costs[k]` a pass of k drafts against a plain step
    /// (`costs[0]` is taken as 1), starting from `prior` as the acceptance (0 to 1); `decay`
    /// (0 to 1) weighs older passes down, and a draft is probed every `probe_every` plain
    /// passes.
    pub fn new(costs: Vec<f64>, prior: f64, decay: f64, probe_every: u32) -> Self {
        let mut costs = costs;
        if let Some(c) = costs.first_mut() {
            *c = 1.0;
        }
        // The prior as one pass's worth of evidence.
        let prior = prior.clamp(0.0, 1.0);
        AdaptiveDraft {
            costs,
            accepted: prior,
            tried: 1.0,
            decay: decay.clamp(0.0, 1.0),
            probe_every: probe_every.max(1),
            plain: 0,
        }
    }

    /// The estimated chance that a draft is accepted.
    pub fn acceptance(&self) -> f64 {
        if self.tried > 0.0 {
            self.accepted / self.tried
        } else {
            0.0
        }
    }

    /// The number of drafts to verify next.
    pub fn next_k(&self) -> usize {
        let a = self.acceptance().min(1.0 - 1e-9);
        let best = (0..self.costs.len())
            .map(|k| {
                let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
                (k, tokens / self.costs[k].max(f64::MIN_POSITIVE))
            })
            .fold(
                (0, 1.0),
                |best, (k, value)| if value > best.1 { (k, value) } else { best },
            );
        if best.0 == 0 && self.plain + 1 >= self.probe_every && self.costs.len() > 1 {
            1
        } else {
            best.0
        }
    }

    /// Records a pass of `k` drafts of which `accepted` were accepted.
    pub fn observe(&mut self, k: usize, accepted: usize) {
        if k == 0 {
            self.plain += 1;
            return;
        }
        self.plain = 0;
        let accepted = accepted.min(k);
        // Drafts are tried in order until the first rejection.
        let tried = accepted + usize::from(accepted < k);
        self.accepted = self.accepted * self.decay + accepted as f64;
        self.tried = self.tried * self.decay + tried as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_follows_the_latest_longest_match() {
        // The last 2-gram (3, 4) occurred at 2 and at 6; the latest, at 6, is followed by 9.
        let h = [1, 2, 3, 4, 5, 6, 3, 4, 9, 3, 4];
        assert_eq!(prompt_lookup(&h, 3, 2), [9, 3]);
        // Only a 1-gram recurs: 7 followed by 8.
        assert_eq!(prompt_lookup(&[7, 8, 1, 7], 3, 4), [8, 1, 7]);
        assert!(prompt_lookup(&[1, 2, 3], 2, 4).is_empty());
        assert!(prompt_lookup(&[], 2, 4).is_empty());
        assert!(prompt_lookup(&[5], 2, 4).is_empty());
    }

    #[test]
    fn leading_ones_counts_the_prefix() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let flags = [1u32, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1];
        let t = Tensor::from_vec(flags.to_vec(), (3, 4), &dev)?;
        assert_eq!(leading_ones(&t)?.to_vec1::<u32>()?, [2, 0, 4]);
        Ok(())
    }

    #[test]
    fn adaptive_draft_switches_off_when_drafts_miss_and_back_on_when_they_match() {
        // A pass of k drafts costs 1 + 0.1 k plain steps.
        let costs: Vec<f64> = (0..=4).map(|k| 1.0 + 0.1 * k as f64).collect();
        let mut d = AdaptiveDraft::new(costs, 0.5, 0.8, 8);
        assert!(d.next_k() > 0, "a prior of 0.5 pays for drafts");
        // Every draft rejected: k falls to 0 within a few passes.
        for _ in 0..10 {
            let k = d.next_k();
            d.observe(k, 0);
        }
        assert!(d.acceptance() < 0.1, "acceptance {}", d.acceptance());
        // Plain passes (speculation off), and a probe of one draft every 8th.
        let ks: Vec<usize> = (0..16)
            .map(|_| {
                let k = d.next_k();
                d.observe(k, 0);
                k
            })
            .collect();
        assert_eq!(ks.iter().filter(|&&k| k == 0).count(), 14, "{ks:?}");
        assert_eq!(ks.iter().filter(|&&k| k == 1).count(), 2, "{ks:?}");
        // Every draft accepted: back to the most drafts.
        for _ in 0..40 {
            let k = d.next_k();
            d.observe(k, k);
        }
        assert_eq!(d.next_k(), 4, "acceptance {}", d.acceptance());
    }

    #[test]
    fn adaptive_draft_picks_the_best_of_the_ideal_speedups() {
        // At acceptance 0.6 and a cost of 1 + 0.3 k, k = 1 gives 1.6 / 1.3 = 1.23, k = 2
        // gives 1.96 / 1.6 = 1.225, k = 3 gives 2.18 / 1.9 = 1.14: k = 1.
        let costs: Vec<f64> = (0..=3).map(|k| 1.0 + 0.3 * k as f64).collect();
        let d = AdaptiveDraft::new(costs, 0.6, 0.9, 8);
        assert_eq!(d.next_k(), 1);
        // Free drafts (prompt lookup, a cost flat in k): always the most.
        let d = AdaptiveDraft::new(vec![1.0; 5], 0.2, 0.9, 8);
        assert_eq!(d.next_k(), 4);
    }
}
