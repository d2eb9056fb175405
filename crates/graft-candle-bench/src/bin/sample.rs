//! graft-candle-sample: the per-row sampler (`graft_candle_kernels::sample_rows`) against the
//! greedy argmax (`argmax_last`) on `[batch, vocab]` f32 logits, at batch 1, 8 and 32 and the
//! vocabularies of Llama 2, Llama 3 and Qwen2: greedy rows, temperature only, top-k 50, top-p
//! 0.9, and both. Each variant: `--launches` launches after a warm-up, the device synchronized
//! once, the mean per launch; the variants alternate in rounds, medians over the rounds.
//! scripts/torch_sample.py times PyTorch's usual sampler on the same shapes. Only with
//! graft-candle-bench's `cuda` feature.
//!
//! usage: graft-candle-sample [--launches N] [--rounds R] [--json PATH]

use std::time::Instant;

use graft_candle::candle_core::{Device, Tensor};
use graft_candle_bench::common::{BUCKETS, BenchResult, Timing, exit_on_error, gpu, median};
use graft_candle_kernels::{SAMPLE_WORDS, SampleParams, argmax_last, sample_rows};

#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-sample",
    about = "the per-row sampler against argmax"
)]
struct Options {
    /// Timed launches per variant and shape (split over the rounds).
    #[arg(long, default_value_t = 300)]
    launches: usize,
    #[command(flatten)]
    timing: Timing,
}

/// The vocabularies measured: Llama 2, Llama 3, Qwen2.
const VOCABS: [usize; 3] = [32_000, 128_256, 151_936];

/// The variants: a name and each row's parameters (`None`: `argmax_last`).
fn variants() -> [(&'static str, Option<SampleParams>); 6] {
    let t = SampleParams {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        seed: 7,
        index: 0,
    };
    [
        ("argmax_last", None),
        ("greedy", Some(SampleParams::GREEDY)),
        ("temperature", Some(t)),
        ("top_k 50", Some(SampleParams { top_k: 50, ..t })),
        ("top_p 0.9", Some(SampleParams { top_p: 0.9, ..t })),
        (
            "top_k 50 + top_p 0.9",
            Some(SampleParams {
                top_k: 50,
                top_p: 0.9,
                ..t
            }),
        ),
    ]
}

/// Mean microseconds per launch of `launches` launches of `f`, synchronized once.
fn time(device: &Device, launches: usize, f: &dyn Fn() -> BenchResult<Tensor>) -> BenchResult<f64> {
    f()?;
    device.synchronize()?;
    let started = Instant::now();
    for _ in 0..launches {
        f()?;
    }
    device.synchronize()?;
    Ok(started.elapsed().as_secs_f64() * 1e6 / launches as f64)
}

fn main() {
    exit_on_error("graft-candle-sample", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    let device = gpu()?;
    let per_round = o.timing.per_round(o.launches)?;
    let mut rows = Vec::new();
    println!("| batch | vocab | variant | µs per launch |\n| --- | --- | --- | --- |");
    for &batch in &BUCKETS {
        for &vocab in &VOCABS {
            // Logits like a model's: normal, a few standard deviations wide.
            let logits = (Tensor::randn(0f32, 1.0, (batch, vocab), &device)? * 3.0)?;
            let variants = variants();
            let params: Vec<Option<Tensor>> = variants
                .iter()
                .map(|(_, p)| {
                    p.map(|p| {
                        let words = p.words().repeat(batch);
                        Tensor::from_vec(words, (batch, SAMPLE_WORDS), &device)
                    })
                    .transpose()
                })
                .collect::<Result<_, _>>()?;
            let mut samples = vec![Vec::new(); variants.len()];
            for _ in 0..o.timing.rounds {
                for (i, p) in params.iter().enumerate() {
                    let us = match p {
                        None => time(&device, per_round, &|| Ok(argmax_last(&logits)?))?,
                        Some(p) => time(&device, per_round, &|| Ok(sample_rows(&logits, p)?))?,
                    };
                    samples[i].push(us);
                }
            }
            for ((name, _), s) in variants.iter().zip(&mut samples) {
                let us = median(s);
                println!("| {batch} | {vocab} | {name} | {us:.2} |");
                rows.push(format!(
                    r#"{{"batch": {batch}, "vocab": {vocab}, "variant": "{name}", "us": {us:.3}}}"#
                ));
            }
        }
    }
    o.timing.write_json(&rows)
}
