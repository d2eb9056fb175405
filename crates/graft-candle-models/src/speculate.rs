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

use candle_core::{Result, Tensor};
use graft_candle::{CandleGraft, Error, StepId};
use graft_candle_kernels::{SAMPLE_WORDS, SampleParams, sample_rows};

use super::cache::KvCache;
use super::decoder::Decoder;

pub use draft::{DraftError, DraftModel};

/// What one verify pass gives: the model's pick after each position (`[k + 1]` u32) and how
/// many drafts it accepted.
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

impl Decoder {
    /// One verify pass of sequence `row` of a serving cache: `tokens` (`[k + 1]` u32) holds the
    /// sequence's last token (the one at its position, not yet in the cache) and k drafts of
    /// the tokens after it. Writes the keys and values of all k + 1 at the sequence's next
    /// positions, picks the model's token after each by `sampling` (`sampling.index`: the
    /// request's count of tokens so far, the draw index of the first pick; the i-th pick draws
    /// with index + i), accepts the longest prefix of drafts equal to the picks, and advances
    /// the sequence's position by the accepted drafts plus one (on the device; the cache's
    /// host copy after reading the count): the next pass starts from [`Verified::tokens`]'
    /// last. Needs room for k + 1 positions.
    pub fn verify_forward(
        &self,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
        sampling: SampleParams,
    ) -> Result<Verified> {
        let n = tokens.dims1()?;
        let inputs = self.verify_inputs(cache, row, n, sampling)?;
        let (targets, accepted) = self.verify_next(cache, tokens, &inputs[0], &inputs[1])?;
        let accepted = accepted.to_vec1::<u32>()?[0] as usize;
        cache.advance_row(row, accepted + 1);
        Ok(Verified {
            targets: targets.to_vec1()?,
            accepted,
        })
    }

    /// [`Decoder::verify_forward`] under graft: `tokens`, `[row, k + 1]` (u32) and each pick's
    /// sampling words are the step's inputs, the weights and `cache` its statics, `[k + 1,
    /// key]` its keys: one recording per draft count serves every sequence, position,
    /// sampling and acceptance. The host reads the pass's tokens and count after the replay
    /// (and advances the cache's host copy of the position by them).
    pub fn verify(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
        sampling: SampleParams,
    ) -> std::result::Result<Verified, Error> {
        let model = |source| Error::Model { source };
        let n = tokens.dims1().map_err(model)?;
        let [meta, words] = self.verify_inputs(cache, row, n, sampling).map_err(model)?;
        let statics = self.statics(cache);
        let out = graft.call(
            step,
            &[tokens, &meta, &words],
            &statics,
            &[n as u64, self.key()],
            |inputs| {
                let (targets, accepted) =
                    self.verify_next(cache, &inputs[0], &inputs[1], &inputs[2])?;
                Ok(vec![targets, accepted])
            },
        )?;
        let read = |t: &Tensor| t.to_vec1::<u32>().map_err(model);
        let accepted = read(&out.outputs[1])?[0] as usize;
        cache.advance_row(row, accepted + 1);
        Ok(Verified {
            targets: read(&out.outputs[0])?,
            accepted,
        })
    }

    /// A pass's host-side checks and its inputs besides the tokens: `[row, n]` (u32) and each
    /// pick's sampling words (`[n, SAMPLE_WORDS]` u32, draw indices from `sampling.index`).
    fn verify_inputs(
        &self,
        cache: &KvCache,
        row: usize,
        n: usize,
        sampling: SampleParams,
    ) -> Result<[Tensor; 2]> {
        if n == 0 {
            candle_core::bail!("verify: no tokens; pass the sequence's last token and its drafts");
        }
        cache.check_prefill(row, n, n)?;
        let meta = Tensor::new(&[row as u32, n as u32], self.device())?;
        let words: Vec<u32> = (0..n as u32)
            .flat_map(|i| {
                SampleParams {
                    index: sampling.index.wrapping_add(i),
                    ..sampling
                }
                .words()
            })
            .collect();
        let words = Tensor::from_vec(words, (n, SAMPLE_WORDS), self.device())?;
        Ok([meta, words])
    }

    /// The verify pass itself (no host read, nothing uploaded: capturable): the model's pick
    /// after each of `tokens` (`[k + 1]` u32) by its row of `words`, and the accepted count
    /// (`[1]` u32), the row's position advanced by it plus one. `meta` is `[row, k + 1]` u32.
    fn verify_next(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        meta: &Tensor,
        words: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let n = tokens.dims1()?;
        let plan = cache.prefill_plan(meta, n)?;
        // The decode step's chain where it takes k + 1 rows (all of them the sequence's row,
        // at consecutive positions); the prefill's blocks otherwise.
        let logits = match self.chain_logits(cache, tokens, &plan.positions, Some(&plan.rows))? {
            Some(logits) => logits,
            None => {
                let h = self.prefill_hidden(cache, tokens, &plan)?;
                self.head(&h)?
                    .squeeze(1)?
                    .to_dtype(candle_core::DType::F32)?
            }
        };
        let targets = sample_rows(&logits, words)?;
        // Draft i (tokens[i + 1]) is accepted when it and every draft before it equal the
        // model's pick after the position before it: the count of leading ones. Without
        // drafts there is nothing to compare (CUDA refuses a launch over no elements).
        let accepted = if n > 1 {
            let agree = tokens
                .narrow(0, 1, n - 1)?
                .eq(&targets.narrow(0, 0, n - 1)?)?
                .to_dtype(candle_core::DType::U32)?;
            leading_ones(&agree)?
        } else {
            Tensor::zeros(1, candle_core::DType::U32, tokens.device())?
        };
        cache.step_row(&plan, &(&accepted + 1.0)?)?;
        Ok((targets, accepted))
    }
}

/// The number of leading ones of `flags` (`[k]` u32 of 0 and 1, k at least 1), as `[1]` u32,
/// on the device: the sum of the running product, one element at a time (k is a few drafts),
/// so that nothing is uploaded from the host inside a recording.
fn leading_ones(flags: &Tensor) -> Result<Tensor> {
    let k = flags.dim(0)?;
    let mut run = flags.narrow(0, 0, 1)?;
    let mut count = run.clone();
    for i in 1..k {
        run = (run * flags.narrow(0, i, 1)?)?;
        count = (count + &run)?;
    }
    Ok(count)
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
        for (flags, want) in [
            (vec![1u32, 1, 0, 1], 2u32),
            (vec![0, 1, 1], 0),
            (vec![1, 1, 1], 3),
        ] {
            let t = Tensor::from_vec(flags.clone(), flags.len(), &dev)?;
            assert_eq!(leading_ones(&t)?.to_vec1::<u32>()?, [want], "{flags:?}");
        }
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
