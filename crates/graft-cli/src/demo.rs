//! `graft demo`: decode through graft and eagerly, check the tokens match, report times, the
//! tree and its pool.

use std::io::Write;
use std::time::Duration;

use graft_core::backend::CoreOnly;
use graft_core::{Config, Device, Graft, Stats};
use graft_tensor::{Decoder, DecoderConfig, KvState, Meta, default_buckets};

use crate::error::CliError;
use crate::progress;
use crate::timing::{fmt_us, median_us, timed};
use crate::tokens::{compare, first_tokens};
use crate::{Backend, DemoArgs};

/// Steps left out of the medians: graft's warmup and recording, and cold caches.
const SKIP: usize = 3;

/// One batch size's results.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoRow {
    /// Batch size.
    pub batch: usize,
    /// Bucket it was padded to.
    pub bucket: usize,
    /// Median eager step time.
    pub eager_us: f64,
    /// Median graft step time.
    pub graft_us: f64,
    /// The tokens of every step (real rows only), identical for both runs.
    pub tokens: Vec<Vec<i32>>,
}

/// What the demo did.
#[derive(Clone, Debug)]
pub struct DemoReport {
    /// The device's description.
    pub device: String,
    /// The decoder configuration used.
    pub config: DecoderConfig,
    /// One row per batch size.
    pub rows: Vec<DemoRow>,
    /// Graft's statistics at the end.
    pub stats: Stats,
    /// Root nodes of the tree.
    pub roots: usize,
}

pub(crate) fn check_batches(batches: &[usize]) -> Result<(), CliError> {
    if batches.is_empty() {
        return Err(CliError::BadArgument {
            flag: "--batches",
            why: "no batch sizes given; pass e.g. --batches 1,4,8".into(),
        });
    }
    for &b in batches {
        if b == 0 || !matches!(default_buckets().pick(b), graft_core::Bucket::Padded(_)) {
            return Err(CliError::BadArgument {
                flag: "--batches",
                why: format!("batch size {b} is outside 1..=32; pass sizes from 1 to 32"),
            });
        }
    }
    Ok(())
}

/// Runs the demo on the backend `args` selects, then the candle model (see the `candle`
/// module), then the decoder split over two ranks (two GPUs, or simulated devices; their raw
/// graphs too with graft-core's token `raw`).
pub fn run(
    args: &DemoArgs,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<DemoReport, CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let (config, name) = backend.config();
    let report = match backend {
        Backend::Cuda(dev) => {
            let report = run_on(dev, config, name, args, out)?;
            candle(out)?;
            report
        }
        Backend::Sim(dev) => {
            let report = run_on(dev, config, name, args, out)?;
            writeln!(
                out,
                "\ncandle model: skipped, it needs a GPU (graft-candle's Llama-style decoder runs on CUDA only)"
            )?;
            report
        }
    };
    writeln!(
        out,
        "\ntensor parallel, 2 ranks (a short `graft bench tp`):"
    )?;
    crate::tp::demo(args.sim, raw, out)?;
    Ok(report)
}

/// The names graft-candle's demo binary has next to this one: as cargo builds it, and as
/// `scripts/stage.sh --candle-cuda` stages it.
const CANDLE_BENCH: [&str; 2] = ["graft-candle-bench", "graft-candle-bench_cuda"];

/// The candle part of the demo, on a GPU. candle's CUDA backend links CUDA at build time and
/// this binary loads it at run time; cudarc allows one or the other per build, so the candle
/// model lives in graft-candle's own CUDA build, `graft-candle-bench`. When that binary sits
/// next to this one, the demo runs it short (tokens of eager, a hand-made graph and
/// graft-candle checked equal over 64 steps at buckets 1, 8 and 32, then timed); otherwise it
/// says how to build it.
fn candle(out: &mut dyn Write) -> Result<(), CliError> {
    writeln!(out, "\ncandle model (graft-candle):")?;
    let dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(std::path::Path::to_path_buf));
    let found = dir.and_then(|d| CANDLE_BENCH.iter().map(|n| d.join(n)).find(|p| p.is_file()));
    let Some(path) = found else {
        writeln!(
            out,
            "  skipped: graft-candle-bench is not built next to this binary; build it with\n  `source scripts/cuda-build-env.sh && cargo build --release -p graft-candle --features cuda`"
        )?;
        return Ok(());
    };
    let ran = std::process::Command::new(&path)
        .args(["--steps", "60", "--rounds", "3", "--skip-1b"])
        .output()
        .map_err(|source| CliError::Candle {
            path: path.clone(),
            status: None,
            source: Some(source),
        })?;
    out.write_all(&ran.stdout)?;
    if !ran.status.success() {
        out.write_all(&ran.stderr)?;
        return Err(CliError::Candle {
            path,
            status: ran.status.code(),
            source: None,
        });
    }
    Ok(())
}

/// Runs the demo on `device` with `config`.
pub fn run_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    config_name: &str,
    args: &DemoArgs,
    out: &mut dyn Write,
) -> Result<DemoReport, CliError> {
    check_batches(&args.batches)?;
    if args.tokens == 0 {
        return Err(CliError::BadArgument {
            flag: "--tokens",
            why: "at least one token is needed; pass --tokens 1 or more".into(),
        });
    }
    let describe = device.describe();
    writeln!(out, "device:  {describe}")?;
    writeln!(out, "decoder: {config_name} config ({config})")?;
    writeln!(
        out,
        "{} tokens per batch size, greedy; step times are medians of per-step wall times after a device synchronize (first {SKIP} steps left out)",
        args.tokens
    )?;
    if args.tokens > config.ctx {
        writeln!(
            out,
            "note:    {} tokens exceed the context of {}: a new sequence starts (untimed position reset) whenever the KV cache is full",
            args.tokens, config.ctx
        )?;
    }

    let mut g: Graft<D, Meta> = Graft::new(device.clone(), Config::default());
    let dec = Decoder::new(&mut g, config, args.seed)?;
    let fid = dec.register(&mut g);
    let bar = progress::bar((args.batches.len() * args.tokens * 2) as u64);
    let mut rows = Vec::new();
    bar.suspend(|| {
        writeln!(
            out,
            "\n{:>5} {:>6} {:>12} {:>12} {:>8}  tokens",
            "batch", "bucket", "eager/step", "graft/step", "speedup"
        )
    })?;
    for &batch in &args.batches {
        let bucket = g.bucket(fid, batch)?.size();
        let ids = first_tokens(batch, config.vocab);
        bar.set_message(format!("batch {batch}"));

        let mut state = dec.new_state(&mut g, bucket)?;
        let mut t = dec.tokens(&mut g, &ids)?;
        let mut eager_times: Vec<Duration> = Vec::with_capacity(args.tokens);
        let mut eager_tokens = Vec::with_capacity(args.tokens);
        for _ in 0..args.tokens {
            make_room(&mut state, &device)?;
            let (next, dt) = timed(&device, || dec.step_eager(&mut g, &mut state, &t))?;
            t = next;
            eager_times.push(dt);
            eager_tokens.push(t.to_vec_i32(&device)?[..batch].to_vec());
            bar.inc(1);
        }
        drop((state, t));

        let mut state = dec.new_state(&mut g, bucket)?;
        let mut t = dec.tokens(&mut g, &ids)?;
        let mut graft_times: Vec<Duration> = Vec::with_capacity(args.tokens);
        let mut graft_tokens = Vec::with_capacity(args.tokens);
        for _ in 0..args.tokens {
            make_room(&mut state, &device)?;
            let (next, dt) = timed(&device, || dec.step_graft(&mut g, fid, &mut state, &t))?;
            t = next;
            graft_times.push(dt);
            graft_tokens.push(t.to_vec_i32(&device)?[..batch].to_vec());
            bar.inc(1);
        }
        drop((state, t));

        compare(batch, ("eager", &eager_tokens), ("graft", &graft_tokens))?;
        let skip = if args.tokens > SKIP { SKIP } else { 0 };
        let row = DemoRow {
            batch,
            bucket,
            eager_us: median_us(&eager_times[skip..]),
            graft_us: median_us(&graft_times[skip..]),
            tokens: graft_tokens,
        };
        bar.suspend(|| {
            writeln!(
                out,
                "{:>5} {:>6} {:>12} {:>12} {:>7.2}x  identical over {} steps; row 0: {}",
                row.batch,
                row.bucket,
                fmt_us(row.eager_us),
                fmt_us(row.graft_us),
                row.eager_us / row.graft_us.max(f64::MIN_POSITIVE),
                args.tokens,
                preview(&row.tokens)
            )
        })?;
        rows.push(row);
    }
    bar.finish_and_clear();

    let stats = g.stats();
    let roots = g.nodes().iter().filter(|n| n.depth == 0).count();
    writeln!(
        out,
        "\ntree:  {} nodes ({} roots, one per bucket), {} warmups, {} recordings, {} replays, {} restores, {} generations",
        stats.nodes,
        roots,
        stats.warmups,
        stats.recordings,
        stats.replays,
        stats.restores,
        stats.generations
    )?;
    writeln!(
        out,
        "pool:  mapped {}, peak mapped {}, peak allocated {} (graph pool); weights and caches {}",
        mib(stats.pool.mapped),
        mib(stats.pool.peak_mapped),
        mib(stats.pool.peak_allocated),
        mib(stats.eager_pool.mapped)
    )?;
    if let Some(path) = &args.dot {
        std::fs::write(path, g.dump_dot()).map_err(|source| CliError::WriteFile {
            path: path.clone(),
            source,
        })?;
        writeln!(out, "dot:   wrote the tree to {}", path.display())?;
    }
    Ok(DemoReport {
        device: describe,
        config,
        rows,
        stats,
        roots,
    })
}

/// Starts a new sequence on `state` when its KV cache is full (outside any timing).
pub(crate) fn make_room<D: Device>(state: &mut KvState, device: &D) -> Result<(), CliError> {
    if state.steps() >= state.capacity() {
        state.reset(device)?;
    }
    Ok(())
}

/// The first tokens of row 0, for the report.
fn preview(tokens: &[Vec<i32>]) -> String {
    let shown: Vec<String> = tokens
        .iter()
        .take(8)
        .filter_map(|step| step.first().map(i32::to_string))
        .collect();
    let more = if tokens.len() > 8 { " ..." } else { "" };
    format!("{}{more}", shown.join(" "))
}

pub(crate) fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}
