//! graft-candle-speculate: speculative decoding's speedup against its acceptance rate α and
//! its draft cost c, on a random-weight Llama (~1B, or `--small`; bf16, or `--dtype`), for
//! `--batch` sequences at once, under graft.
//!
//! Plain greedy decoding first makes `--tokens` tokens a sequence after a prompt (one replayed
//! decode step of the batch and one host read per token) and is timed. Then:
//!
//! - **Free drafts (c = 0)**: verify passes ([`Decoder::verify_rows`], one recording per
//!   draft count k) of drafts from an oracle that knows the pass's own greedy tokens (passes
//!   whose drafts are never right, made first) and corrupts each with probability 1 - α, so
//!   α is set, not hoped for (random weights make any real drafter disagree); an adaptive run
//!   (the engine's [`AdaptiveDraft`] per sequence, fed the measured pass costs) at α = 0; and
//!   prompt lookup over prompts that repeat themselves.
//! - **A draft model in the launch** (`--eps`): rounds ([`DraftModel::round`]: the draft's k
//!   steps and the verify pass in one replay) with a draft of the target's own first
//!   `--draft-layers` layers (sharing their weights, its final norm and head). α is set by
//!   the target: its later layers' output projections (attention's and the MLP's) are scaled
//!   by ε, so at ε = 0 the draft computes the target's logits and every draft is right, and
//!   as ε grows the later layers move the target's picks away from the draft's. Every target
//!   costs the same (same shapes); c is the draft's decode step over the target's, measured.
//!
//! The ideal speedup is (1 - α^(k+1)) / ((1 - α)(k c + 1)) at the measured α (accepted
//! drafts over drafts tried until the first rejection), averaged over the passes by the
//! drafts each actually had where that is fewer than k (prompt lookup). Every run's tokens
//! are compared with plain decoding's of the same target. Only with graft-candle-bench's
//! `cuda` feature.
//!
//! usage: graft-candle-speculate [--small] [--dtype bf16|f16|f32] [--batch B] [--tokens N]
//!                               [--ks 1,2,4,8] [--alphas 0,0.5,...] [--eps 0,0.1,...]
//!                               [--skip-free] [--draft-layers L] [--rounds R] [--json PATH]

#[path = "speculate/bench.rs"]
mod bench;

use std::collections::HashMap;

use bench::{Bench, Drafter, Run, decode_us, prompt};
use graft_candle::CandleGraft;
use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle_bench::common::{
    BenchResult, Timing, exit_on_error, gpu, load_llama, median, random_llama_weights,
};
use graft_candle_models::Decoder;
use graft_candle_models::speculate::{AdaptiveDraft, DraftModel};

#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-speculate",
    about = "Speculative decoding's speedup against its acceptance rate and draft cost"
)]
struct Options {
    /// The small Llama (d = 512, 4 layers) instead of the ~1B one.
    #[arg(long)]
    small: bool,
    /// The weights' dtype.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: DType,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens each run makes after each prompt.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Draft counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    ks: Vec<usize>,
    /// Acceptance rates the oracle drafts at.
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,0.8,0.9,1")]
    alphas: Vec<f64>,
    /// No free-draft runs (oracle, adaptive, prompt lookup).
    #[arg(long)]
    skip_free: bool,
    /// Scales of the target's later layers for the draft-model rounds (none: no rounds).
    #[arg(long, value_delimiter = ',')]
    eps: Vec<f64>,
    /// The draft model's layers: the target's first ones.
    #[arg(long, default_value_t = 2)]
    draft_layers: usize,
    #[command(flatten)]
    timing: Timing,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        "f32" => Ok(DType::F32),
        _ => Err(format!("unknown dtype {s}: use bf16, f16 or f32")),
    }
}

/// Leading tokens of every sequence's `got` equal to `want`'s, summed, and the sequences
/// whose first `n` all agree.
fn agreeing(got: &[Vec<u32>], want: &[Vec<u32>], n: usize) -> (usize, usize) {
    let leading: Vec<usize> = got
        .iter()
        .zip(want)
        .map(|(g, w)| g.iter().zip(w).take(n).take_while(|(a, b)| a == b).count())
        .collect();
    (
        leading.iter().sum(),
        leading.iter().filter(|&&l| l == n).count(),
    )
}

/// The ideal speedup at acceptance α when a draft step costs c target steps, over passes of
/// `drafted[d]` sequences with d drafts each: the tokens they make, (1 - α^(d+1)) / (1 - α)
/// each, over the steps they cost, 1 + d c each. With k drafts in every pass, (1 -
/// α^(k+1)) / ((1 - α)(k c + 1)).
fn ideal(alpha: f64, drafted: &[usize], c: f64) -> f64 {
    let (mut tokens, mut steps) = (0.0, 0.0);
    for (d, &n) in drafted.iter().enumerate() {
        let made = if alpha >= 1.0 {
            (d + 1) as f64
        } else {
            (1.0 - alpha.powi(d as i32 + 1)) / (1.0 - alpha)
        };
        tokens += n as f64 * made;
        steps += n as f64 * (d as f64 * c + 1.0);
    }
    if steps > 0.0 { tokens / steps } else { 1.0 }
}

/// What the table's rows share.
struct Row<'a> {
    drafter: &'a str,
    k: usize,
    set: Option<f64>,
    c: f64,
}

/// Prints and records one run against plain decoding.
fn report(
    row: &Row<'_>,
    runs: &mut [f64],
    r: &Run,
    plain: &Run,
    step_us: f64,
    n: usize,
    json: &mut Vec<String>,
) {
    let us = median(runs);
    let alpha = r.alpha();
    let speedup = step_us / us;
    let best = if row.drafter == "adaptive" {
        1.0
    } else {
        ideal(alpha, &r.drafted, row.c)
    };
    let (agree, equal) = agreeing(&r.tokens, &plain.tokens, n);
    let batch = r.tokens.len();
    let per_pass = r.tokens.iter().map(Vec::len).sum::<usize>() as f64 / r.passes as f64;
    let set = row.set.map_or("-".into(), |a| format!("{a}"));
    println!(
        "{:>9} {:>3} {set:>6} {alpha:>7.3} {:>6.3} {per_pass:>8.2} {us:>10.1} {speedup:>8.2} {best:>7.2} {:>9.2} {agree:>5}/{} {equal:>3}/{batch}",
        row.drafter,
        row.k,
        row.c,
        speedup / best,
        n * batch,
    );
    json.push(
        serde_json::json!({
            "drafter": row.drafter, "k": row.k, "set": row.set, "alpha": alpha, "c": row.c,
            "batch": batch, "tokens_per_pass": per_pass, "us_per_token": us,
            "plain_us_per_token": step_us, "speedup": speedup, "ideal": best,
            "achieved_over_ideal": speedup / best, "agreeing_tokens": agree,
            "equal_sequences": equal,
        })
        .to_string(),
    );
}

fn main() {
    exit_on_error("graft-candle-speculate", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    let device = gpu()?;
    let (cfg, weights) = random_llama_weights(!o.small, o.dtype, &device)?;
    let kmax = o.ks.iter().copied().max().unwrap_or(1);
    let n = o.tokens;
    // Room for the prompt, the tokens, a pass's overshoot and the pass-cost runs.
    let max_seq = (prompt(0).len() + 2 * n + 16 * (kmax + 1) + 64).next_power_of_two();
    println!(
        "{:?}, batch {}, {n} tokens a sequence; speedup = plain decoding's us a token / the run's",
        o.dtype, o.batch
    );
    println!(
        "{:>9} {:>3} {:>6} {:>7} {:>6} {:>8} {:>10} {:>8} {:>7} {:>9} {:>11} {:>5}",
        "drafter",
        "k",
        "set",
        "alpha",
        "c",
        "tok/pass",
        "us/token",
        "speedup",
        "ideal",
        "ach/ideal",
        "agree",
        "equal"
    );
    let mut json = Vec::new();
    if !o.skip_free {
        let model = load_llama(&cfg, weights.clone(), o.dtype, &device)?;
        free_drafts(&o, &model, max_seq, &mut json)?;
    }
    for &eps in &o.eps {
        drafted(&o, &cfg, &weights, eps, max_seq, &device, &mut json)?;
    }
    o.timing.write_json(&json)
}

/// Plain decoding `--rounds` times (the first also records the step): the tokens and the
/// median µs a token.
fn plain_runs(b: &mut Bench<'_>, o: &Options) -> BenchResult<(Run, f64)> {
    let first = b.plain(o.tokens)?;
    let mut us = Vec::new();
    for _ in 0..o.timing.rounds {
        let r = b.plain(o.tokens)?;
        if r.tokens != first.tokens {
            return Err("plain decoding changed its tokens between runs".into());
        }
        us.push(r.us / o.tokens as f64);
    }
    Ok((first, median(&mut us)))
}

/// The free-draft runs (oracle, adaptive, prompt lookup) on the unscaled target.
fn free_drafts(
    o: &Options,
    model: &Decoder,
    max_seq: usize,
    json: &mut Vec<String>,
) -> BenchResult<()> {
    let n = o.tokens;
    let mut b = Bench::new(model, o.batch, max_seq)?;
    let (plain, step_us) = plain_runs(&mut b, o)?;
    // Each draft count's own greedy tokens, with room for the oracle's drafts past the last.
    let mut truths = HashMap::new();
    for k in 1..=o.ks.iter().copied().max().unwrap_or(1) {
        let want = b.truth(n + 16 * (k + 1), k)?;
        let (agree, _) = agreeing(&want, &plain.tokens, n);
        println!(
            "  passes of {k} drafts pick plain decoding's tokens for {agree} of {}",
            n * o.batch
        );
        truths.insert(k, want);
    }
    // Indexed by k; no drafts is a plain step (the adaptive rule's model, not measured).
    let mut costs = vec![1.0];
    for k in 1..=o.ks.iter().copied().max().unwrap_or(1) {
        costs.push(b.pass_us(k, &truths[&k], 12)? / step_us);
    }
    println!(
        "  plain decoding: {step_us:.1} us a token; a pass of k = 1, 2, ... drafts / a step: {:.3?}",
        &costs[1..]
    );
    let mut cases: Vec<(&str, usize, Option<f64>)> = Vec::new();
    for &k in &o.ks {
        for &alpha in &o.alphas {
            cases.push(("oracle", k, Some(alpha)));
        }
    }
    let kmax = o.ks.iter().copied().max().unwrap_or(1);
    cases.push(("adaptive", kmax, Some(0.0)));
    cases.push(("lookup", 4.min(kmax), None));
    for (name, k, alpha) in cases {
        let mut us = Vec::new();
        let mut last = None;
        for round in 0..o.timing.rounds {
            let drafter = match alpha {
                Some(alpha) => Drafter::Oracle {
                    want: &truths[&k],
                    alpha,
                },
                None => Drafter::Lookup,
            };
            let mut adaptive: Vec<AdaptiveDraft> = (0..o.batch)
                .map(|_| AdaptiveDraft::new(costs.clone(), 0.5, 0.8, 16))
                .collect();
            let adaptive = (name == "adaptive").then_some(adaptive.as_mut_slice());
            let r = b.speculate(n, k, drafter, adaptive, round as u64)?;
            us.push(r.us / n as f64);
            last = Some(r);
        }
        let r = last.ok_or("no rounds: pass --rounds 1 or more")?;
        let row = Row {
            drafter: name,
            k,
            set: alpha,
            c: 0.0,
        };
        report(&row, &mut us, &r, &plain, step_us, n, json);
    }
    check_graphed(&b.graft)
}

/// The draft-model rounds on the target whose later layers are scaled by `eps`, the draft
/// its first `--draft-layers` layers.
fn drafted(
    o: &Options,
    cfg: &candle_transformers::models::llama::Config,
    weights: &HashMap<String, Tensor>,
    eps: f64,
    max_seq: usize,
    device: &Device,
    json: &mut Vec<String>,
) -> BenchResult<()> {
    let layers = o.draft_layers;
    if layers == 0 || layers >= cfg.num_hidden_layers {
        return Err(format!(
            "--draft-layers {layers}: the draft takes 1 to {} of the target's layers",
            cfg.num_hidden_layers - 1
        )
        .into());
    }
    let mut scaled = weights.clone();
    for (name, w) in &mut scaled {
        let late = (layers..cfg.num_hidden_layers).any(|i| {
            name.starts_with(&format!("model.layers.{i}."))
                && (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight"))
        });
        if late {
            *w = w.affine(eps, 0.0)?;
        }
    }
    let target = load_llama(cfg, scaled, o.dtype, device)?;
    let mut draft_cfg = cfg.clone();
    draft_cfg.num_hidden_layers = layers;
    let draft = load_llama(&draft_cfg, weights.clone(), o.dtype, device)?;
    let c = decode_us(&draft, o.batch)? / decode_us(&target, o.batch)?;
    let n = o.tokens;
    let mut b = Bench::new(&target, o.batch, max_seq)?;
    let (plain, step_us) = plain_runs(&mut b, o)?;
    let vocab = target.spec().vocab;
    for &k in &o.ks {
        let mut d = DraftModel::new(&draft, vocab, o.batch, max_seq)?;
        // The first run records the round.
        b.speculate(n, k, Drafter::Rounds(&mut d), None, 0)?;
        let mut us = Vec::new();
        let mut last = None;
        for round in 0..o.timing.rounds {
            let r = b.speculate(n, k, Drafter::Rounds(&mut d), None, round as u64)?;
            us.push(r.us / n as f64);
            last = Some(r);
        }
        let r = last.ok_or("no rounds: pass --rounds 1 or more")?;
        let row = Row {
            drafter: "draft",
            k,
            set: Some(eps),
            c,
        };
        report(&row, &mut us, &r, &plain, step_us, n, json);
    }
    check_graphed(&b.graft)
}

/// Fails when a call ran eagerly after its warmups (a refused or unguarded recording).
fn check_graphed(graft: &CandleGraft) -> BenchResult<()> {
    if let Some(g) = graft.graft() {
        let s = g.stats();
        println!(
            "  graft: {} recordings, {} replays, {} eager runs",
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
    Ok(())
}
