//! What a rank and the one-GPU run both measure on a decoder (whole or one rank's part): the
//! tokens of greedy decode steps under graft-candle, and graft-candle's step time against a
//! hand-made single CUDA graph of the same step; and the models both build.

use std::time::Instant;

use graft_candle::{CandleGraft, StepId};
use graft_candle_bench::HandmadeGraph;
use graft_candle_bench::common::{BenchResult, Timing, median};
use graft_candle_bench::decode::first_tokens;
use graft_candle_models::Decoder;
use graft_candle_models::llama::Sizes;
use serde::{Deserialize, Serialize};

/// The seed of every model's random weights (one GPU and every rank: the same weights).
pub(crate) const SEED: u64 = 1234;
/// The f32 model whose tokens are checked (its heads divide over up to 4 ranks).
pub(crate) const CHECK: Sizes = Sizes::BENCH;

/// Untimed steps after each switch of variant.
const SETTLE: usize = 5;

/// Tokens of greedy decode steps: per batch size, per step, per sequence.
pub(crate) type Tokens = Vec<Vec<Vec<u32>>>;

/// One variant's step time at one batch size: medians in microseconds.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Timed {
    /// graft-candle's decode step: the call and a synchronize of candle's stream.
    pub(crate) graft_us: f64,
    /// graft-candle's call alone (host time, before the synchronize).
    pub(crate) graft_host_us: f64,
    /// The hand-made graph of the same step: a launch and a synchronize.
    pub(crate) raw_us: f64,
}

/// The tokens of `steps` greedy decode steps under `graft`'s `step` (registered with
/// `batches` as buckets) at each of `batches`, from the benchmarks' first tokens: per batch,
/// per step.
pub(crate) fn tokens(
    model: &Decoder,
    graft: &mut CandleGraft,
    step: StepId,
    batches: &[usize],
    steps: usize,
) -> BenchResult<Tokens> {
    let device = model.device();
    batches
        .iter()
        .map(|&batch| {
            let cache = model.new_cache(batch, model.spec().rope.max_positions)?;
            let t = first_tokens(batch, model.spec().vocab, device)?;
            (0..steps)
                .map(|_| {
                    let next = model
                        .decode(graft, step, &cache, &t)?
                        .outputs
                        .into_iter()
                        .next()
                        .ok_or("the step returned no output")?;
                    // Fed back at one address: a graph holding NCCL kernels is opaque to
                    // graft-cuda's patching (they find their buffers through work descriptors
                    // of their own), so an input that moved would be recorded again.
                    t.slice_set(&next, 0, 0)?;
                    Ok(next.to_vec1::<u32>()?)
                })
                .collect()
        })
        .collect()
}

/// graft-candle's decode step (`graft`'s `step`) against a hand-made graph of the same step
/// at `batch`: `steps` timed steps each, alternating in `timing.rounds` rounds, each step
/// followed by a synchronize of candle's stream; the medians.
pub(crate) fn time_step(
    model: &Decoder,
    graft: &mut CandleGraft,
    step: StepId,
    batch: usize,
    steps: usize,
    timing: &Timing,
) -> BenchResult<Timed> {
    let device = model.device();
    let per_round = timing.per_round(steps)?;
    let max_seq = model.spec().rope.max_positions;
    if per_round + SETTLE > max_seq {
        return Err(format!(
            "{per_round} timed steps per round do not fit a cache of {max_seq} positions: lower --steps or raise --rounds"
        )
        .into());
    }
    let vocab = model.spec().vocab;
    let graft_cache = model.new_cache(batch, max_seq)?;
    let raw_cache = model.new_cache(batch, max_seq)?;
    let example = first_tokens(batch, vocab, device)?;
    let raw = HandmadeGraph::capture(device.as_cuda_device()?, &example, |t| {
        model.greedy(&raw_cache, t)
    })?;
    let t = first_tokens(batch, vocab, device)?;
    let (mut graft_us, mut host_us, mut raw_us) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..timing.rounds {
        graft_cache.reset()?;
        t.slice_set(&example, 0, 0)?;
        device.synchronize()?;
        for i in 0..SETTLE + per_round {
            let start = Instant::now();
            let out = model.decode(graft, step, &graft_cache, &t)?;
            let host = start.elapsed().as_secs_f64() * 1e6;
            device.synchronize()?;
            if i >= SETTLE {
                host_us.push(host);
                graft_us.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let next = out
                .outputs
                .into_iter()
                .next()
                .ok_or("the step returned no output")?;
            // At one address, as in `tokens`.
            t.slice_set(&next, 0, 0)?;
        }
        raw_cache.reset()?;
        raw.set_tokens(&example)?;
        device.synchronize()?;
        for i in 0..SETTLE + per_round {
            let start = Instant::now();
            raw.launch()?;
            device.synchronize()?;
            if i >= SETTLE {
                raw_us.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    drop(t);
    Ok(Timed {
        graft_us: median(&mut graft_us),
        graft_host_us: median(&mut host_us),
        raw_us: median(&mut raw_us),
    })
}
