//! What graft-candle's GPU benchmarks share: the buckets, the flag check and the median
//! (`decode.rs` beside it: what the two decode benchmarks also share).

pub(crate) type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The batch sizes measured (and, for decoding, the buckets the step is registered with).
pub(crate) const BUCKETS: [usize; 3] = [1, 8, 32];

/// `--steps` split over `--rounds`: both must allow at least one timed step per round.
pub(crate) fn check_rounds(steps: usize, rounds: usize) -> BenchResult<()> {
    if rounds == 0 || steps < rounds {
        return Err("--rounds must be at least 1 and --steps at least --rounds".into());
    }
    Ok(())
}

/// The median of `samples` (sorted in place).
pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
