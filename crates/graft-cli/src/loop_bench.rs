//! `graft bench loop`: K tokens per launch against one launch per token, on the decoder.
//!
//! At each batch size and K, per token, in one run: (a) per step, what a server does without a
//! device loop: one graft replay of the step and a host read of its tokens per token
//! ([`Decoder::generate_per_step`]); (b) the device loop: one launch of K steps, then one host
//! read ([`Decoder::generate_graft`]); their ratio (a)/(b); (c) the floor: K replays of the
//! same step back to back with no host read, then one synchronize (the device's time for the
//! step when launches are never waited on); and (d) what each loop iteration costs over it,
//! (b) - (c). Each repeat runs the three from position 0 with the generator seeded alike
//! (untimed reset), so (a) and (b) decode the same tokens, which is checked; every path is
//! warmed up and recorded first, and the medians over the repeats are reported.

use std::io::Write;
use std::time::Instant;

use graft_core::{Config, Graft, Outcome};
use graft_tensor::{
    Decoder, DecoderConfig, Generated, KvState, LoopSpec, Meta, PAD, Sampling, Tensor,
};
use serde::Serialize;

use crate::bench::ConfigJson;
use crate::demo::check_batches;
use crate::error::CliError;
use crate::progress;
use crate::timing::{fmt_us, median};
use crate::tokens::{compare, first_tokens};
use crate::{Backend, LoopBenchArgs};

/// The K the summary line reports.
pub const HEADLINE_K: usize = 32;

/// Untimed repeats before the timed ones: graft's warmup and recording of the loop.
const WARMUP: usize = 2;

/// The generator's seed of every repeat.
const DRAWS: u64 = 0x5eed;

/// Defaults on a GPU: batches, K values, repeats.
const GPU_DEFAULTS: (&[usize], &[usize], usize) = (&[1, 8, 32], &[8, 32, 128], 9);
/// Defaults on the simulator (small, so the run takes seconds).
const SIM_DEFAULTS: (&[usize], &[usize], usize) = (&[1, 4], &[8, 32], 3);

/// One batch size and K: per-token medians in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoopRow {
    /// Batch size.
    pub batch: usize,
    /// Bucket it was padded to.
    pub bucket: usize,
    /// Tokens per sequence per launch.
    pub k: usize,
    /// (a) One graft replay and one host read per token.
    pub per_step_us: f64,
    /// (b) The device loop: one launch and one host read per K tokens.
    pub loop_us: f64,
    /// (a) / (b): how much faster the loop is per token.
    pub speedup: f64,
    /// (c) Back-to-back replays of the step without host reads.
    pub floor_us: f64,
    /// (d) (b) - (c): what a loop iteration costs over the step itself.
    pub overhead_us: f64,
    /// Whether every timed loop launch replayed its recorded loop (false: it ran eagerly,
    /// its loop on the host; see the report's note).
    pub loop_replayed: bool,
}

/// The sampling parameters, as written to JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingJson {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
}

/// All results, as written to JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoopReport {
    /// The device's description.
    pub device: String,
    /// Whether this ran on the simulator (times then measure the host, not a GPU).
    pub simulator: bool,
    /// The decoder.
    pub config: ConfigJson,
    /// How tokens were picked.
    pub sampling: SamplingJson,
    /// Timed repeats per path, batch size and K.
    pub repeats: usize,
    /// What the times are.
    pub method: String,
    /// One row per batch size and K.
    pub results: Vec<LoopRow>,
}

/// Runs the loop benchmark on the backend `args` selects.
pub fn run(args: &LoopBenchArgs, out: &mut dyn Write) -> Result<LoopReport, CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let (config, name) = backend.config();
    match backend {
        Backend::Cuda(dev) => run_on(dev, config, name, false, args, out),
        Backend::Sim(dev) => run_on(dev, config, name, true, args, out),
    }
}

/// What the flags ask for, with the backend's defaults for those not given.
struct Plan {
    batches: Vec<usize>,
    ks: Vec<usize>,
    repeats: usize,
    sampling: Sampling,
}

impl Plan {
    fn of(args: &LoopBenchArgs, simulator: bool) -> Result<Plan, CliError> {
        let (batches, ks, repeats) = if simulator {
            SIM_DEFAULTS
        } else {
            GPU_DEFAULTS
        };
        let or = |given: &[usize], default: &[usize]| {
            if given.is_empty() {
                default.to_vec()
            } else {
                given.to_vec()
            }
        };
        let plan = Plan {
            batches: or(&args.batches, batches),
            ks: or(&args.tokens, ks),
            repeats: args.repeats.unwrap_or(repeats),
            sampling: Sampling::new(args.temperature, args.top_k).map_err(|e| {
                CliError::BadArgument {
                    flag: "--temperature",
                    why: e.to_string(),
                }
            })?,
        };
        check_batches(&plan.batches)?;
        if plan.repeats == 0 {
            return Err(CliError::BadArgument {
                flag: "--repeats",
                why: "at least one timed repeat is needed; pass --repeats 1 or more".into(),
            });
        }
        Ok(plan)
    }

    /// The benchmark's decoder: `config`, its context raised to the largest K on the
    /// simulator (whose tiny config is short), up to the benchmark config's; every K must fit
    /// it.
    fn decoder(&self, config: DecoderConfig, simulator: bool) -> Result<DecoderConfig, CliError> {
        let longest = self.ks.iter().copied().max().unwrap_or(1);
        let longest = longest.min(DecoderConfig::bench().ctx);
        let config = if simulator && config.ctx < longest {
            DecoderConfig {
                ctx: longest,
                ..config
            }
        } else {
            config
        };
        let ctx = config.ctx;
        if let Some(&k) = self.ks.iter().find(|&&k| k == 0 || k > ctx) {
            return Err(CliError::BadArgument {
                flag: "--tokens",
                why: format!("K = {k} does not fit the context of {ctx}; pass K from 1 to {ctx}"),
            });
        }
        Ok(config)
    }
}

/// The registered functions and the decoder they run.
struct Bench<'d, D: graft_tensor::Backend> {
    dec: &'d Decoder<D>,
    step: graft_core::FunctionId,
    looped: graft_core::FunctionId,
}

/// One repeat's per-token times of the three paths, the tokens of (a) and (b), and what
/// graft did in the loop's launch.
struct Repeat {
    per_step: f64,
    looped: f64,
    floor: f64,
    tokens: [Vec<Vec<i32>>; 2],
    outcome: Option<Outcome>,
}

impl<D: graft_tensor::Backend> Bench<'_, D> {
    /// Position 0, generator seeded with [`DRAWS`], the first tokens: every path's start.
    fn start(
        &self,
        g: &mut Graft<D, Meta>,
        state: &mut KvState,
        ids: &[i32],
    ) -> Result<Tensor, CliError> {
        state.reset(g.device())?;
        state.seed(g.device(), DRAWS)?;
        Ok(self.dec.tokens_in(g, ids, state.bucket())?)
    }

    /// Runs (a), (b) and (c) once each from the same start.
    fn repeat(
        &self,
        g: &mut Graft<D, Meta>,
        state: &mut KvState,
        ids: &[i32],
        spec: &LoopSpec,
    ) -> Result<Repeat, CliError> {
        let k = spec.max_tokens;
        let left = vec![k; ids.len()];
        let per_token = |start: Instant| start.elapsed().as_secs_f64() * 1e6 / k as f64;

        let tokens = self.start(g, state, ids)?;
        let start = Instant::now();
        let a = self
            .dec
            .generate_per_step(g, self.step, state, &tokens, &left, spec)?;
        let per_step = per_token(start);

        let tokens = self.start(g, state, ids)?;
        let start = Instant::now();
        let b = self
            .dec
            .generate_graft(g, self.looped, state, &tokens, &left, spec)?;
        let looped = per_token(start);

        let mut tokens = self.start(g, state, ids)?;
        g.device().synchronize()?;
        let start = Instant::now();
        for _ in 0..k {
            let (next, _) =
                self.dec
                    .step_sampled_graft(g, self.step, state, &tokens, spec.sampling)?;
            tokens = next;
        }
        g.device().synchronize()?;
        let floor = per_token(start);
        Ok(Repeat {
            per_step,
            looped,
            floor,
            tokens: [by_step(&a), by_step(&b)],
            outcome: b.outcome,
        })
    }
}

/// A launch's tokens step by step (each step's tokens of the real rows, [`PAD`] for a row
/// that had stopped).
fn by_step(r: &Generated) -> Vec<Vec<i32>> {
    (0..r.steps)
        .map(|i| {
            r.emitted
                .iter()
                .map(|row| row.get(i).copied().unwrap_or(PAD))
                .collect()
        })
        .collect()
}

/// Runs the loop benchmark on `device` with `config` (its context raised to the largest K on
/// the simulator).
pub fn run_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    config_name: &str,
    simulator: bool,
    args: &LoopBenchArgs,
    out: &mut dyn Write,
) -> Result<LoopReport, CliError> {
    let plan = Plan::of(args, simulator)?;
    let config = plan.decoder(config, simulator)?;
    let config = match args.layers {
        Some(0) => {
            return Err(CliError::BadArgument {
                flag: "--layers",
                why: "a decoder needs at least one layer; pass --layers 1 or more".into(),
            });
        }
        Some(layers) => DecoderConfig { layers, ..config },
        None => config,
    };
    let describe = device.describe();
    writeln!(out, "device:   {describe}")?;
    if simulator {
        writeln!(
            out,
            "note:     no GPU in use: running the {config_name} config (context {}) on the host simulator; the times measure the simulator, not a GPU",
            config.ctx
        )?;
    }
    writeln!(out, "decoder:  {config_name} config ({config})")?;
    let s = plan.sampling;
    let picking = if s.is_greedy() {
        "greedy".to_string()
    } else {
        format!("temperature {}, top-k {}", s.temperature, s.top_k)
    };
    writeln!(out, "sampling: {picking}")?;
    let method = format!(
        "per token, median of {} repeats of K tokens from position 0 (every path warmed up and recorded first): \
         (a) per step = one graft replay + one host read per token; (b) loop = one launch + one host read per K tokens; \
         (c) floor = K replays back to back, no host read, one synchronize; (d) = (b) - (c)",
        plan.repeats
    );
    writeln!(out, "method:   {method}")?;

    let cases = plan.batches.len() * plan.ks.len();
    // One loop signature per batch size and K, by design: no warning for that many.
    let config_g = Config {
        signature_warn_limit: cases.max(Config::default().signature_warn_limit),
        ..Config::default()
    };
    let mut g: Graft<D, Meta> = Graft::new(device.clone(), config_g);
    let dec = Decoder::new(&mut g, config, args.seed)?;
    let bench = Bench {
        dec: &dec,
        step: dec.register_sampled(&mut g),
        looped: dec.register_loop(&mut g),
    };
    let bar = progress::bar((cases * (plan.repeats + WARMUP)) as u64);
    bar.suspend(|| {
        writeln!(
            out,
            "\n{:>5} {:>6} {:>4} {:>14} {:>12} {:>8} {:>12} {:>14}",
            "batch", "bucket", "K", "per step (a)", "loop (b)", "a/b", "floor (c)", "loop - floor"
        )
    })?;
    let mut results = Vec::with_capacity(cases);
    let mut eager_loops = Vec::new();
    for &batch in &plan.batches {
        let bucket = g.bucket(bench.looped, batch)?.size();
        let mut state = dec.new_state(&mut g, bucket)?;
        let ids = first_tokens(batch, config.vocab);
        for &k in &plan.ks {
            bar.set_message(format!("batch {batch}, K {k}"));
            let spec = LoopSpec {
                max_tokens: k,
                eos: None,
                sampling: plan.sampling,
            };
            // Untimed: the loop's warmup and recording (one launch each) and the step's
            // (the first two calls of the first per-step run), then replays.
            for _ in 0..WARMUP {
                bench.repeat(&mut g, &mut state, &ids, &spec)?;
                bar.inc(1);
            }
            let mut runs = Vec::with_capacity(plan.repeats);
            for _ in 0..plan.repeats {
                let r = bench.repeat(&mut g, &mut state, &ids, &spec)?;
                compare(
                    batch,
                    ("per step", &r.tokens[0]),
                    ("device loop", &r.tokens[1]),
                )?;
                runs.push(r);
                bar.inc(1);
            }
            let med = |f: fn(&Repeat) -> f64| median(runs.iter().map(f).collect());
            let (a, b, c) = (med(|r| r.per_step), med(|r| r.looped), med(|r| r.floor));
            let replayed = runs
                .iter()
                .all(|r| matches!(r.outcome, Some(Outcome::Replayed(_))));
            if let Some(why) = runs.iter().find_map(|r| match &r.outcome {
                Some(Outcome::Eager(why)) => Some(why.to_string()),
                _ => None,
            }) {
                eager_loops.push(format!("batch {batch}, K {k}: {why}"));
            }
            let row = LoopRow {
                batch,
                bucket,
                k,
                per_step_us: a,
                loop_us: b,
                speedup: a / b.max(f64::MIN_POSITIVE),
                floor_us: c,
                overhead_us: b - c,
                loop_replayed: replayed,
            };
            bar.suspend(|| {
                writeln!(
                    out,
                    "{:>5} {:>6} {:>4} {:>14} {:>12} {:>7.2}x {:>12} {:>14}",
                    row.batch,
                    row.bucket,
                    row.k,
                    fmt_us(row.per_step_us),
                    fmt_us(row.loop_us),
                    row.speedup,
                    fmt_us(row.floor_us),
                    fmt_signed_us(row.overhead_us),
                )
            })?;
            results.push(row);
        }
    }
    bar.finish_and_clear();
    writeln!(
        out,
        "tokens:   identical between the device loop and one launch per token at every batch size and K"
    )?;
    for line in &eager_loops {
        writeln!(
            out,
            "note:     the loop ran eagerly (its loop on the host), so (b) does not measure a device loop: {line}"
        )?;
    }
    for r in results.iter().filter(|r| r.k == HEADLINE_K) {
        writeln!(
            out,
            "headline: batch {}, K = {HEADLINE_K}: per step / loop = {:.2}x per token ({} per step, {} in the loop)",
            r.batch,
            r.speedup,
            fmt_us(r.per_step_us),
            fmt_us(r.loop_us)
        )?;
    }

    let report = LoopReport {
        device: describe,
        simulator,
        config: ConfigJson::of(config_name, &config),
        sampling: SamplingJson {
            temperature: s.temperature,
            top_k: s.top_k,
        },
        repeats: plan.repeats,
        method,
        results,
    };
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").map_err(|source| CliError::WriteFile {
            path: path.clone(),
            source,
        })?;
        writeln!(out, "json:     wrote {}", path.display())?;
    }
    Ok(report)
}

/// [`fmt_us`] of a difference, which may be negative (the loop may beat the floor when its
/// iterations overlap what the floor's launches leave idle).
fn fmt_signed_us(us: f64) -> String {
    if us < 0.0 {
        format!("-{}", fmt_us(-us))
    } else {
        fmt_us(us)
    }
}
