//! What graft-candle's two GPU benchmarks share: the tokens they start from, the buckets and
//! checked steps, the flag check and the median.

use graft_candle::candle_core::{Device, Tensor};

pub(crate) type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Steps whose tokens are compared before anything is timed.
pub(crate) const CHECK_STEPS: usize = 64;
/// The batch sizes measured, and the buckets the step is registered with.
pub(crate) const BUCKETS: [usize; 3] = [1, 8, 32];

/// `--steps` split over `--rounds`: both must allow at least one timed step per round.
pub(crate) fn check_rounds(steps: usize, rounds: usize) -> BenchResult<()> {
    if rounds == 0 || steps < rounds {
        return Err("--rounds must be at least 1 and --steps at least --rounds".into());
    }
    Ok(())
}

/// The first tokens of `batch` sequences, the same in every variant.
pub(crate) fn first_tokens(batch: usize, vocab: usize, device: &Device) -> BenchResult<Tensor> {
    let tokens: Vec<u32> = (0..batch).map(|i| ((3 + 17 * i) % vocab) as u32).collect();
    Ok(Tensor::new(tokens.as_slice(), device)?)
}

/// The median of `samples` (sorted in place).
pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
