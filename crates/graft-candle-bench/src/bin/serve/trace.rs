//! The seeded request trace: Poisson arrivals, prompt and output lengths log-uniform.

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
