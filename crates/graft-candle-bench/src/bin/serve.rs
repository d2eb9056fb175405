//! `graft-candle-serve`: a continuous-batching serving engine over one of the ported models
//! (Llama, random weights), candle eager against graft-candle on the same seeded trace:
//! requests arrive as a Poisson process, join and leave the batch at every step, and are
//! padded to buckets over a slotted static kv cache. Reports throughput, time to first
//! token and inter-token latency (p50, p99), the capture time, the graph memory and the kv
//! cache the memory plan gave (GPU), checks that every request's tokens equal those of
//! running it alone eagerly, and writes `serve.json`, `itl.svg` (inter-token latency of both
//! modes) and `throughput.svg` (tokens per second over the trace) to `--out`.
//!
//! With `--block-size N` graft-candle also serves on a paged kv cache of N-position blocks
//! (the plan gives it every block that fits), prompts sharing the cached blocks of their
//! prefixes; with `--shared-prefix P` the trace is `--requests` requests arriving together,
//! each a prompt of the same P tokens and `--suffix` of its own, for 16 new tokens.
//!
//! usage: graft-candle-serve [--model small|1b] [--requests N] [--rate R] [--seed S]
//!        [--max-seq N] [--margin-mib M] [--check-alone N] [--block-size N]
//!        [--shared-prefix P] [--suffix S] [--skip-eager] [--out DIR]

#[path = "serve/plot.rs"]
mod plot;
#[path = "serve/trace.rs"]
mod trace;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_transformers::models as ct;
use clap::Parser;
use graft_candle::{Buckets, CandleGraft};
use graft_candle_models::serve::{Engine, Event, Request, ServeConfig};
use graft_candle_models::{Decoder, checkpoint, llama};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug)]
#[command(about = "a continuous-batching engine: candle eager against graft-candle")]
struct Opts {
    /// `small` (f32, 4 layers) or `1b` (bf16, Llama-style ~1B).
    #[arg(long, default_value = "small")]
    model: String,
    /// Requests in the trace.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Mean arrivals per second (Poisson).
    #[arg(long, default_value_t = 40.0)]
    rate: f64,
    /// Seed of the trace.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Positions per sequence of the kv cache.
    #[arg(long, default_value_t = 1024)]
    max_seq: usize,
    /// Memory kept free by the plan (GPU), MiB.
    #[arg(long, default_value_t = 1024)]
    margin_mib: u64,
    /// Most sequences decoding at once (the kv cache's sequences on the CPU).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Requests checked against running them alone, eagerly (the first N).
    #[arg(long, default_value_t = 16)]
    check_alone: usize,
    /// Also serve under graft-candle on a paged kv cache of blocks of this many positions.
    #[arg(long)]
    block_size: Option<usize>,
    /// Instead of the Poisson trace, `--requests` requests arriving together whose prompts
    /// start with the same this many tokens.
    #[arg(long)]
    shared_prefix: Option<usize>,
    /// With `--shared-prefix`, each prompt's own tokens after the shared ones.
    #[arg(long, default_value_t = 32)]
    suffix: usize,
    /// Leave out candle eager (the token checks then compare with graft-candle's static-row
    /// run).
    #[arg(long)]
    skip_eager: bool,
    /// Where serve.json and the SVGs go.
    #[arg(long, default_value = "serve-out")]
    out: std::path::PathBuf,
}

/// What one mode measured.
struct Run {
    tokens: HashMap<u64, Vec<u32>>,
    /// Per request: arrival, then each token's time (seconds from the start).
    times: HashMap<u64, Vec<f64>>,
    arrivals: HashMap<u64, f64>,
    wall_s: f64,
}

fn main() {
    graft_candle_bench::common::exit_on_error("graft-candle-serve", run);
}

fn run() -> Result<()> {
    let o = Opts::parse();
    let device = graft_candle::device(0)?;
    let (model, dtype) = load(&o.model, &device)?;
    let trace = match o.shared_prefix {
        Some(prefix) => trace::shared_prefix(o.seed, o.requests, prefix, o.suffix, o.max_seq)?,
        None => trace::poisson(o.seed, o.requests, o.rate, o.max_seq)?,
    };
    let config = ServeConfig {
        decode_buckets: Buckets::new(
            [1, 2, 4, 8, 16, 32]
                .into_iter()
                .filter(|&b| b <= o.max_batch),
        )?,
        prefill_buckets: Buckets::new(
            [16, 32, 64, 128, 256, 512]
                .into_iter()
                .filter(|&b| b <= o.max_seq),
        )?,
        eos: Vec::new(),
        max_running: Some(o.max_batch),
        speculate: None,
    };
    std::fs::create_dir_all(&o.out)?;
    println!(
        "graft-candle-serve: {} model ({dtype:?}), {} requests at {} per second (seed {}), kv cache of {} positions per sequence, on {:?}",
        o.model,
        o.requests,
        o.rate,
        o.seed,
        o.max_seq,
        device.location()
    );

    // graft-candle first: its plan sizes the cache from the memory left after recording.
    let (graft_run, plan, recordings, sequences) = graphed(&model, &config, None, &o, &trace)?;
    let paged = match o.block_size {
        Some(size) => Some(graphed(&model, &config, Some(size), &o, &trace)?),
        None => None,
    };
    let eager_run = if o.skip_eager {
        None
    } else {
        let cache = model.new_serving_cache(sequences, o.max_seq)?;
        let mut eager = Engine::eager(&model, cache, config.clone())?;
        Some(serve(&mut eager, &trace, "candle eager")?)
    };
    let reference = eager_run.as_ref().unwrap_or(&graft_run);

    // The tokens: graft-candle's equal eager's batch (or, without it, the paged run's equal
    // the static rows'), and the first requests' equal running them alone.
    let same = |run: &Run| {
        trace
            .iter()
            .filter(|(_, r)| run.tokens.get(&r.id) == reference.tokens.get(&r.id))
            .count()
    };
    let same_as_eager = same(&graft_run);
    let paged_same = paged.as_ref().map(|p| same(&p.0));
    let mut alone_equal = 0;
    let checked = o.check_alone.min(trace.len());
    for (_, r) in trace.iter().take(checked) {
        let cache = model.new_serving_cache(1, o.max_seq)?;
        let single = ServeConfig {
            decode_buckets: Buckets::new([1])?,
            ..config.clone()
        };
        let mut alone = Engine::eager(&model, cache, single)?;
        alone.submit(r.clone()).map_err(|e| e.to_string())?;
        let mut tokens = Vec::new();
        while alone.pending() > 0 {
            for e in alone.step()? {
                if let Event::Token { token, .. } = e {
                    tokens.push(token);
                }
            }
        }
        alone_equal += usize::from(graft_run.tokens.get(&r.id) == Some(&tokens));
    }

    let mut modes = vec![("graft-candle", &graft_run)];
    modes.extend(paged.as_ref().map(|p| ("graft-candle paged", &p.0)));
    modes.extend(eager_run.as_ref().map(|r| ("candle eager", r)));
    let mut report = Vec::new();
    println!(
        "\n| mode | throughput | TTFT mean | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | wall |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for &(name, r) in &modes {
        let s = stats(r);
        println!(
            "| {name} | {:.0} tok/s | {:.2} ms | {:.2} ms | {:.2} ms | {:.3} ms | {:.3} ms | {:.2} s |",
            s["throughput_tok_s"].as_f64().unwrap_or(0.0),
            s["ttft_mean_ms"].as_f64().unwrap_or(0.0),
            s["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            s["ttft_p99_ms"].as_f64().unwrap_or(0.0),
            s["itl_p50_ms"].as_f64().unwrap_or(0.0),
            s["itl_p99_ms"].as_f64().unwrap_or(0.0),
            r.wall_s
        );
        report.push(json!({"mode": name, "stats": s}));
    }
    let against = if o.skip_eager {
        "its own static-row run"
    } else {
        "the eager batch"
    };
    println!(
        "\ntokens: graft-candle equals {against} for {same_as_eager}/{} requests, and running alone eagerly for {alone_equal}/{checked}",
        trace.len()
    );
    if let (Some(n), Some((_, plan, recordings, _))) = (paged_same, &paged) {
        println!(
            "paged: tokens equal {against} for {n}/{}; recordings: {recordings}; memory plan: {plan}",
            trace.len()
        );
    }
    println!("recordings: {recordings}; memory plan: {plan}");
    let json = json!({
        "model": o.model, "dtype": format!("{dtype:?}"), "requests": o.requests, "rate": o.rate,
        "seed": o.seed, "max_seq": o.max_seq, "device": format!("{:?}", device.location()),
        "modes": report, "plan": plan, "kv_sequences": sequences, "recordings": recordings,
        "tokens_equal_eager_batch": same_as_eager, "tokens_equal_alone": alone_equal,
        "alone_checked": checked, "block_size": o.block_size, "shared_prefix": o.shared_prefix,
        "paged_plan": paged.as_ref().map(|p| p.1.clone()), "paged_tokens_equal": paged_same,
    });
    std::fs::write(
        o.out.join("serve.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    let itl: Vec<_> = modes.iter().map(|&(n, r)| (n, itls(r))).collect();
    plot::itl(&o.out.join("itl.svg"), &itl)?;
    let times: Vec<_> = modes.iter().map(|&(n, r)| (n, token_times(r))).collect();
    plot::throughput(&o.out.join("throughput.svg"), &times)?;
    println!("wrote {}", o.out.join("serve.json").display());
    // In f32 the padded, graphed steps must give eager's tokens; in bf16 the padding changes
    // cuBLAS's summation order, and the counts above say how many agree.
    let paged_differs = paged_same.is_some_and(|n| n != trace.len());
    if dtype == DType::F32
        && (alone_equal != checked || same_as_eager != trace.len() || paged_differs)
    {
        return Err("tokens differ from eager (see above)".into());
    }
    Ok(())
}

/// graft-candle's run of the trace: planned over static rows, or over blocks of `block_size`
/// positions; returns the run, the plan, the recordings and the cache's sequences.
fn graphed(
    model: &Decoder,
    config: &ServeConfig,
    block_size: Option<usize>,
    o: &Opts,
    trace: &[(f64, Request)],
) -> Result<(Run, serde_json::Value, String, usize)> {
    let graft_config = graft_core::Config {
        replace_moved_static: true,
        ..graft_core::Config::default()
    };
    let graft = CandleGraft::with_config(model.device(), graft_config)?;
    let largest = config.decode_buckets.largest();
    let capture_cache = match block_size {
        // Blocks for one sequence of max_seq (the largest prefill records in row 0).
        Some(size) => model.new_paged_cache(largest, o.max_seq, o.max_seq.div_ceil(size), size)?,
        None => model.new_serving_cache(largest, o.max_seq)?,
    };
    let mut engine = Engine::graphed(model, capture_cache, graft, config.clone())?;
    let plan = plan(&mut engine, o.margin_mib << 20)?;
    let sequences = engine.cache().max_batch();
    let name = match block_size {
        Some(_) => "graft paged",
        None => "graft-candle",
    };
    let run = serve(&mut engine, trace, name)?;
    if block_size.is_some() {
        println!(
            "paged: {} prompt tokens came from shared blocks, {} preemptions",
            engine.cached_tokens(),
            engine.preemptions()
        );
    }
    Ok((run, plan, recordings(&engine), sequences))
}

/// The model: random weights in the Llama checkpoint layout, loaded by the Llama port.
fn load(size: &str, device: &Device) -> Result<(Decoder, DType)> {
    let (d, f, layers, heads, kv, vocab, dtype) = match size {
        "small" => (512, 1536, 4, 8, 4, 8192, DType::F32),
        "1b" => (2048, 8192, 16, 32, 8, 32_000, DType::BF16),
        other => return Err(format!("--model {other}: use small or 1b").into()),
    };
    let cfg: ct::llama::LlamaConfig = serde_json::from_str(&format!(
        r#"{{"hidden_size": {d}, "intermediate_size": {f}, "vocab_size": {vocab},
            "num_hidden_layers": {layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true}}"#
    ))?;
    let cfg = cfg.into_config(false);
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 11, dtype, device)?;
    let vb = VarBuilder::from_tensors(weights, dtype, device);
    Ok((llama::load(vb, &cfg)?, dtype))
}

/// The memory plan on a GPU (recording every bucket first); on the CPU, the recordings of
/// nothing and a cache of the largest bucket.
fn plan(engine: &mut Engine<'_>, margin: u64) -> Result<serde_json::Value> {
    if engine.graft().is_some_and(CandleGraft::is_graphed) {
        let p = graft_candle_models::serve::plan(engine, margin)?;
        println!(
            "recorded every bucket in {:.3} s ({} calls); graphs hold {:.1} MiB (driver) + {:.1} MiB (graft's pool); {:.2} GiB were free, the kv cache got {} sequences{}, {:.2} GiB ({:.1} MiB per sequence), {:.2} GiB stay free (margin {} MiB); recording again against it took {:.3} s, graphs then hold {:.1} MiB",
            p.capture_s,
            p.capture_calls,
            mib(p.graph_driver),
            mib(p.graph_pool),
            gib(p.free_for_cache),
            p.sequences,
            p.blocks.map_or(String::new(), |(n, bytes)| format!(
                " over {n} blocks of {:.2} MiB",
                mib(bytes)
            )),
            gib(p.cache_bytes),
            mib(p.row_bytes),
            gib(p.free_after),
            margin >> 20,
            p.repoint_s,
            mib(p.graph_driver_after),
        );
        return Ok(json!({
            "capture_s": p.capture_s, "capture_calls": p.capture_calls,
            "graph_driver_bytes": p.graph_driver, "graph_pool_bytes": p.graph_pool,
            "free_for_cache_bytes": p.free_for_cache, "margin_bytes": p.margin,
            "row_bytes": p.row_bytes, "kv_sequences": p.sequences, "kv_bytes": p.cache_bytes,
            "kv_blocks": p.blocks.map(|b| b.0), "block_bytes": p.blocks.map(|b| b.1),
            "repoint_s": p.repoint_s, "graph_driver_after_bytes": p.graph_driver_after,
            "free_after_bytes": p.free_after,
        }));
    }
    let _ = margin;
    let started = Instant::now();
    let calls = engine.capture()?;
    Ok(json!({"capture_s": started.elapsed().as_secs_f64(), "capture_calls": calls}))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Recordings graft made, per step.
fn recordings(engine: &Engine<'_>) -> String {
    if let Some(g) = engine.graft().and_then(CandleGraft::graft) {
        let s = g.stats();
        let mut line = format!(
            "{} recorded, {} replays, {} eager calls",
            s.recordings, s.replays, s.eager_runs
        );
        // Why calls ran eagerly: the distinct decisions (the first few).
        if s.eager_runs > 0 {
            let mut why: Vec<String> = Vec::new();
            for d in g.explain() {
                let text = format!("{}: {}", d.function, d.decision);
                if d.decision.to_string().starts_with("eager")
                    && !why.contains(&text)
                    && why.len() < 4
                {
                    why.push(text);
                }
            }
            line.push_str(&format!(" ({})", why.join("; ")));
        }
        return line;
    }
    "none (not a CUDA device: every step ran eagerly)".into()
}

/// Runs the trace in real time: each request is submitted once the clock passes its
/// arrival; the engine steps while anything is pending.
fn serve(engine: &mut Engine<'_>, trace: &[(f64, Request)], name: &str) -> Result<Run> {
    let bar = ProgressBar::new(trace.len() as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>13} {bar:40} {pos}/{len} requests {msg}")
    {
        bar.set_style(style);
    }
    bar.set_prefix(name.to_string());
    let mut run = Run {
        tokens: HashMap::new(),
        times: HashMap::new(),
        arrivals: HashMap::new(),
        wall_s: 0.0,
    };
    let start = Instant::now();
    let mut next = 0;
    let mut done = 0;
    while done < trace.len() {
        let now = start.elapsed().as_secs_f64();
        while next < trace.len() && trace[next].0 <= now {
            let (at, r) = &trace[next];
            run.arrivals.insert(r.id, *at);
            engine.submit(r.clone()).map_err(|e| e.to_string())?;
            next += 1;
        }
        if engine.pending() == 0 {
            let wait = trace[next].0 - now;
            std::thread::sleep(Duration::from_secs_f64(wait.max(0.0)));
            continue;
        }
        let events = engine.step()?;
        let t = start.elapsed().as_secs_f64();
        for e in events {
            match e {
                Event::Token { id, token, .. } => {
                    run.tokens.entry(id).or_default().push(token);
                    run.times.entry(id).or_default().push(t);
                }
                Event::Finished { .. } => {
                    done += 1;
                    bar.inc(1);
                }
            }
        }
        bar.set_message(format!("{} running", engine.running()));
    }
    run.wall_s = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(run)
}

/// Inter-token latencies of every request, seconds.
fn itls(r: &Run) -> Vec<f64> {
    r.times
        .values()
        .flat_map(|t| t.windows(2).map(|w| w[1] - w[0]))
        .collect()
}

/// Every token's time, seconds from the start.
fn token_times(r: &Run) -> Vec<f64> {
    r.times.values().flatten().copied().collect()
}

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_by(f64::total_cmp);
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn stats(r: &Run) -> serde_json::Value {
    let mut ttft: Vec<f64> = r
        .times
        .iter()
        .map(|(id, t)| t[0] - r.arrivals.get(id).copied().unwrap_or(0.0))
        .collect();
    let mut itl = itls(r);
    let tokens: usize = r.tokens.values().map(Vec::len).sum();
    json!({
        "tokens": tokens,
        "wall_s": r.wall_s,
        "throughput_tok_s": tokens as f64 / r.wall_s,
        "ttft_mean_ms": 1e3 * ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        "ttft_p50_ms": 1e3 * percentile(&mut ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(&mut ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(&mut itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(&mut itl, 0.99),
        "itl_mean_ms": 1e3 * itl.iter().sum::<f64>() / itl.len().max(1) as f64,
    })
}
