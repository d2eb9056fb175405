//! graft-candle-bench: the Llama port's decode step (random weights) on the GPU, per step at batch 1, 8 and 32,
//! in one run: candle eager, a hand-made single CUDA graph of the same step (copy-free: it
//! reads and overwrites one fixed token tensor, one launch per token), and graft-candle;
//! then the ~1B-parameter bf16 model at batch 1, eager against graft-candle.
//!
//! Each variant first runs 64 steps from the same tokens and its tokens are checked equal to
//! eager's; then it is timed: each step is one call followed by a synchronize of candle's
//! stream, timed on the host; variants alternate in rounds so drift spreads evenly; the
//! figure is the median step. Only with graft-candle-bench's `cuda` feature (GPU only).
//!
//! usage: graft-candle-bench [--steps N] [--rounds R] [--skip-1b] [--json PATH] (`graft demo`
//! runs it, short, when it sits next to the `graft` binary and a GPU is present)

use std::time::Instant;

use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle::{Buckets, CandleGraft, StepId};
use graft_candle_bench::HandmadeGraph;
use graft_candle_bench::common::{BUCKETS, BenchResult, Timing, median};
use graft_candle_bench::decode::{CHECK_STEPS, first_tokens};
use graft_candle_models::llama::{self, Sizes};
use graft_candle_models::{Decoder, KvCache};

/// The benchmark's flags.
#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-bench",
    about = "The Llama-style candle decode step: eager, a hand-made graph and graft-candle"
)]
struct Options {
    /// Timed steps per variant (split over the rounds).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    #[command(flatten)]
    timing: Timing,
    /// Leave out the ~1B-parameter bf16 model.
    #[arg(long)]
    skip_1b: bool,
}

/// One way of running the step.
enum Runner<'m> {
    Eager,
    Handmade(HandmadeGraph),
    /// graft-candle: the port's own decode step, its tokens decoded in place in one tensor
    /// as the hand-made graph's (`Decoder::decode_into`), with the statics made once.
    Graft(&'m mut CandleGraft, StepId, Vec<&'m Tensor>),
    /// graft-candle's `call` path: a fresh output tensor per step fed back as the next input,
    /// the statics listed per call (`Decoder::decode`), as before `call_into`.
    GraftFresh(&'m mut CandleGraft, StepId),
}

impl Runner<'_> {
    fn name(&self) -> &'static str {
        match self {
            Runner::Eager => "candle eager",
            Runner::Handmade(_) => "hand-made graph",
            Runner::Graft(..) => "graft-candle",
            Runner::GraftFresh(..) => "graft-candle (fresh outputs)",
        }
    }

    fn step(&mut self, model: &Decoder, cache: &KvCache, tokens: &Tensor) -> BenchResult<Tensor> {
        Ok(match self {
            Runner::Eager => model.greedy(cache, tokens)?,
            Runner::Handmade(graph) => {
                // The graph reads its own last tokens: `tokens` holds the same values.
                graph.launch()?;
                graph.tokens().clone()
            }
            Runner::Graft(graft, step, statics) => {
                model.decode_into(graft, *step, cache, statics, tokens, tokens)?;
                tokens.clone()
            }
            Runner::GraftFresh(graft, step) => {
                let out = model.decode(graft, *step, cache, tokens)?;
                out.outputs
                    .into_iter()
                    .next()
                    .ok_or("the step returned no output")?
            }
        })
    }
}

/// What one measurement found: each runner's median step in microseconds, the median host
/// time of its call alone (until the call returns, before the synchronize: what the host
/// spends before the GPU can start, for a graph its launch and everything graft-candle does
/// around it), and the first step at which its tokens differed from eager's, if any.
struct Measured {
    us: Vec<f64>,
    host_us: Vec<f64>,
    differs: Vec<Option<usize>>,
}

/// Checks every runner's tokens against eager's for `CHECK_STEPS` steps, then times them in
/// alternating rounds.
fn measure(
    model: &Decoder,
    device: &Device,
    batch: usize,
    runners: &mut [(Runner<'_>, &KvCache)],
    o: &Options,
) -> BenchResult<Measured> {
    let vocab = model.spec().vocab;
    let eager_state = model.new_cache(batch, model.spec().rope.max_positions)?;
    let mut eager = first_tokens(batch, vocab, device)?;
    let mut tokens: Vec<Tensor> = Vec::new();
    for (_, state) in runners.iter() {
        state.reset()?;
        tokens.push(first_tokens(batch, vocab, device)?);
    }
    let mut differs = vec![None; runners.len()];
    for i in 0..CHECK_STEPS {
        eager = model.greedy(&eager_state, &eager)?;
        let want = eager.to_vec1::<u32>()?;
        for (((runner, state), t), first) in runners
            .iter_mut()
            .zip(tokens.iter_mut())
            .zip(differs.iter_mut())
        {
            *t = runner.step(model, state, t)?;
            if first.is_none() && t.to_vec1::<u32>()? != want {
                eprintln!(
                    "{} at batch {batch}: step {i} differs from eager",
                    runner.name()
                );
                *first = Some(i);
            }
        }
    }
    let per_round = o.timing.per_round(o.steps)?;
    let mut samples = vec![Vec::with_capacity(o.steps); runners.len()];
    let mut host = vec![Vec::with_capacity(o.steps); runners.len()];
    for _ in 0..o.timing.rounds {
        for ((((runner, state), t), times), host) in runners
            .iter_mut()
            .zip(tokens.iter_mut())
            .zip(samples.iter_mut())
            .zip(host.iter_mut())
        {
            state.reset()?;
            // A few untimed steps to settle after the switch.
            for _ in 0..5 {
                *t = runner.step(model, state, t)?;
            }
            device.synchronize()?;
            for _ in 0..per_round {
                let start = Instant::now();
                *t = runner.step(model, state, t)?;
                host.push(start.elapsed().as_secs_f64() * 1e6);
                device.synchronize()?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let us = samples.iter_mut().map(|s| median(s)).collect();
    let host_us = host.iter_mut().map(|s| median(s)).collect();
    Ok(Measured {
        us,
        host_us,
        differs,
    })
}

/// "identical" or where the tokens first differed, for each runner after the first.
fn tokens_note(m: &Measured) -> String {
    let bad: Vec<String> = m
        .differs
        .iter()
        .enumerate()
        .filter_map(|(i, d)| d.map(|step| format!("variant {i} differs from step {step}")))
        .collect();
    if bad.is_empty() {
        "tokens identical".to_string()
    } else {
        format!("TOKENS DIFFER: {}", bad.join(", "))
    }
}

fn main() {
    graft_candle_bench::common::exit_on_error("graft-candle-bench", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    o.timing.per_round(o.steps)?;
    let device = graft_candle_bench::common::gpu()?;
    let cuda = device.as_cuda_device()?.clone();
    let mut rows = Vec::new();
    let mut json = Vec::new();

    let sizes = Sizes::BENCH;
    let model = llama::random(&sizes, 1234, DType::F32, &device)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register_bucketed("decode", Buckets::new(BUCKETS)?);
    let mut fresh = CandleGraft::new(&device)?;
    let fresh_step = fresh.register_bucketed("decode", Buckets::new(BUCKETS)?);
    println!(
        "decode step, {sizes}, F32; {} timed steps per variant in {} rounds, median",
        o.steps, o.timing.rounds
    );
    let mut failed = false;
    for batch in BUCKETS {
        let mut one = || -> BenchResult<Measured> {
            let cache = || model.new_cache(batch, sizes.max_positions);
            let (eager_state, handmade_state) = (cache()?, cache()?);
            let (graft_state, fresh_state) = (cache()?, cache()?);
            let example = first_tokens(batch, sizes.vocab, &device)?;
            let handmade =
                HandmadeGraph::capture(&cuda, &example, |t| model.greedy(&handmade_state, t))?;
            let statics = model.statics(&graft_state);
            let mut runners = vec![
                (Runner::Eager, &eager_state),
                (Runner::Handmade(handmade), &handmade_state),
                (Runner::Graft(&mut graft, step, statics), &graft_state),
                (Runner::GraftFresh(&mut fresh, fresh_step), &fresh_state),
            ];
            measure(&model, &device, batch, &mut runners, &o)
        };
        let m = match one() {
            Ok(m) => m,
            Err(e) => {
                failed = true;
                rows.push(format!("B={batch:<3} failed: {e}"));
                println!("{}", rows.last().map_or("", String::as_str));
                continue;
            }
        };
        failed |= m.differs.iter().any(Option::is_some);
        let (eager, hand, ours, fresh) = (m.us[0], m.us[1], m.us[2], m.us[3]);
        let (hand_host, ours_host, fresh_host) = (m.host_us[1], m.host_us[2], m.host_us[3]);
        rows.push(format!(
            "B={batch:<3} eager {eager:8.1} us   hand-made graph {hand:8.1} us   graft-candle {ours:8.1} us   eager/graft {:.2}x   graft/hand-made {:.3}   host per call: hand-made {hand_host:.1} us, graft-candle {ours_host:.1} us   (fresh outputs: {fresh:.1} us, {:.3}, host {fresh_host:.1} us)   {}",
            eager / ours,
            ours / hand,
            fresh / hand,
            tokens_note(&m)
        ));
        json.push(format!(
            "{{\"model\":\"bench\",\"batch\":{batch},\"eager_us\":{eager:.1},\"handmade_us\":{hand:.1},\"graft_us\":{ours:.1},\"graft_fresh_us\":{fresh:.1},\"handmade_host_us\":{hand_host:.1},\"graft_host_us\":{ours_host:.1},\"graft_fresh_host_us\":{fresh_host:.1},\"tokens_identical\":{}}}",
            m.differs.iter().all(Option::is_none)
        ));
        println!("{}", rows.last().map_or("", String::as_str));
    }
    if let Some(stats) = graft.graft().map(|g| g.stats()) {
        println!(
            "graft: {} recordings, {} replays, {} warmups, {} eager",
            stats.recordings, stats.replays, stats.warmups, stats.eager_runs
        );
    }
    drop(graft);
    drop(model);

    if !o.skip_1b {
        let one_b = || -> BenchResult<Measured> {
            let sizes = Sizes::ONE_B;
            let started = Instant::now();
            let model = llama::random(&sizes, 1234, DType::BF16, &device)?;
            println!(
                "~1B model: {sizes}, BF16 (weights made in {:.1} s)",
                started.elapsed().as_secs_f64()
            );
            let mut graft = CandleGraft::new(&device)?;
            let step = graft.register("decode-1b");
            let cache = || model.new_cache(1, sizes.max_positions);
            let (eager_state, graft_state) = (cache()?, cache()?);
            let statics = model.statics(&graft_state);
            let mut runners = vec![
                (Runner::Eager, &eager_state),
                (Runner::Graft(&mut graft, step, statics), &graft_state),
            ];
            measure(&model, &device, 1, &mut runners, &o)
        };
        match one_b() {
            Ok(m) => {
                failed |= m.differs.iter().any(Option::is_some);
                rows.push(format!(
                    "1B B=1 eager {:8.1} us   graft-candle {:8.1} us   eager/graft {:.2}x   {}",
                    m.us[0],
                    m.us[1],
                    m.us[0] / m.us[1],
                    tokens_note(&m)
                ));
                json.push(format!(
                    "{{\"model\":\"1b-bf16\",\"batch\":1,\"eager_us\":{:.1},\"graft_us\":{:.1},\"tokens_identical\":{}}}",
                    m.us[0],
                    m.us[1],
                    m.differs.iter().all(Option::is_none)
                ));
            }
            Err(e) => {
                failed = true;
                rows.push(format!("1B B=1 failed: {e}"));
            }
        }
        println!("{}", rows.last().map_or("", String::as_str));
    }
    println!("\nsummary (tokens of every variant checked against eager over {CHECK_STEPS} steps):");
    for row in &rows {
        println!("  {row}");
    }
    o.timing.write_json(&json)?;
    if failed {
        return Err("a variant failed or its tokens differed from eager's (see above)".into());
    }
    Ok(())
}
