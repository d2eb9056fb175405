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
    /// graft-candle's decode step through `Decoder::decode_into` (the tokens decoded in place,
    /// the statics made once): the call and a synchronize of candle's stream.
    pub(crate) graft_us: f64,
    /// Its call alone (host time, before the synchronize).
    pub(crate) graft_host_us: f64,
    /// graft-candle's decode step through `Decoder::decode`, each step's output tensor the
    /// next one's input (a new address every step, copied into the graph), the statics
    /// listed per call: the call and a synchronize.
    pub(crate) fresh_us: f64,
    /// Its call alone.
    pub(crate) fresh_host_us: f64,
    /// The hand-made graph of the same step: a launch and a synchronize.
    pub(crate) raw_us: f64,
    /// Its launch alone.
    pub(crate) raw_host_us: f64,
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
            let mut t = first_tokens(batch, model.spec().vocab, device)?;
            let mut made = Vec::with_capacity(steps);
            for _ in 0..steps {
                // Each step's output is the next step's input, as a user feeds it: a new
                // tensor every step, which the graph (its NCCL kernels opaque to graft-cuda's
                // patching) follows by copying it in.
                t = model
                    .decode(graft, step, &cache, &t)?
                    .outputs
                    .into_iter()
                    .next()
                    .ok_or("the step returned no output")?;
                made.push(t.to_vec1::<u32>()?);
            }
            Ok(made)
        })
        .collect()
}

/// graft-candle's decode step (`graft`'s `step`), through `decode_into` and through `decode`,
/// against a hand-made graph of the same step at `batch`: `steps` timed steps each, in
/// `timing.rounds` rounds (the order of the three reversed in every other round), each step
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
    let statics = model.statics(&graft_cache);
    let example = first_tokens(batch, vocab, device)?;
    let raw = HandmadeGraph::capture(device.as_cuda_device()?, &example, |t| {
        model.greedy(&raw_cache, t)
    })?;
    let t = first_tokens(batch, vocab, device)?;
    let mut graft_us = Samples::default();
    let mut fresh_us = Samples::default();
    let mut raw_us = Samples::default();
    // graft's cache and tokens back to the first step's.
    let restart = || -> BenchResult<()> {
        graft_cache.reset()?;
        t.slice_set(&example, 0, 0)?;
        Ok(device.synchronize()?)
    };
    for round in 0..timing.rounds {
        // The variants' order alternates by round (the hand-made graph first in every other
        // round), so that neither gains from running after the other.
        let order = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for variant in order {
            match variant {
                0 => {
                    restart()?;
                    for i in 0..SETTLE + per_round {
                        let start = Instant::now();
                        model.decode_into(graft, step, &graft_cache, &statics, &t, &t)?;
                        graft_us.time(i, start, || Ok(device.synchronize()?))?;
                    }
                }
                1 => {
                    restart()?;
                    // Fed back as in `tokens`: the first round's second step records once
                    // more, with the moved tokens copied in (within the settling steps).
                    let mut fresh = t.clone();
                    for i in 0..SETTLE + per_round {
                        let start = Instant::now();
                        let out = model.decode(graft, step, &graft_cache, &fresh)?;
                        fresh_us.time(i, start, || Ok(device.synchronize()?))?;
                        fresh = out
                            .outputs
                            .into_iter()
                            .next()
                            .ok_or("the step returned no output")?;
                    }
                }
                _ => {
                    raw_cache.reset()?;
                    raw.set_tokens(&example)?;
                    device.synchronize()?;
                    for i in 0..SETTLE + per_round {
                        let start = Instant::now();
                        raw.launch()?;
                        raw_us.time(i, start, || Ok(device.synchronize()?))?;
                    }
                }
            }
        }
    }
    drop(t);
    let (graft_us, graft_host_us) = graft_us.medians();
    let (fresh_us, fresh_host_us) = fresh_us.medians();
    let (raw_us, raw_host_us) = raw_us.medians();
    Ok(Timed {
        graft_us,
        graft_host_us,
        fresh_us,
        fresh_host_us,
        raw_us,
        raw_host_us,
    })
}

/// One variant's step times and host times, in microseconds, after the settling steps.
#[derive(Default)]
struct Samples {
    step: Vec<f64>,
    host: Vec<f64>,
}

impl Samples {
    /// Step `i`, started at `start` and launched now: its host time, then `sync`, then its
    /// step time (kept from step `SETTLE` on).
    fn time(
        &mut self,
        i: usize,
        start: Instant,
        sync: impl FnOnce() -> BenchResult<()>,
    ) -> BenchResult<()> {
        let host = start.elapsed().as_secs_f64() * 1e6;
        sync()?;
        if i >= SETTLE {
            self.host.push(host);
            self.step.push(start.elapsed().as_secs_f64() * 1e6);
        }
        Ok(())
    }

    /// The medians: step, host.
    fn medians(mut self) -> (f64, f64) {
        (median(&mut self.step), median(&mut self.host))
    }
}
