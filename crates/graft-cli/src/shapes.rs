//! `graft bench capture | serve | update | inputs`: shapes at serving scale, on the benchmark
//! decoder (the GPU) or the tiny one (the simulator).
//!
//! - capture: every bucket recorded up front, largest first: time and graph-pool memory;
//! - serve: a skewed trace of batch sizes (`serve.rs`);
//! - update: a re-recording that updates the executable in place against one that
//!   instantiates a new one (through graft, and for a raw graph of the step with
//!   graft-core's token: graft-cli's `graft-baselines` bench);
//! - inputs: a 64 MiB read-only input per replay, copied against read in place (patched).

use std::io::Write;
use std::time::{Duration, Instant};

use graft_core::backend::CoreOnly;
use graft_core::{Buckets, Config, FunctionSpec, Graft, Outcome, PoolStats};
use graft_tensor::{DType, Decoder, DecoderConfig, KvState, Meta, Tensor, ops};

use crate::demo::make_room;
use crate::error::CliError;
use crate::progress;
use crate::timing::{fmt_us, median_us, timed};
use crate::tokens::first_tokens;
use crate::{Backend, NO_RAW, ShapesArgs};

pub(crate) const MIB: f64 = (1 << 20) as f64;

/// `count` bucket sizes spread evenly from 1 to `max` (32 sizes from 1 to 256 by default).
pub fn spread(count: usize, max: usize) -> Result<Buckets, CliError> {
    let bad = |why: &str| CliError::BadArgument {
        flag: "--buckets",
        why: why.into(),
    };
    if count == 0 || max == 0 {
        return Err(bad(
            "pass at least one bucket and a largest size of 1 or more",
        ));
    }
    let sizes = (0..count).map(|i| 1 + (i * (max - 1)) / (count - 1).max(1));
    Buckets::new(sizes).map_err(|e| bad(&e.to_string()))
}

/// Runs `f` on the device `args` selects, with its decoder configuration.
macro_rules! on_backend {
    ($args:expr, $out:expr, $f:ident) => {{
        let backend = $crate::Backend::pick($args.sim, $out)?;
        let (config, name) = backend.config();
        match backend {
            $crate::Backend::Cuda(dev) => $f(dev, config, name, $args, $out),
            $crate::Backend::Sim(dev) => $f(dev, config, name, $args, $out),
        }
    }};
}
pub(crate) use on_backend;

/// `graft bench capture`.
pub fn capture(args: &ShapesArgs, out: &mut dyn Write) -> Result<(), CliError> {
    on_backend!(args, out, capture_on)
}

/// Per-bucket states over one shared cache arena, with their first tokens.
pub(crate) struct Lanes {
    pub(crate) states: Vec<KvState>,
    pub(crate) tokens: Vec<Tensor>,
    sizes: Vec<usize>,
}

/// A runtime with `cfg`, the decoder registered with `buckets`, and its lanes.
pub(crate) type Setup<D> = (Graft<D, Meta>, Decoder<D>, graft_core::FunctionId, Lanes);

pub(crate) fn setup<D: graft_tensor::Backend>(
    device: &D,
    cfg: Config,
    config: DecoderConfig,
    seed: u64,
    buckets: &Buckets,
) -> Result<Setup<D>, CliError> {
    let mut g: Graft<D, Meta> = Graft::new(device.clone(), cfg);
    let dec = Decoder::new(&mut g, config, seed)?;
    let fid = dec.register_with(&mut g, buckets.clone());
    let lanes = Lanes::new(&mut g, &dec, buckets)?;
    Ok((g, dec, fid, lanes))
}

impl Lanes {
    fn new<D: graft_tensor::Backend>(
        g: &mut Graft<D, Meta>,
        dec: &Decoder<D>,
        buckets: &Buckets,
    ) -> Result<Lanes, CliError> {
        let arena = dec.cache_for(g, buckets.largest())?;
        let vocab = dec.config().vocab;
        let mut lanes = Lanes {
            states: Vec::new(),
            tokens: Vec::new(),
            sizes: buckets.sizes().to_vec(),
        };
        for &b in buckets.sizes() {
            lanes.states.push(dec.state_in(g, &arena, b)?);
            lanes
                .tokens
                .push(dec.tokens_in(g, &first_tokens(b, vocab), b)?);
        }
        Ok(lanes)
    }

    pub(crate) fn index(&self, bucket: usize) -> usize {
        self.sizes.partition_point(|&s| s < bucket)
    }
}

pub(crate) fn header(
    out: &mut dyn Write,
    device: &str,
    name: &str,
    config: &DecoderConfig,
) -> Result<(), CliError> {
    writeln!(out, "device:  {device}")?;
    writeln!(out, "decoder: {name} config ({config})")?;
    Ok(())
}

fn capture_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    name: &str,
    args: &ShapesArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    header(out, &device.describe(), name, &config)?;
    let buckets = spread(args.buckets, args.max)?;
    let (mut g, dec, fid, mut lanes) =
        setup(&device, Config::default(), config, args.seed, &buckets)?;
    device.synchronize()?;
    writeln!(
        out,
        "capturing {} buckets ({}..={}) of the decode step, largest first, warmups included",
        buckets.sizes().len(),
        buckets.sizes()[0],
        buckets.largest()
    )?;
    let bar = progress::bar(buckets.sizes().len() as u64);
    let mut largest_alone: Option<PoolStats> = None;
    let report = g.capture_buckets(fid, |g, b| -> Result<Outcome, CliError> {
        let i = lanes.index(b);
        let (_, outcome) =
            dec.step_graft_outcome(g, fid, &mut lanes.states[i], &lanes.tokens[i])?;
        if outcome != Outcome::Warmup {
            bar.inc(1);
            if largest_alone.is_none() {
                largest_alone = Some(g.stats().pool);
            }
        }
        Ok(outcome)
    })?;
    device.synchronize()?;
    bar.finish_and_clear();
    let stats = g.stats();
    let recorded = report
        .buckets
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Recorded(_)))
        .count();
    let mut per: Vec<Duration> = report.buckets.iter().map(|c| c.elapsed).collect();
    per.sort();
    let alone = largest_alone.map_or(0, |p| p.peak_mapped);
    let all = stats.pool.peak_mapped;
    writeln!(
        out,
        "recorded {recorded} of {} buckets in {:.3} s (per bucket: min {}, median {}, max {}; a lazy capture pays one of these on each bucket's first use)",
        report.buckets.len(),
        report.elapsed.as_secs_f64(),
        fmt_us(per[0].as_secs_f64() * 1e6),
        fmt_us(median_us(&per)),
        fmt_us(per[per.len() - 1].as_secs_f64() * 1e6),
    )?;
    writeln!(
        out,
        "graph pool: {:.1} MiB for all {} buckets, {:.1} MiB after the largest alone: {:.3}x",
        all as f64 / MIB,
        report.buckets.len(),
        alone as f64 / MIB,
        all as f64 / alone.max(1) as f64
    )?;
    // Every bucket replays on its first call afterwards.
    let mut replays = 0;
    for i in 0..lanes.states.len() {
        make_room(&mut lanes.states[i], &device)?;
        let (_, o) = dec.step_graft_outcome(&mut g, fid, &mut lanes.states[i], &lanes.tokens[i])?;
        replays += usize::from(matches!(o, Outcome::Replayed(_)));
    }
    writeln!(
        out,
        "afterwards {replays} of {} buckets replay on first use; {} nodes, {} graph-pool bytes mapped",
        buckets.sizes().len(),
        g.stats().nodes,
        g.stats().pool.mapped
    )?;
    Ok(())
}

/// `graft bench update` (the raw graph's part only with graft-core's token `raw`).
pub fn update(
    args: &ShapesArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let (config, name) = backend.config();
    match backend {
        Backend::Cuda(dev) => update_on(dev, config, name, args, raw, out),
        Backend::Sim(dev) => update_on(dev, config, name, args, raw, out),
    }
}

fn update_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    name: &str,
    args: &ShapesArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    header(out, &device.describe(), name, &config)?;
    let bucket = 8;
    let rounds = args.repeats.max(3);
    let ids = first_tokens(bucket, config.vocab);
    match raw {
        Some(core) => raw_update(core, &device, config, args.seed, bucket, rounds, &ids, out)?,
        None => writeln!(out, "{NO_RAW}")?,
    }
    graft_update(&device, config, args.seed, bucket, rounds, &ids, out)
}

/// The raw graph alone: capture the step for another state (other cache and position
/// addresses), then finish it by updating the executable in place, or by instantiating (and
/// uploading) a new one; the capture and the finish are timed apart.
#[allow(clippy::too_many_arguments)]
fn raw_update<D: graft_tensor::Backend>(
    core: &CoreOnly,
    device: &D,
    config: DecoderConfig,
    seed: u64,
    bucket: usize,
    rounds: usize,
    ids: &[i32],
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut g: Graft<D, Meta> = Graft::new(device.clone(), Config::default());
    let dec = Decoder::new(&mut g, config, seed)?;
    let states = [
        dec.new_state(&mut g, bucket)?,
        dec.new_state(&mut g, bucket)?,
    ];
    let tokens = [
        dec.tokens_in(&mut g, ids, bucket)?,
        dec.tokens_in(&mut g, ids, bucket)?,
    ];
    let mut kept = dec.capture_open(core, &mut g, &states[0], &tokens[0])?;
    let mut graph = device.end_capture(core)?;
    let (mut captures, mut updates, mut instantiations, mut refusals) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    for r in 0..=rounds {
        let i = (r + 1) % 2;
        device.synchronize()?;
        let start = Instant::now();
        let now_kept = dec.capture_open(core, &mut g, &states[i], &tokens[i])?;
        let captured = start.elapsed();
        let refusal = device.end_capture_into(core, &mut graph)?;
        let updated = start.elapsed() - captured;
        kept = now_kept;
        refusals += usize::from(refusal.is_some());
        device.synchronize()?;
        let start = Instant::now();
        let fresh_kept = dec.capture_open(core, &mut g, &states[i], &tokens[i])?;
        let captured_again = start.elapsed();
        let fresh = device.end_capture(core)?;
        let instantiated = start.elapsed() - captured_again;
        drop((fresh, fresh_kept));
        if r > 0 {
            captures.push(captured);
            updates.push(updated);
            instantiations.push(instantiated);
        }
    }
    drop((graph, kept));
    let (c, u, n) = (
        median_us(&captures),
        median_us(&updates),
        median_us(&instantiations),
    );
    writeln!(
        out,
        "raw decode step (bucket {bucket}), medians of {rounds}: capture {}, then update in place {} or instantiate + upload {}: the finish {:.1}x faster, capture + finish {:.2}x ({refusals} refusals)",
        fmt_us(c),
        fmt_us(u),
        fmt_us(n),
        n / u.max(1e-9),
        (c + n) / (c + u).max(1e-9)
    )?;
    Ok(())
}

/// Through graft: the decode step's KV cache (a static input) moves to a new state every
/// round; with replace_moved_static the re-recording updates the node's executable, without
/// it a sibling is instantiated.
fn graft_update<D: graft_tensor::Backend>(
    device: &D,
    config: DecoderConfig,
    seed: u64,
    bucket: usize,
    rounds: usize,
    ids: &[i32],
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut medians = Vec::new();
    for replace in [true, false] {
        let cfg = Config {
            replace_moved_static: replace,
            ..Config::default()
        };
        let mut g: Graft<D, Meta> = Graft::new(device.clone(), cfg);
        let dec = Decoder::new(&mut g, config, seed)?;
        let fid = dec.register(&mut g);
        let t = dec.tokens_in(&mut g, ids, bucket)?;
        let mut kept = Vec::new();
        let mut times = Vec::new();
        for r in 0..=rounds + 1 {
            let mut state = dec.new_state(&mut g, bucket)?;
            device.synchronize()?;
            let ((_, outcome), dt) = timed(device, || {
                dec.step_graft_outcome(&mut g, fid, &mut state, &t)
            })?;
            if r >= 2 && matches!(outcome, Outcome::Recorded(_)) {
                times.push(dt);
            }
            kept.push(state);
        }
        let s = g.stats();
        writeln!(
            out,
            "graft re-record of the decode step after its cache moved, replace_moved_static={replace}: median {} over {} re-recordings ({} updated in place, {} refused, {} nodes)",
            fmt_us(median_us(&times)),
            times.len(),
            s.updates_in_place,
            s.update_refusals,
            s.nodes
        )?;
        medians.push(median_us(&times));
    }
    writeln!(
        out,
        "graft re-record, update over instantiate: {:.2}x faster",
        medians[1] / medians[0].max(1e-9)
    )?;
    Ok(())
}

/// `graft bench inputs`.
pub fn inputs(args: &ShapesArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let backend = Backend::pick(args.sim, out)?;
    writeln!(out, "device:  {}", backend.describe())?;
    writeln!(
        out,
        "one matrix-vector product, y[1, n] = x[1, n] . w[n, n], with w a copied input the graph only reads; per replay, median of {} synchronized calls",
        args.steps
    )?;
    writeln!(
        out,
        "{:>8} {:<8} {:>12} {:>12} {:>10}",
        "w", "buffer", "copy", "patch", "copy/patch"
    )?;
    // 64 KiB (the default threshold), 1 MiB, 64 MiB; the simulator stops at 4 MiB.
    match backend {
        Backend::Cuda(dev) => [128, 512, 4096]
            .into_iter()
            .try_for_each(|n| inputs_on(dev.clone(), n, args, out)),
        Backend::Sim(dev) => [128, 512, 1024]
            .into_iter()
            .try_for_each(|n| inputs_on(dev.clone(), n, args, out)),
    }
}

fn inputs_on<D: graft_tensor::Backend>(
    device: D,
    n: usize,
    args: &ShapesArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let kib = n * n * 4 / 1024;
    let size = if kib >= 1024 {
        format!("{} MiB", kib / 1024)
    } else {
        format!("{kib} KiB")
    };
    let k = device.load_ops()?;
    for moving in [false, true] {
        let mut medians = Vec::new();
        let mut patched = 0;
        for patch in [false, true] {
            let cfg = Config {
                patch_inputs_from: patch.then_some(64 << 10),
                ..Config::default()
            };
            let mut g: Graft<D, Meta> = Graft::new(device.clone(), cfg);
            let f = g.register("gemv", FunctionSpec::inference([0]));
            let x = Tensor::from_f32(&mut g, &[1, n], &vec![0.5; n])?;
            let ws = [
                Tensor::from_f32(&mut g, &[n, n], &vec![0.25; n * n])?,
                Tensor::from_f32(&mut g, &[n, n], &vec![0.25; n * n])?,
            ];
            let mut outs = Vec::new();
            let mut times = Vec::new();
            for s in 0..args.steps + 3 {
                let w = &ws[if moving { s % 2 } else { 0 }];
                let ((), dt) = timed(&device, || -> Result<(), CliError> {
                    g.call_into(
                        f,
                        &[x.buffer(), w.buffer()],
                        &[],
                        |ctx| {
                            let ins = ctx.inputs();
                            let x = Tensor::from_buffer(ins[0].clone(), &[1, n], DType::F32)?;
                            let w = Tensor::from_buffer(ins[1].clone(), &[n, n], DType::F32)?;
                            let y = ops::linear(&k, ctx, &x, &w, None, None, false)?;
                            Ok(vec![y.into_output()])
                        },
                        &mut outs,
                    )?;
                    Ok(())
                })?;
                if s >= 3 {
                    times.push(dt);
                }
            }
            let y = g.read_f32(&outs[0].buffer)?;
            let expect = 0.5 * 0.25 * n as f32;
            if y.iter().any(|v| (v - expect).abs() > 1e-3 * expect) {
                return Err(CliError::BadArgument {
                    flag: "bench inputs",
                    why: format!(
                        "the product gave {} instead of {expect}; this is a bug, please report it",
                        y[0]
                    ),
                });
            }
            patched = g.stats().patched_inputs;
            medians.push(median_us(&times));
        }
        writeln!(
            out,
            "{size:>8} {:<8} {:>12} {:>12} {:>10.2}{}",
            if moving { "moving" } else { "stable" },
            fmt_us(medians[0]),
            fmt_us(medians[1]),
            medians[0] / medians[1].max(1e-9),
            if patched == 0 {
                "  (the device refused the patch: both copy)"
            } else {
                ""
            }
        )?;
    }
    Ok(())
}
