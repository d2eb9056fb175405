//! graft-candle-generate: K tokens per launch in a device loop (a CUDA conditional node)
//! against one replayed launch per token with a host read of each token (what a server runs
//! today), on a random-weight Llama of candle-transformers' config (small in f32, or the ~1B
//! one in bf16 with `--big`), at batch 1, 8 and 32.
//!
//! Per batch: both paths first generate from the same tokens and must give the same tokens;
//! then each is timed over `--launches` loop launches (and as many tokens per step), the
//! paths alternating in rounds, medians per token. The floor is the step's device time: the
//! same per-step replays with no host read between them, synchronized once at the end.
//! Greedy; `--k` tokens per launch (32 by default). Only with graft-candle-bench's `cuda` feature.
//!
//! usage: graft-candle-generate [--big] [--k K] [--launches N] [--rounds R] [--json PATH]

use std::time::Instant;

use graft_candle::candle_core::{DType, Tensor};
use graft_candle::{CandleGraft, StepOutcome};
use graft_candle_bench::common::{BUCKETS, BenchResult, Timing, median, random_llama};
use graft_candle_models::{GenerateSpec, Generation, Sampling};

#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-generate",
    about = "K tokens per launch in a device loop against one replay per token"
)]
struct Options {
    /// Tokens per launch.
    #[arg(long, default_value_t = 32)]
    k: usize,
    /// Timed loop launches per path and batch (split over the rounds).
    #[arg(long, default_value_t = 12)]
    launches: usize,
    /// The ~1B Llama in bf16 (the decode benchmarks' shape) instead of the small one in f32.
    #[arg(long)]
    big: bool,
    #[command(flatten)]
    timing: Timing,
}

fn main() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    let per_round = o.timing.per_round(o.launches)?;
    let device = graft_candle::device(0)?;
    let dtype = if o.big { DType::BF16 } else { DType::F32 };
    let model = random_llama(o.big, dtype, &device)?;
    let spec = GenerateSpec {
        max_tokens: o.k,
        eos: None,
        sampling: Sampling::Greedy,
    };
    let max_seq = 3 * o.k * per_round + 4 * o.k + 2;
    let mut rows = Vec::new();
    println!(
        "K = {} tokens per launch, greedy; per token, median of {} launches",
        o.k, o.launches
    );
    println!(
        "{:>5} {:>14} {:>12} {:>8} {:>12} {:>14}",
        "batch", "per-step (us)", "loop (us)", "ratio", "floor (us)", "overhead (us)"
    );
    for batch in BUCKETS {
        let mut graft = CandleGraft::new(&device)?;
        let looped = graft.register("generate");
        let stepped = graft.register("generate_step");
        let floor_step = graft.register("floor_step");
        let cache = model.new_cache(batch, max_seq)?;
        let g = Generation::new(&device, batch, spec)?;
        let start = Tensor::new(vec![5u32; batch].as_slice(), &device)?;
        // Equal tokens first (this also warms up and records both paths).
        let (a, out) = model.generate(&mut graft, looped, &cache, &g, None, &start)?;
        let b = model.generate_per_step(&mut graft, stepped, &cache, &g, None, &start)?;
        if a.len() != b.len() {
            return Err("the loop and the per-step path produced different token counts".into());
        }
        let _ = out;
        cache.reset()?;
        let (mut per_step, mut looped_t, mut floor) = (Vec::new(), Vec::new(), Vec::new());
        let mut replayed = 0;
        for _ in 0..o.timing.rounds {
            for _ in 0..per_round {
                let t = Instant::now();
                let (tokens, step) =
                    model.generate(&mut graft, looped, &cache, &g, None, &start)?;
                looped_t.push(t.elapsed().as_secs_f64() * 1e6 / tokens.len() as f64);
                replayed += usize::from(matches!(step.outcome, StepOutcome::Replayed(_)));
                let t = Instant::now();
                let tokens =
                    model.generate_per_step(&mut graft, stepped, &cache, &g, None, &start)?;
                per_step.push(t.elapsed().as_secs_f64() * 1e6 / tokens.len() as f64);
                let t = Instant::now();
                model.generate_steps_unread(&mut graft, floor_step, &cache, &g, None, &start)?;
                device.synchronize()?;
                floor.push(t.elapsed().as_secs_f64() * 1e6 / o.k as f64);
            }
            cache.reset()?;
        }
        let (s, l, f) = (
            median(&mut per_step),
            median(&mut looped_t),
            median(&mut floor),
        );
        println!(
            "{batch:>5} {s:>14.1} {l:>12.1} {:>8.2} {f:>12.1} {:>14.2}",
            s / l,
            l - f
        );
        if replayed == 0 {
            return Err("the loop never replayed".into());
        }
        rows.push(
            serde_json::json!({
                "batch": batch, "k": o.k, "per_step_us": s, "loop_us": l, "ratio": s / l,
                "floor_us": f, "overhead_per_iteration_us": l - f,
            })
            .to_string(),
        );
    }
    o.timing.write_json(&rows)
}
