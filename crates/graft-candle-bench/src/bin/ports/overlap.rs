//! graft-candle-ports' side-stream comparison: a decoder with shared experts (Qwen2-MoE)
//! recorded with them on a side stream and on the device's stream, timed in alternating rounds.

use candle_core::Device;
use graft_candle::{Buckets, CandleGraft};
use graft_candle_bench::common::{BUCKETS, BenchResult, median};
use graft_candle_models::KvCache;

use super::{Case, Options, time_graft};

/// A decoder with shared experts (Qwen2-MoE), its step with them on the side stream against
/// the same step with them on the device's stream: each recorded by a runtime of its own (the
/// setting is read when the body runs), then timed in alternating rounds. Per batch, the two
/// median steps (µs).
pub(super) fn overlap(
    c: &mut Case,
    cache: &KvCache,
    o: &Options,
    device: &Device,
) -> BenchResult<Vec<(f64, f64)>> {
    let mut runtimes = Vec::new();
    for side in [true, false] {
        c.ours.set_side_stream(side)?;
        let mut graft = CandleGraft::new(device)?;
        let step = graft.register_bucketed("decode", Buckets::new(BUCKETS)?);
        // Warm up and record every bucket with this setting.
        for batch in BUCKETS {
            time_graft(c, &mut graft, step, cache, batch, 1, 5, device)?;
        }
        runtimes.push((graft, step));
    }
    c.ours.set_side_stream(true)?;
    let per_round = o.timing.per_round(o.steps)?;
    let mut medians = Vec::new();
    for batch in BUCKETS {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..o.timing.rounds {
            for ((graft, step), t) in runtimes.iter_mut().zip(&mut times) {
                t.extend(time_graft(
                    c,
                    graft,
                    *step,
                    cache,
                    batch,
                    per_round,
                    5 + o.from,
                    device,
                )?);
            }
        }
        let [side, one] = &mut times;
        medians.push((median(side), median(one)));
    }
    for (graft, _) in &runtimes {
        if let Some(g) = graft.graft() {
            let s = g.stats();
            if s.recordings != BUCKETS.len() as u64 || s.eager_runs > 0 {
                return Err(format!(
                    "the overlap runtimes recorded {} graphs and ran {} calls eagerly; want one recording per bucket",
                    s.recordings, s.eager_runs
                )
                .into());
            }
        }
    }
    Ok(medians)
}
