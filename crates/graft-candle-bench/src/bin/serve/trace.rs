//! The seeded request traces: Poisson arrivals with prompt and output lengths log-uniform, or
//! requests arriving together whose prompts share a prefix.

use graft_candle_models::serve::{Request, SampleParams};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// `n` requests arriving at `rate` per second on average (exponential gaps), prompts of 16
/// to 768 tokens capped at half of `max_seq`, and outputs of 16 to 256 capped to fit it, both
/// log-uniform: (arrival in seconds, request).
pub(crate) fn poisson(
    seed: u64,
    n: usize,
    rate: f64,
    max_seq: usize,
) -> Result<Vec<(f64, Request)>, String> {
    if rate <= 0.0 || !rate.is_finite() {
        return Err(format!(
            "--rate {rate}: use a positive number of arrivals per second"
        ));
    }
    if max_seq < 32 {
        return Err(format!("--max-seq {max_seq}: use at least 32"));
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut log_uniform = |lo: f64, hi: f64| -> usize {
        let u: f64 = rng.random();
        (lo.ln() + u * (hi.ln() - lo.ln())).exp().round() as usize
    };
    let mut lengths = Vec::with_capacity(n);
    for _ in 0..n {
        let prompt = log_uniform(16.0, 768.0).min(max_seq / 2);
        let max_new = log_uniform(16.0, 256.0).min(max_seq - prompt);
        lengths.push((prompt, max_new));
    }
    let mut t = 0.0;
    Ok(lengths
        .into_iter()
        .enumerate()
        .map(|(i, (prompt, max_new))| {
            let u: f64 = rng.random();
            t += -(1.0 - u).ln() / rate;
            let prompt = (0..prompt).map(|_| rng.random_range(1..4000u32)).collect();
            let request = Request {
                id: i as u64,
                prompt,
                max_new,
                sampling: SampleParams::GREEDY,
            };
            (t, request)
        })
        .collect())
}

/// `n` requests arriving together (at 0 s), each a prompt of the same `prefix` random tokens
/// and `suffix` of its own, for 16 new tokens: (arrival, request).
pub(crate) fn shared_prefix(
    seed: u64,
    n: usize,
    prefix: usize,
    suffix: usize,
    max_seq: usize,
) -> Result<Vec<(f64, Request)>, String> {
    const NEW: usize = 16;
    if prefix + suffix + NEW > max_seq + 1 {
        return Err(format!(
            "--shared-prefix {prefix} --suffix {suffix} and {NEW} new tokens need {} positions: use --max-seq of at least that",
            prefix + suffix + NEW - 1
        ));
    }
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let shared: Vec<u32> = (0..prefix).map(|_| rng.random_range(1..4000u32)).collect();
    Ok((0..n)
        .map(|i| {
            let mut prompt = shared.clone();
            prompt.extend((0..suffix).map(|_| rng.random_range(1..4000u32)));
            let request = Request {
                id: i as u64,
                prompt,
                max_new: NEW,
                sampling: SampleParams::GREEDY,
            };
            (0.0, request)
        })
        .collect())
}
