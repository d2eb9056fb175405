//! graft-candle-speculate's runs: plain decoding, verify passes of drafts made on the host,
//! and draft-model rounds, for `--batch` sequences of one target, timed.

use std::time::Instant;

use graft_candle::candle_core::Tensor;
use graft_candle::{Buckets, CandleGraft, StepId};
use graft_candle_bench::common::{BenchResult, median};
use graft_candle_kernels::SampleParams;
use graft_candle_models::speculate::{
    AdaptiveDraft, DraftModel, DraftRow, Verified, VerifyRow, prompt_lookup,
};
use graft_candle_models::{Decoder, KvCache};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Sequence s's prompt: a phrase of 8 tokens of its own said four times (prompt lookup finds
/// its n-grams).
pub(crate) fn prompt(s: usize) -> Vec<u32> {
    (0..32)
        .map(|i| [5, 17, 99, 3, 250, 1021, 7, 64][i % 8] + 13 * s as u32)
        .collect()
}

/// One run's result: each sequence's tokens, the wall time, and the drafts accepted and
/// rejected.
#[derive(Default)]
pub(crate) struct Run {
    pub(crate) tokens: Vec<Vec<u32>>,
    pub(crate) us: f64,
    pub(crate) accepted: usize,
    pub(crate) rejected: usize,
    pub(crate) passes: usize,
    /// How many times a sequence's pass had d drafts, at index d (prompt lookup proposes
    /// fewer than k where the history has no longer match).
    pub(crate) drafted: Vec<usize>,
}

impl Run {
    /// The measured acceptance: accepted drafts over drafts tried until the first rejection.
    pub(crate) fn alpha(&self) -> f64 {
        let tried = self.accepted + self.rejected;
        if tried > 0 {
            self.accepted as f64 / tried as f64
        } else {
            0.0
        }
    }
}

/// Where the drafts come from.
pub(crate) enum Drafter<'a, 'm> {
    /// Each sequence's tokens from passes of the same draft count (`want`), each corrupted
    /// with probability 1 - α.
    Oracle { want: &'a [Vec<u32>], alpha: f64 },
    /// Prompt lookup over the prompt and the tokens so far (3-grams).
    Lookup,
    /// A draft model's greedy steps, in the pass's launch.
    Rounds(&'a mut DraftModel<'m>),
}

/// One target's decoding: its cache of `--batch` rows, graft and steps.
pub(crate) struct Bench<'m> {
    model: &'m Decoder,
    cache: KvCache,
    pub(crate) graft: CandleGraft,
    decode: StepId,
    verify: StepId,
    round: StepId,
    prompts: Vec<Vec<u32>>,
}

impl<'m> Bench<'m> {
    pub(crate) fn new(model: &'m Decoder, batch: usize, max_seq: usize) -> BenchResult<Self> {
        let mut graft = CandleGraft::new(model.device())?;
        let buckets = Buckets::new([batch])?;
        Ok(Bench {
            model,
            cache: model.new_serving_cache(batch, max_seq)?,
            decode: graft.register("decode"),
            verify: graft.register_bucketed("verify", buckets.clone()),
            round: graft.register_bucketed("round", buckets),
            graft,
            prompts: (0..batch).map(prompt).collect(),
        })
    }

    pub(crate) fn batch(&self) -> usize {
        self.prompts.len()
    }

    /// Empties the cache and decodes all but each prompt's last token (untimed).
    pub(crate) fn start(&mut self) -> BenchResult<()> {
        self.cache.reset()?;
        for i in 0..self.prompts[0].len() - 1 {
            let column: Vec<u32> = self.prompts.iter().map(|p| p[i]).collect();
            self.step(&column)?;
        }
        Ok(())
    }

    /// One greedy decode step of every sequence: the token after each of `last`.
    pub(crate) fn step(&mut self, last: &[u32]) -> BenchResult<Vec<u32>> {
        let t = Tensor::new(last, self.model.device())?;
        self.graft.mark_step_begin();
        let out = self
            .model
            .decode(&mut self.graft, self.decode, &self.cache, &t)?;
        Ok(out.outputs[0].to_vec1::<u32>()?)
    }

    /// Plain greedy decoding of `n` tokens a sequence, timed.
    pub(crate) fn plain(&mut self, n: usize) -> BenchResult<Run> {
        self.start()?;
        let mut last: Vec<u32> = self.prompts.iter().map(|p| p[p.len() - 1]).collect();
        let mut tokens = vec![Vec::with_capacity(n); self.batch()];
        let t = Instant::now();
        for _ in 0..n {
            last = self.step(&last)?;
            for (s, &token) in last.iter().enumerate() {
                tokens[s].push(token);
            }
        }
        Ok(Run {
            tokens,
            us: t.elapsed().as_secs_f64() * 1e6,
            passes: n,
            ..Run::default()
        })
    }

    /// One verify pass of the sequences `active` (their histories in `history`), each with
    /// its drafts, greedy, padded to the batch and to `k + 1` tokens.
    pub(crate) fn pass(
        &mut self,
        active: &[usize],
        history: &[Vec<u32>],
        drafts: &[Vec<u32>],
        made: &[usize],
        k: usize,
    ) -> BenchResult<Vec<Verified>> {
        let tokens: Vec<Vec<u32>> = active
            .iter()
            .zip(drafts)
            .map(|(&s, d)| [&history[s][history[s].len() - 1..], d].concat())
            .collect();
        let rows: Vec<VerifyRow<'_>> = active
            .iter()
            .zip(&tokens)
            .map(|(&s, t)| VerifyRow {
                row: s,
                tokens: t,
                sampling: greedy(made[s]),
            })
            .collect();
        self.graft.mark_step_begin();
        let shape = (self.batch(), k + 1);
        Ok(self
            .model
            .verify_rows(&mut self.graft, self.verify, &self.cache, &rows, shape)?
            .rows)
    }

    /// Each sequence's greedy tokens from verify passes of `k` drafts that are never right
    /// (`n` of them, or a few more): what a pass of this shape picks, which the oracle drafts
    /// from. In bf16 they may part from plain decoding's (the kernels change with the rows).
    pub(crate) fn truth(&mut self, n: usize, k: usize) -> BenchResult<Vec<Vec<u32>>> {
        let drafter = Drafter::Oracle {
            want: &[],
            alpha: 0.0,
        };
        Ok(self.speculate(n, k, drafter, None, 0)?.tokens)
    }

    /// `n` tokens a sequence (or a few more) by passes of `k` drafts from `drafter` (or of
    /// the counts `adaptive` picks per sequence; a decode step of every sequence when none
    /// has drafts, as the engine does), timed.
    pub(crate) fn speculate(
        &mut self,
        n: usize,
        k: usize,
        mut drafter: Drafter<'_, 'm>,
        mut adaptive: Option<&mut [AdaptiveDraft]>,
        seed: u64,
    ) -> BenchResult<Run> {
        self.start()?;
        let batch = self.batch();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut history = self.prompts.clone();
        let mut run = Run {
            tokens: vec![Vec::with_capacity(n + k); batch],
            ..Run::default()
        };
        let t = Instant::now();
        loop {
            let active: Vec<usize> = (0..batch).filter(|&s| run.tokens[s].len() < n).collect();
            if active.is_empty() {
                break;
            }
            let ks: Vec<usize> = match adaptive.as_deref() {
                Some(a) => active.iter().map(|&s| a[s].next_k()).collect(),
                None => vec![k; active.len()],
            };
            run.passes += 1;
            let made: Vec<usize> = run.tokens.iter().map(Vec::len).collect();
            // The drafts, where the host makes them.
            let drafts: Option<Vec<Vec<u32>>> = match &drafter {
                Drafter::Rounds(_) => None,
                Drafter::Oracle { want, alpha } => Some(
                    active
                        .iter()
                        .zip(&ks)
                        .map(|(&s, &k)| {
                            (0..k)
                                .map(|j| {
                                    // Token 0 where the oracle knows nothing (the truth's runs).
                                    let w = want.get(s).map_or(0, |w| w[made[s] + j]);
                                    if want.is_empty() || rng.random::<f64>() < *alpha {
                                        w
                                    } else {
                                        w ^ 1
                                    }
                                })
                                .collect()
                        })
                        .collect(),
                ),
                Drafter::Lookup => Some(
                    active
                        .iter()
                        .zip(&ks)
                        .map(|(&s, &k)| prompt_lookup(&history[s], 3, k))
                        .collect(),
                ),
            };
            let drafted: Vec<usize> = match &drafts {
                Some(d) => d.iter().map(Vec::len).collect(),
                None => ks.clone(),
            };
            for &d in &drafted {
                if run.drafted.len() <= d {
                    run.drafted.resize(d + 1, 0);
                }
                run.drafted[d] += 1;
            }
            let width = 1 + drafted.iter().copied().max().unwrap_or(0);
            if width == 1 {
                // No drafts anywhere: a decode step of every sequence.
                if let Some(a) = adaptive.as_deref_mut() {
                    active.iter().for_each(|&s| a[s].observe(0, 0));
                }
                let last: Vec<u32> = history.iter().map(|h| h[h.len() - 1]).collect();
                let next = self.step(&last)?;
                for &s in &active {
                    run.tokens[s].push(next[s]);
                    history[s].push(next[s]);
                }
                continue;
            }
            let passes = match (&mut drafter, &drafts) {
                (_, Some(drafts)) => self.pass(&active, &history, drafts, &made, width - 1)?,
                (Drafter::Rounds(draft), None) => {
                    let rows: Vec<DraftRow<'_>> = active
                        .iter()
                        .zip(&ks)
                        .map(|(&s, &drafts)| DraftRow {
                            row: s,
                            history: &history[s],
                            drafts,
                            sampling: greedy(made[s]),
                        })
                        .collect();
                    self.graft.mark_step_begin();
                    let (graft, shape) = (&mut self.graft, (batch, width));
                    draft
                        .round(graft, self.round, self.model, &self.cache, &rows, shape)?
                        .rows
                }
                (_, None) => return Err("drafts from nowhere".into()),
            };
            for ((&s, v), &d) in active.iter().zip(&passes).zip(&drafted) {
                if let Some(a) = adaptive.as_deref_mut() {
                    a[s].observe(d, v.accepted);
                }
                run.accepted += v.accepted;
                run.rejected += usize::from(v.accepted < d);
                run.tokens[s].extend(v.tokens());
                history[s].extend(v.tokens());
            }
        }
        run.us = t.elapsed().as_secs_f64() * 1e6;
        Ok(run)
    }

    /// The median time of a verify pass of `k` drafts a sequence (all right: `want`), µs,
    /// over `passes` passes after one untimed.
    pub(crate) fn pass_us(
        &mut self,
        k: usize,
        want: &[Vec<u32>],
        passes: usize,
    ) -> BenchResult<f64> {
        self.start()?;
        let batch = self.batch();
        let active: Vec<usize> = (0..batch).collect();
        let mut history = self.prompts.clone();
        let mut times = Vec::with_capacity(passes);
        for i in 0..=passes {
            let at = i * (k + 1);
            let drafts: Vec<Vec<u32>> = want.iter().map(|w| w[at..at + k].to_vec()).collect();
            let made = vec![at; batch];
            let t = Instant::now();
            let v = self.pass(&active, &history, &drafts, &made, k)?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            for (s, v) in v.iter().enumerate() {
                history[s].extend(v.tokens());
            }
        }
        Ok(median(&mut times))
    }
}

/// Greedy picks, the first of them token number `index` of its sequence.
pub(crate) fn greedy(index: usize) -> SampleParams {
    SampleParams {
        index: index as u32,
        ..SampleParams::GREEDY
    }
}

/// The median µs of `model`'s replayed decode step over `batch` rows (50 steps after 5).
pub(crate) fn decode_us(model: &Decoder, batch: usize) -> BenchResult<f64> {
    let mut b = Bench::new(model, batch, 128)?;
    b.cache.reset()?;
    let tokens = vec![7u32; batch];
    let mut times = Vec::with_capacity(50);
    for i in 0..55 {
        let t = Instant::now();
        b.step(&tokens)?;
        if i >= 5 {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(median(&mut times))
}
