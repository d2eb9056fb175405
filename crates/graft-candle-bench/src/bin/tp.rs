//! graft-candle-tp: the Llama port split over GPUs, Megatron style (tensor parallelism: the
//! attention heads and the MLP split, two NCCL sum all-reduces per layer captured into each
//! rank's graphed decode step: graft's one-shot kernel over NVLink up to `--one-shot-limit`
//! bytes, NCCL above), one process per GPU, against the same model on one GPU.
//!
//! The parent first runs the whole model on GPU 0 alone (graft-candle and a hand-made graph),
//! then frees it and starts `--procs` copies of itself as a job on this host (graft's
//! `launch_local`), one rank per GPU (`--as-rank`: see `tp/rank.rs`). Each rank loads its part
//! of the same random weights, so the results compare token for token:
//!
//! 1. tokens: a Llama of `Sizes::BENCH` in f32, 64 greedy steps under graft-candle at every
//!    batch size, checked equal on every rank to the one-GPU model's;
//! 2. step time: each `--models` Llama in bf16 at every batch size: graft-candle's decode step
//!    (call plus synchronize, median) and a hand-made single CUDA graph of the same step (the
//!    raw baseline), on one GPU and on every rank.
//!
//! Needs `--procs` CUDA GPUs, libnccl, and `NCCL_RUNTIME_CONNECT=0` (set for the ranks here,
//! with `NCCL_NVLS_ENABLE=0`; scripts/gpu-run.sh sets both too). GPU only (`cuda` feature).
//!
//! usage: graft-candle-tp [--procs 2] [--steps 120] [--rounds 3] [--batches 1,8,32]
//!        [--models one-b,eight-b] [--per-op] [--one-shot-limit BYTES] [--split-vocab] [--job-timeout 900] [--json PATH]

#[path = "tp/measure.rs"]
mod measure;
#[path = "tp/rank.rs"]
mod rank;

use std::time::{Duration, Instant};

use graft_candle::candle_core::cuda_backend::cudarc::driver::CudaContext;
use graft_candle::candle_core::{DType, Device};
use graft_candle::{Buckets, CandleGraft};
use graft_candle_bench::common::{BUCKETS, BenchResult, Timing, exit_on_error, gpu};
use graft_candle_bench::decode::CHECK_STEPS;
use graft_candle_models::llama::{self, Sizes};
use graft_launch::{RankExit, launch_local};

use measure::{CHECK, SEED, Timed, Tokens};
use rank::{REPORT, RankReport};

/// The lines of a failed rank's stderr an error quotes.
const STDERR_LINES: usize = 20;

/// The models timed in bf16.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Model {
    /// `Sizes::ONE_B` (~1.1B parameters).
    OneB,
    /// `Sizes::EIGHT_B` (Llama-3-8B's shapes, 8.0B parameters).
    EightB,
}

impl Model {
    fn sizes(self) -> Sizes {
        match self {
            Model::OneB => Sizes::ONE_B,
            Model::EightB => Sizes::EIGHT_B,
        }
    }

    /// The flag's value (and the name in the table and the JSON).
    fn name(self) -> &'static str {
        match self {
            Model::OneB => "one-b",
            Model::EightB => "eight-b",
        }
    }
}

/// The benchmark's flags.
#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-tp",
    about = "The Llama port split over GPUs (one process each, NCCL inside the graphs) against one GPU"
)]
struct Options {
    /// Processes, one per GPU, the model is split over.
    #[arg(long, default_value_t = 2)]
    procs: usize,
    /// Timed steps per variant and batch size (split over the rounds).
    #[arg(long, default_value_t = 120)]
    steps: usize,
    /// Batch sizes (the decode step's buckets).
    #[arg(long, value_delimiter = ',', default_values_t = BUCKETS)]
    batches: Vec<usize>,
    /// Models timed in bf16.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["one-b", "eight-b"])]
    models: Vec<Model>,
    /// The largest all-reduce (bytes) the ranks send through graft's one-shot kernel over
    /// peer memory instead of NCCL (`TpComm::set_one_shot_limit`; 0: NCCL always). Left out:
    /// the default (on where the GPUs reach each other's memory).
    #[arg(long)]
    one_shot_limit: Option<usize>,
    /// Split the embedding and the output head by vocabulary rows too (`Shard::split_vocab`).
    #[arg(long)]
    split_vocab: bool,
    /// Decode op by op, on one GPU and on every rank, instead of as one chain of
    /// programmatic dependents (`Decoder::set_chained_step`; a rank's chain sums over the
    /// ranks between its kernels, and with a split vocabulary after its embedding too).
    #[arg(long)]
    per_op: bool,
    /// Seconds the job of `--procs` processes may run before it is killed.
    #[arg(long, default_value_t = 900)]
    job_timeout: u64,
    #[command(flatten)]
    timing: Timing,
    /// Run as one rank of a job (the parent passes it; the place comes from the environment).
    #[arg(long, hide = true)]
    as_rank: bool,
}

fn main() {
    exit_on_error("graft-candle-tp", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    o.timing.per_round(o.steps)?;
    if o.as_rank {
        return rank::run(&o, &mut std::io::stdout().lock());
    }
    if o.procs < 2 {
        return Err("--procs: tensor parallelism needs at least 2 processes".into());
    }
    let gpus = usize::try_from(CudaContext::device_count()?).unwrap_or(0);
    if gpus < o.procs {
        return Err(format!(
            "{} processes need {} CUDA GPUs; found {gpus}",
            o.procs, o.procs
        )
        .into());
    }
    let names: Vec<&str> = o.models.iter().map(|m| m.name()).collect();
    println!(
        "tensor parallelism: Llama port over {} GPUs (one process each) against 1 GPU; tokens: {CHECK} in f32; bf16 step time of {} at B = {:?}, {} timed steps per variant in {} rounds, median",
        o.procs,
        names.join(", "),
        o.batches,
        o.steps,
        o.timing.rounds
    );
    let started = Instant::now();
    let (want, one) = {
        let device = gpu()?;
        one_gpu(&o, &device)?
    };
    println!(
        "1 GPU done in {:.1} s; starting {} ranks",
        started.elapsed().as_secs_f64(),
        o.procs
    );
    let started = Instant::now();
    let reports = job(&o)?;
    println!(
        "{} ranks done in {:.1} s",
        o.procs,
        started.elapsed().as_secs_f64()
    );
    let differs = check_tokens(&o, &want, &reports);
    table(&o, &one, &reports, differs.is_empty())?;
    if !differs.is_empty() {
        return Err(format!("TOKENS DIFFER from one GPU: {}", differs.join("; ")).into());
    }
    Ok(())
}

/// The whole models on one GPU: the check model's tokens and every model's times.
fn one_gpu(o: &Options, device: &Device) -> BenchResult<(Tokens, Vec<Vec<Timed>>)> {
    let buckets = || Buckets::new(o.batches.iter().copied());
    let model = llama::random(&CHECK, SEED, DType::F32, device)?;
    let mut graft = CandleGraft::new(device)?;
    let step = graft.register_bucketed("decode", buckets()?);
    let tokens = measure::tokens(&model, &mut graft, step, &o.batches, CHECK_STEPS)?;
    drop(graft);
    drop(model);
    let mut timed = Vec::new();
    for m in &o.models {
        let started = Instant::now();
        let mut model = llama::random(&m.sizes(), SEED, DType::BF16, device)?;
        model.set_chained_step(!o.per_op);
        println!(
            "1 GPU: {} ({}) built in {:.1} s",
            m.name(),
            m.sizes(),
            started.elapsed().as_secs_f64()
        );
        let mut graft = CandleGraft::new(device)?;
        let step = graft.register_bucketed("decode", buckets()?);
        let per_batch = o
            .batches
            .iter()
            .map(|&b| measure::time_step(&model, &mut graft, step, b, o.steps, &o.timing))
            .collect::<BenchResult<Vec<_>>>()?;
        timed.push(per_batch);
    }
    device.synchronize()?;
    Ok((tokens, timed))
}

/// Runs the job of `--procs` ranks and gathers their reports, in rank order.
fn job(o: &Options) -> BenchResult<Vec<RankReport>> {
    let program = std::env::current_exe()?;
    let list = |v: Vec<String>| v.join(",");
    let mut args = vec![
        "--as-rank".to_owned(),
        "--steps".to_owned(),
        o.steps.to_string(),
        "--rounds".to_owned(),
        o.timing.rounds.to_string(),
        "--batches".to_owned(),
        list(o.batches.iter().map(usize::to_string).collect()),
        "--models".to_owned(),
        list(o.models.iter().map(|m| m.name().to_owned()).collect()),
    ];
    if let Some(limit) = o.one_shot_limit {
        args.extend(["--one-shot-limit".to_owned(), limit.to_string()]);
    }
    if o.split_vocab {
        args.push("--split-vocab".to_owned());
    }
    if o.per_op {
        args.push("--per-op".to_owned());
    }
    let env = [
        ("NCCL_RUNTIME_CONNECT", "0".to_owned()),
        ("NCCL_NVLS_ENABLE", "0".to_owned()),
    ];
    let ranks: Vec<usize> = (0..o.procs).collect();
    let exits = launch_local(
        &program,
        &args,
        o.procs,
        &ranks,
        &env,
        Duration::from_secs(o.job_timeout),
        true,
    )?;
    gather(&exits)
}

/// The reports of a finished job; or the first failed rank's error with its stderr's tail.
fn gather(exits: &[RankExit]) -> BenchResult<Vec<RankReport>> {
    if let Some(e) = exits
        .iter()
        .find(|e| e.status.is_some_and(|s| !s.success()))
    {
        let lines: Vec<&str> = e.stderr.lines().collect();
        return Err(format!(
            "rank {} failed (exit code {:?}); its stderr ends:\n{}",
            e.rank,
            e.code(),
            lines[lines.len().saturating_sub(STDERR_LINES)..].join("\n")
        )
        .into());
    }
    if let Some(e) = exits.iter().find(|e| e.status.is_none()) {
        return Err(format!(
            "rank {} was still running after {:.0} s and was killed: raise --job-timeout",
            e.rank,
            e.took.as_secs_f64()
        )
        .into());
    }
    exits
        .iter()
        .map(|e| {
            let stdout = String::from_utf8_lossy(&e.stdout);
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix(REPORT))
                .ok_or_else(|| format!("rank {} wrote no report; its stdout:\n{stdout}", e.rank))?;
            Ok(serde_json::from_str(line)?)
        })
        .collect()
}

/// Where each rank's tokens first differ from one GPU's: empty when all are equal.
fn check_tokens(o: &Options, want: &Tokens, reports: &[RankReport]) -> Vec<String> {
    let mut differs = Vec::new();
    for r in reports {
        for ((batch, want), got) in o.batches.iter().zip(want).zip(&r.tokens) {
            if let Some(step) = (0..want.len()).find(|&s| got.get(s) != Some(&want[s])) {
                differs.push(format!("rank {} at B={batch} from step {step}", r.rank));
            }
        }
    }
    differs
}

/// Prints the table (and writes the JSON) of one GPU against every rank.
fn table(
    o: &Options,
    one: &[Vec<Timed>],
    reports: &[RankReport],
    tokens_equal: bool,
) -> BenchResult<()> {
    println!(
        "\ntokens ({CHECK}, f32, {CHECK_STEPS} steps at B = {:?}): {}",
        o.batches,
        if tokens_equal {
            "every rank = 1 GPU"
        } else {
            "DIFFER (see below)"
        }
    );
    println!(
        "bf16 decode step, median us: graft = graft-candle's decode_into (call_into + sync), raw = hand-made single CUDA graph of the same step; TP = the slowest rank; per rank: graft / raw, decode (call + sync) / raw, and host us of decode_into / decode / the raw launch"
    );
    println!(
        "{:<8} {:>4} {:>11} {:>11} {:>11} {:>11} {:>8} {:>13} {:>13} {:>29}",
        "model",
        "B",
        "1 GPU graft",
        "1 GPU raw",
        "TP graft",
        "TP raw",
        "speedup",
        "graft/raw",
        "decode/raw",
        "host per rank"
    );
    let mut json = Vec::new();
    for (mi, m) in o.models.iter().enumerate() {
        for (bi, batch) in o.batches.iter().enumerate() {
            let single = one[mi][bi];
            let ranks: Vec<Timed> = reports.iter().map(|r| r.timed[mi][bi]).collect();
            let slowest = |f: fn(&Timed) -> f64| ranks.iter().map(f).fold(0.0, f64::max);
            let (tp_graft, tp_raw) = (slowest(|t| t.graft_us), slowest(|t| t.raw_us));
            let per_rank = |f: fn(&Timed) -> String| -> String {
                ranks.iter().map(f).collect::<Vec<_>>().join(" ")
            };
            println!(
                "{:<8} {:>4} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>7.2}x {:>13} {:>13} {:>29}",
                m.name(),
                batch,
                single.graft_us,
                single.raw_us,
                tp_graft,
                tp_raw,
                single.graft_us / tp_graft,
                per_rank(|t| format!("{:.3}", t.graft_us / t.raw_us)),
                per_rank(|t| format!("{:.3}", t.fresh_us / t.raw_us)),
                per_rank(|t| format!(
                    "{:.1}/{:.1}/{:.1}",
                    t.graft_host_us, t.fresh_host_us, t.raw_host_us
                )),
            );
            json.push(
                serde_json::json!({
                    "model": m.name(),
                    "batch": batch,
                    "procs": o.procs,
                    "one_gpu": single,
                    "ranks": ranks,
                    "tokens_identical": tokens_equal,
                })
                .to_string(),
            );
        }
    }
    o.timing.write_json(&json)
}
