//! `graft bench` (decoder): the decoder step at each batch size, three ways on one device:
//! eager (the same ops, no graph), graft (warmed up and recorded, then timed on replays), and
//! a raw graph of the same step captured once without the tree (only with graft-core's token:
//! graft-cli's `graft-baselines` bench; the `graft` binary leaves it out and says so). Medians
//! of per-step wall times after a device synchronize, warmup steps first; every mode must
//! produce the same tokens.

use std::io::Write;
use std::time::Duration;

use graft_core::backend::CoreOnly;
use graft_core::{Config, Device, Graft};
use graft_tensor::{Decoder, DecoderConfig, Meta, Tensor};
use serde::Serialize;

use crate::demo::{check_batches, make_room};
use crate::error::CliError;
use crate::progress;
use crate::timing::{fmt_us, median_us, timed};
use crate::tokens::{compare, first_tokens};
use crate::{Backend, DecoderBenchArgs, NO_RAW};

/// One batch size's medians.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchRow {
    /// Batch size.
    pub batch: usize,
    /// Bucket it was padded to.
    pub bucket: usize,
    /// Eager step, microseconds.
    pub eager_us: f64,
    /// Graft replay step, microseconds.
    pub graft_us: f64,
    /// Raw graph step, microseconds (`None`: not measured, no token).
    pub raw_us: Option<f64>,
    /// `graft_us / raw_us`: what the tree costs over a bare graph launch.
    pub graft_over_raw: Option<f64>,
    /// `eager_us / graft_us`: graft's speedup over eager.
    pub speedup_over_eager: f64,
}

/// The decoder configuration, as written to JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConfigJson {
    /// "bench" or "tiny".
    pub name: String,
    /// Blocks.
    pub layers: usize,
    /// Model width.
    pub d_model: usize,
    /// Heads.
    pub heads: usize,
    /// MLP width.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Context.
    pub ctx: usize,
}

impl ConfigJson {
    /// `config`, named `name`.
    pub fn of(name: &str, config: &DecoderConfig) -> ConfigJson {
        ConfigJson {
            name: name.to_string(),
            layers: config.layers,
            d_model: config.d_model,
            heads: config.heads,
            ffn: config.ffn,
            vocab: config.vocab,
            ctx: config.ctx,
        }
    }
}

/// All results, as written to JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchReport {
    /// The device's description.
    pub device: String,
    /// Whether this ran on the simulator (timings then measure the host, not a GPU).
    pub simulator: bool,
    /// The decoder.
    pub config: ConfigJson,
    /// Timed steps per mode and batch size.
    pub steps: usize,
    /// Untimed steps before them.
    pub warmup: usize,
    /// What the times are.
    pub method: String,
    /// One row per batch size.
    pub results: Vec<BenchRow>,
}

/// Runs the decoder benchmark on the backend `args` selects; with graft-core's token `raw`,
/// the raw graph too.
pub fn run(
    args: &DecoderBenchArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<BenchReport, CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let (config, name) = backend.config();
    match backend {
        Backend::Cuda(dev) => run_on(dev, config, name, false, args, raw, out),
        Backend::Sim(dev) => run_on(dev, config, name, true, args, raw, out),
    }
}

/// Per-mode step times and tokens (real rows only).
struct Run {
    times: Vec<Duration>,
    tokens: Vec<Vec<i32>>,
}

impl Run {
    fn with_capacity(n: usize) -> Run {
        Run {
            times: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
        }
    }

    fn median(&self, warmup: usize) -> f64 {
        median_us(&self.times[warmup.min(self.times.len())..])
    }
}

/// Runs the decoder benchmark on `device` with `config` (and the raw graph with `raw`).
pub fn run_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    config_name: &str,
    simulator: bool,
    args: &DecoderBenchArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<BenchReport, CliError> {
    check_batches(&args.batches)?;
    let total = args.warmup + args.steps;
    if args.steps == 0 {
        return Err(CliError::BadArgument {
            flag: "--steps",
            why: "at least one timed step is needed; pass --steps 1 or more".into(),
        });
    }
    let describe = device.describe();
    writeln!(out, "device:  {describe}")?;
    if simulator {
        writeln!(
            out,
            "note:    no GPU in use: running the {config_name} config on the host simulator; the times measure the simulator, not a GPU"
        )?;
    }
    writeln!(out, "decoder: {config_name} config ({config})")?;
    let method = format!(
        "median of {} per-step wall times after a device synchronize, {} untimed warmup steps first",
        args.steps, args.warmup
    );
    writeln!(out, "method:  {method}")?;
    if total > config.ctx {
        writeln!(
            out,
            "note:    {total} steps exceed the context of {}: each run starts a new sequence (untimed position reset) whenever the KV cache is full",
            config.ctx
        )?;
    }

    let mut g: Graft<D, Meta> = Graft::new(device.clone(), Config::default());
    let dec = Decoder::new(&mut g, config, args.seed)?;
    let fid = dec.register(&mut g);
    let modes = if raw.is_some() { 3 } else { 2 };
    let bar = progress::bar((args.batches.len() * total * modes) as u64);
    bar.suspend(|| {
        writeln!(
            out,
            "\n{:>5} {:>6} {:>12} {:>12} {:>12} {:>10} {:>10}",
            "batch", "bucket", "eager", "graft", "raw graph", "graft/raw", "speedup"
        )
    })?;
    let mut results = Vec::new();
    for &batch in &args.batches {
        let bucket = g.bucket(fid, batch)?.size();
        let ids = first_tokens(batch, config.vocab);
        bar.set_message(format!("batch {batch}"));

        let mut eager = Run::with_capacity(total);
        let mut state = dec.new_state(&mut g, bucket)?;
        let mut t = dec.tokens(&mut g, &ids)?;
        for _ in 0..total {
            make_room(&mut state, &device)?;
            let (next, dt) = timed(&device, || dec.step_eager(&mut g, &mut state, &t))?;
            t = next;
            eager.times.push(dt);
            eager.tokens.push(rows(&t, &device, batch)?);
            bar.inc(1);
        }
        drop((state, t));

        let mut grafted = Run::with_capacity(total);
        let mut state = dec.new_state(&mut g, bucket)?;
        let mut t = dec.tokens(&mut g, &ids)?;
        for _ in 0..total {
            make_room(&mut state, &device)?;
            let (next, dt) = timed(&device, || dec.step_graft(&mut g, fid, &mut state, &t))?;
            t = next;
            grafted.times.push(dt);
            grafted.tokens.push(rows(&t, &device, batch)?);
            bar.inc(1);
        }
        drop((state, t));

        compare(batch, ("eager", &eager.tokens), ("graft", &grafted.tokens))?;
        let raw_us = match raw {
            Some(core) => {
                let mut raw = Run::with_capacity(total);
                let mut state = dec.new_state(&mut g, bucket)?;
                let tokens = dec.tokens(&mut g, &ids)?;
                let graph = dec.capture_raw(core, &mut g, &state, &tokens)?;
                for _ in 0..total {
                    make_room(&mut state, &device)?;
                    let ((), dt) = timed(&device, || graph.step(core, &mut state))?;
                    raw.times.push(dt);
                    raw.tokens.push(rows(graph.tokens(), &device, batch)?);
                    bar.inc(1);
                }
                drop((graph, state, tokens));
                compare(batch, ("eager", &eager.tokens), ("raw graph", &raw.tokens))?;
                Some(raw.median(args.warmup))
            }
            None => None,
        };
        let (e, gr) = (eager.median(args.warmup), grafted.median(args.warmup));
        let row = BenchRow {
            batch,
            bucket,
            eager_us: e,
            graft_us: gr,
            raw_us,
            graft_over_raw: raw_us.map(|r| gr / r.max(f64::MIN_POSITIVE)),
            speedup_over_eager: e / gr.max(f64::MIN_POSITIVE),
        };
        bar.suspend(|| {
            writeln!(
                out,
                "{:>5} {:>6} {:>12} {:>12} {:>12} {:>10} {:>9.2}x",
                row.batch,
                row.bucket,
                fmt_us(row.eager_us),
                fmt_us(row.graft_us),
                row.raw_us.map_or("-".into(), fmt_us),
                row.graft_over_raw.map_or("-".into(), |r| format!("{r:.3}")),
                row.speedup_over_eager
            )
        })?;
        results.push(row);
    }
    bar.finish_and_clear();
    if raw.is_some() {
        writeln!(
            out,
            "tokens:  identical across eager, graft and the raw graph at every batch size"
        )?;
    } else {
        writeln!(
            out,
            "tokens:  identical across eager and graft at every batch size"
        )?;
        writeln!(out, "{NO_RAW}")?;
    }

    let report = BenchReport {
        device: describe,
        simulator,
        config: ConfigJson::of(config_name, &config),
        steps: args.steps,
        warmup: args.warmup,
        method,
        results,
    };
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").map_err(|source| CliError::WriteFile {
            path: path.clone(),
            source,
        })?;
        writeln!(out, "json:    wrote {}", path.display())?;
    }
    Ok(report)
}

/// The first `batch` tokens of `t` (the real rows).
pub(crate) fn rows<D: Device>(t: &Tensor, device: &D, batch: usize) -> Result<Vec<i32>, CliError> {
    let mut v = t.to_vec_i32(device)?;
    v.truncate(batch);
    Ok(v)
}
