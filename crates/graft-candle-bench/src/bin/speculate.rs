//! graft-candle-speculate: speculative decoding's speedup against its acceptance rate, on a
//! random-weight Llama (~1B, or `--small`; bf16, or `--dtype`), batch 1, under graft.
//!
//! Plain greedy decoding first makes `--tokens` tokens after a prompt (one replayed decode
//! step and one host read per token) and is timed. Each speculative run then makes the same
//! number of tokens with verify passes ([`Decoder::verify`], one recording per draft count k)
//! whose drafts come from an oracle that knows the verify pass's own greedy tokens (passes of
//! the same draft count whose drafts are never right, made first) and corrupts each draft with probability 1 - α (so α is set,
//! not hoped for; random weights make any real drafter disagree), and, last, from prompt lookup over a prompt that repeats itself (α as it
//! falls). Drafting costs the device nothing here (c = 0), so the ideal speedup is
//! (1 - α^(k+1)) / (1 - α), evaluated at the measured α (accepted drafts over drafts tried
//! until the first rejection); a verify pass of k + 1 rows costs more than a decode step, and
//! that ratio (`pass / step`) is what keeps the achieved speedup under the ideal. An adaptive
//! run (the serving engine's [`AdaptiveDraft`], fed the measured pass costs) at α = 0 shows
//! what trying costs when nothing is accepted. Every run's tokens are compared with plain
//! decoding's: with a verify pass whose logits equal the decode step's they are the same.
//! Only with graft-candle-bench's `cuda` feature.
//!
//! usage: graft-candle-speculate [--small] [--dtype bf16|f16|f32] [--tokens N] [--ks 1,2,4,8] [--alphas 0,0.5,...]
//!                               [--rounds R] [--json PATH]

use std::time::Instant;

use graft_candle::candle_core::{DType, Tensor};
use graft_candle::{CandleGraft, StepId};
use graft_candle_bench::common::{BenchResult, Timing, exit_on_error, gpu, median, random_llama};
use graft_candle_kernels::SampleParams;
use graft_candle_models::speculate::{AdaptiveDraft, Verified, prompt_lookup};
use graft_candle_models::{Decoder, KvCache};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-speculate",
    about = "Speculative decoding's speedup against its acceptance rate"
)]
struct Options {
    /// The small Llama (d = 512, 4 layers) instead of the ~1B one.
    #[arg(long)]
    small: bool,
    /// The weights' dtype.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DType,
    /// Tokens each run makes after the prompt.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Draft counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    ks: Vec<usize>,
    /// Acceptance rates the oracle drafts at.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.7,0.8,0.9,1")]
    alphas: Vec<f64>,
    #[command(flatten)]
    timing: Timing,
}

/// The prompt: a phrase of 8 tokens said four times (prompt lookup finds its n-grams).
fn prompt() -> Vec<u32> {
    (0..32u32)
        .map(|i| [5, 17, 99, 3, 250, 1021, 7, 64][i as usize % 8])
        .collect()
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        "f32" => Ok(DType::F32),
        _ => Err(format!("unknown dtype {s}: use bf16, f16 or f32")),
    }
}

/// One run's result: the tokens, the wall time, and the drafts accepted and rejected.
struct Run {
    tokens: Vec<u32>,
    us: f64,
    accepted: usize,
    rejected: usize,
    passes: usize,
}

/// Where the drafts come from.
#[derive(Clone, Copy)]
enum Drafter<'a> {
    /// The tokens passes of the same draft count pick (`want`), each corrupted with
    /// probability 1 - α.
    Oracle { want: &'a [u32], alpha: f64 },
    /// Prompt lookup over the prompt and the tokens so far (3-grams).
    Lookup,
}

struct Bench {
    model: Decoder,
    cache: KvCache,
    graft: CandleGraft,
    decode: StepId,
    verify: StepId,
    prompt: Vec<u32>,
}

impl Bench {
    /// Empties the cache and decodes all but the prompt's last token (untimed).
    fn start(&mut self) -> BenchResult<()> {
        self.cache.reset()?;
        for i in 0..self.prompt.len() - 1 {
            self.step(self.prompt[i])?;
        }
        Ok(())
    }

    /// One greedy decode step of the sequence: the token after `last`.
    fn step(&mut self, last: u32) -> BenchResult<u32> {
        let t = Tensor::new(&[last], self.model.device())?;
        self.graft.mark_step_begin();
        let out = self
            .model
            .decode(&mut self.graft, self.decode, &self.cache, &t)?;
        Ok(out.outputs[0].to_vec1::<u32>()?[0])
    }

    /// One verify pass of the sequence: `last` and `drafts`, greedy, the first pick being
    /// token number `index` of the generation.
    fn pass(&mut self, last: u32, drafts: &[u32], index: usize) -> BenchResult<Verified> {
        let mut tokens = vec![last];
        tokens.extend(drafts);
        let tokens = Tensor::new(tokens.as_slice(), self.model.device())?;
        let sampling = SampleParams {
            index: index as u32,
            ..SampleParams::GREEDY
        };
        self.graft.mark_step_begin();
        Ok(self.model.verify(
            &mut self.graft,
            self.verify,
            &self.cache,
            0,
            &tokens,
            sampling,
        )?)
    }

    /// Plain greedy decoding of `n` tokens, timed.
    fn plain(&mut self, n: usize) -> BenchResult<Run> {
        self.start()?;
        let mut last = *self.prompt.last().ok_or("no prompt")?;
        let mut tokens = Vec::with_capacity(n);
        let t = Instant::now();
        while tokens.len() < n {
            last = self.step(last)?;
            tokens.push(last);
        }
        Ok(Run {
            tokens,
            us: t.elapsed().as_secs_f64() * 1e6,
            accepted: 0,
            rejected: 0,
            passes: n,
        })
    }

    /// The greedy tokens of verify passes of `k` drafts that are never right, `n` of them (or
    /// a few more): the tokens a pass of k + 1 rows picks, which the oracle drafts from. A
    /// pass's rows are computed independently of each other, but the kernels change with the
    /// number of rows (and the decode step runs others), so in bf16 these tokens may part
    /// from plain decoding's and from another k's.
    fn truth(&mut self, n: usize, k: usize) -> BenchResult<Vec<u32>> {
        self.start()?;
        let mut tokens: Vec<u32> = Vec::with_capacity(n + k);
        while tokens.len() < n {
            let last = *tokens.last().or(self.prompt.last()).ok_or("no prompt")?;
            // Token 0 as every draft: a right one now and then only adds the model's picks.
            let v = self.pass(last, &vec![0; k], tokens.len())?;
            tokens.extend(v.tokens());
        }
        Ok(tokens)
    }

    /// `n` tokens (or a few more: a pass's tokens are kept whole) by verify passes of `k`
    /// drafts from `drafter`, or of the count `adaptive` picks (a decode step when it picks
    /// none, as the serving engine does), timed.
    fn speculate(
        &mut self,
        n: usize,
        k: usize,
        drafter: Drafter<'_>,
        mut adaptive: Option<&mut AdaptiveDraft>,
        seed: u64,
    ) -> BenchResult<Run> {
        self.start()?;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut history = self.prompt.clone();
        let mut run = Run {
            tokens: Vec::with_capacity(n + k),
            us: 0.0,
            accepted: 0,
            rejected: 0,
            passes: 0,
        };
        let t = Instant::now();
        while run.tokens.len() < n {
            let last = *history.last().ok_or("no history")?;
            let k = adaptive.as_deref().map_or(k, AdaptiveDraft::next_k);
            let at = run.tokens.len();
            let drafts: Vec<u32> = match drafter {
                Drafter::Oracle { want, alpha } => want[at..at + k]
                    .iter()
                    .map(|&w| {
                        if rng.random::<f64>() < alpha {
                            w
                        } else {
                            w ^ 1
                        }
                    })
                    .collect(),
                Drafter::Lookup => prompt_lookup(&history, 3, k),
            };
            run.passes += 1;
            if drafts.is_empty() {
                if let Some(a) = adaptive.as_deref_mut() {
                    a.observe(0, 0);
                }
                let next = self.step(last)?;
                run.tokens.push(next);
                history.push(next);
                continue;
            }
            let v = self.pass(last, &drafts, at)?;
            if let Some(a) = adaptive.as_deref_mut() {
                a.observe(drafts.len(), v.accepted);
            }
            run.accepted += v.accepted;
            run.rejected += usize::from(v.accepted < drafts.len());
            run.tokens.extend(v.tokens());
            history.extend(v.tokens());
        }
        run.us = t.elapsed().as_secs_f64() * 1e6;
        Ok(run)
    }

    /// The median device time of a verify pass of `k` drafts (all accepted, so every pass
    /// covers k + 1 new positions), µs, over `passes` passes after one untimed.
    fn pass_us(&mut self, k: usize, want: &[u32], passes: usize) -> BenchResult<f64> {
        self.start()?;
        let mut last = *self.prompt.last().ok_or("no prompt")?;
        let mut times = Vec::with_capacity(passes);
        for i in 0..=passes {
            let at = i * (k + 1);
            let t = Instant::now();
            let v = self.pass(last, &want[at..at + k], at)?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            last = *v.tokens().last().ok_or("a pass made no token")?;
        }
        Ok(median(&mut times))
    }
}

/// The leading tokens of `got` equal to `want`'s.
fn agreeing(got: &[u32], want: &[u32]) -> usize {
    got.iter().zip(want).take_while(|(a, b)| a == b).count()
}

/// The ideal speedup of k drafts at acceptance α when drafting is free.
fn ideal(alpha: f64, k: usize) -> f64 {
    if alpha >= 1.0 {
        (k + 1) as f64
    } else {
        (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
    }
}

fn main() {
    exit_on_error("graft-candle-speculate", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    let device = gpu()?;
    let model = random_llama(!o.small, o.dtype, &device)?;
    let kmax = o.ks.iter().copied().max().unwrap_or(0);
    let n = o.tokens;
    let mut graft = CandleGraft::new(&device)?;
    let decode = graft.register("decode");
    let verify = graft.register("verify");
    let prompt = prompt();
    // Room for the prompt, the tokens, a pass's overshoot and the pass-cost runs.
    let max_seq = (prompt.len() + 2 * n + 16 * (kmax + 1) + 64).next_power_of_two();
    let cache = model.new_serving_cache(1, max_seq)?;
    let mut b = Bench {
        model,
        cache,
        graft,
        decode,
        verify,
        prompt,
    };
    // Plain decoding (this also warms up and records the decode step).
    let plain_tokens = b.plain(n)?.tokens;
    let mut plain = Vec::new();
    for _ in 0..o.timing.rounds {
        let r = b.plain(n)?;
        if r.tokens != plain_tokens {
            return Err("plain decoding changed its tokens between runs".into());
        }
        plain.push(r.us / n as f64);
    }
    let step_us = median(&mut plain);
    // Each draft count's own greedy tokens, with room for the oracle's drafts past the last.
    let mut truths = Vec::with_capacity(kmax + 1);
    for k in 0..=kmax {
        let want = b.truth(n + 16 * (kmax + 1), k)?;
        println!(
            "{:?}: the greedy tokens of passes of {k} drafts equal plain decoding's for the first {} of {n}",
            o.dtype,
            agreeing(&want, &plain_tokens)
        );
        truths.push(want);
    }
    // Each pass's cost against the step (the passes without drafts recorded every count).
    let mut costs = vec![1.0];
    for (k, want) in truths.iter().enumerate().skip(1) {
        costs.push(b.pass_us(k, want, 12)? / step_us);
    }
    println!("plain decoding: {step_us:.1} us a token; a verify pass of k drafts / a step:");
    for (k, c) in costs.iter().enumerate().skip(1) {
        println!("  k = {k}: {c:.3}");
    }
    println!(
        "{:>10} {:>3} {:>7} {:>8} {:>12} {:>8} {:>7} {:>9} {:>10}",
        "drafter", "k", "alpha", "tok/pass", "us/token", "speedup", "ideal", "ach/ideal", "agree"
    );
    let mut rows = Vec::new();
    let mut cases: Vec<(String, usize, Option<f64>)> = Vec::new();
    for &k in &o.ks {
        for &alpha in &o.alphas {
            cases.push(("oracle".into(), k, Some(alpha)));
        }
    }
    cases.push(("adaptive".into(), kmax, Some(0.0)));
    cases.push(("lookup".into(), 4.min(kmax.max(1)), None));
    for (name, k, alpha) in cases {
        let mut us = Vec::new();
        let mut last = None;
        for round in 0..o.timing.rounds {
            let drafter = match alpha {
                Some(alpha) => Drafter::Oracle {
                    want: &truths[k],
                    alpha,
                },
                None => Drafter::Lookup,
            };
            let mut adaptive =
                (name == "adaptive").then(|| AdaptiveDraft::new(costs.clone(), 0.5, 0.8, 16));
            let r = b.speculate(n, k, drafter, adaptive.as_mut(), round as u64)?;
            us.push(r.us / r.tokens.len() as f64);
            last = Some(r);
        }
        let r = last.ok_or("no rounds: pass --rounds 1 or more")?;
        let us = median(&mut us);
        let tried = r.accepted + r.rejected;
        let measured = if tried > 0 {
            r.accepted as f64 / tried as f64
        } else {
            0.0
        };
        let speedup = step_us / us;
        let best = if name == "adaptive" {
            1.0
        } else {
            ideal(measured, k)
        };
        let agree = agreeing(&r.tokens, &plain_tokens);
        println!(
            "{name:>10} {k:>3} {measured:>7.3} {:>8.2} {us:>12.1} {speedup:>8.2} {best:>7.2} {:>9.2} {:>6}/{}",
            r.tokens.len() as f64 / r.passes as f64,
            speedup / best,
            agree,
            r.tokens.len().min(n),
        );
        rows.push(
            serde_json::json!({
                "dtype": format!("{:?}", o.dtype), "drafter": name, "k": k, "alpha_set": alpha, "alpha": measured,
                "tokens_per_pass": r.tokens.len() as f64 / r.passes as f64,
                "us_per_token": us, "plain_us_per_token": step_us, "speedup": speedup,
                "ideal": best, "achieved_over_ideal": speedup / best,
                "pass_over_step": costs.get(k), "agreeing_tokens": agree,
            })
            .to_string(),
        );
    }
    if let Some(g) = b.graft.graft() {
        let s = g.stats();
        println!(
            "graft: {} recordings, {} replays, {} eager runs",
            s.recordings, s.replays, s.eager_runs
        );
        if s.eager_runs > 0 {
            return Err(format!(
                "{} calls ran eagerly: {:?}",
                s.eager_runs,
                g.guard_findings()
            )
            .into());
        }
    }
    o.timing.write_json(&rows)
}
