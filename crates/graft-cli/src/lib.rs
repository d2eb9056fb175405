//! graft-cli: the logic of the `graft` command (the binary's `main` only parses and calls in).
//!
//! - `graft demo`: decodes tokens with the benchmark decoder through graft and eagerly, checks
//!   the tokens are identical, and reports step times, the tree's statistics and its pool.
//! - `graft bench`: the decoder step timed three ways (eager, graft replay, one raw graph
//!   without the tree), as a table and as JSON. `graft bench decoder` is the same; further
//!   benchmarks go beside it as `graft bench <what>` ([`BenchWhat`]), among them `graft bench
//!   tp`, the decoder split tensor-parallel over several GPUs (NCCL), or over simulated
//!   devices when there are not enough, and `graft bench loop`, K tokens per launch in a
//!   device-side loop against one launch and one host read per token.
//!
//! Both use the GPU when [`graft_cuda::CudaDevice::is_available`] (the benchmark config),
//! else the simulator (the tiny config), and say which.
//!
//! The raw-graph baselines (the same work captured as a plain graph with the device's sealed
//! capture calls and launched raw, what graft's replay is compared against) need graft-core's
//! token ([`CoreOnly`]), which only graft's tests and benchmarks can make (graft-core's
//! `test-support` feature, which no normal dependency enables). The `graft` binary runs
//! without one ([`run`]) and says what it left out; graft-cli's `graft-baselines` bench target
//! (`benches/baselines.rs`) is the same command line with the token ([`run_with`], [`main`]).

pub mod bench;
pub mod demo;
mod error;
pub mod guard_bench;
pub mod loop_bench;
pub mod micro;
mod progress;
pub mod serve;
pub mod shapes;
mod timing;
mod tokens;
pub mod tp;
mod tp_procs;

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use graft_core::Device;
use graft_core::backend::CoreOnly;
use graft_cuda::CudaDevice;
use graft_sim::SimDevice;
use graft_tensor::DecoderConfig;

pub use error::CliError;

/// What a benchmark prints in place of its raw-graph baseline when it runs without
/// graft-core's token (the `graft` binary).
pub(crate) const NO_RAW: &str = "raw graph: not measured: the raw-graph baseline captures with the device's sealed calls, which only graft's benchmarks may make; run the same command line as `cargo bench -p graft-cli --bench graft-baselines -- ARGS` (staged: stage/bin/graft-baselines ARGS)";

/// graft: CUDA graph trees for Rust tensor frameworks.
#[derive(Parser, Debug)]
#[command(name = "graft", version, about, long_about = None)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Decode tokens through graft and eagerly, check they match, report times and the tree.
    Demo(DemoArgs),
    /// Benchmarks (the decoder step by default).
    Bench(BenchCmd),
}

/// Arguments of `graft demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Tokens to generate per batch size (at most the decoder's context).
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// Batch sizes, comma-separated (each padded to its bucket: 1, 2, 4, 8, 16, 32).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub batches: Vec<usize>,
    /// Write the graph tree as Graphviz DOT to this file.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<std::path::PathBuf>,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// `graft bench`: a group of benchmarks. Without a subcommand it runs the decoder benchmark
/// with the flags given here.
#[derive(Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchCmd {
    /// Which benchmark.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    /// Flags of the decoder benchmark (the default).
    #[command(flatten)]
    pub decoder: DecoderBenchArgs,
}

/// The benchmarks of `graft bench`.
#[derive(Subcommand, Debug, Clone)]
pub enum BenchWhat {
    /// The decoder step: eager, graft replay, and one raw graph without the tree.
    Decoder(DecoderBenchArgs),
    /// The replay fast path: a 10-kernel chain (8 inputs, 1 copied) as eager launches, a raw
    /// graph launch, and a tree replay, per call.
    Micro(MicroArgs),
    /// Capture every bucket of the decode step up front, largest first: time and memory.
    Capture(ShapesArgs),
    /// A serving-like trace of batch sizes: a graph budget against none, against eager, and
    /// against the best fixed choice of as many buckets.
    Serve(ShapesArgs),
    /// Re-recording by in-place executable update against instantiating a new one.
    Update(ShapesArgs),
    /// A 64 MiB read-only input per replay: copied into the graph against patched in place.
    Inputs(ShapesArgs),
    /// The decoder split tensor-parallel over several devices (NCCL on GPUs): tokens of graft
    /// against eager and raw graphs, and per-step times against one device.
    Tp(TpArgs),
    /// K tokens per launch in a device-side loop against one launch and one host read per
    /// token, per token, with the step's own time as the floor.
    Loop(LoopBenchArgs),
    /// Guards against baked host values on the decoder step: a guarded call against a
    /// replay and eager, and their amortised cost at the default schedule.
    Guard(GuardBenchArgs),
}

/// Arguments of `graft bench guard`.
#[derive(Args, Debug, Clone)]
pub struct GuardBenchArgs {
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed steps of eager, replay and guarded calls.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Calls after a recording over which the default schedule is amortised (the first two
    /// warm up and record).
    #[arg(long, default_value_t = 1002)]
    pub calls: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
}

/// Arguments of `graft bench loop`. Lists left out take the backend's defaults: on a GPU
/// batches 1,8,32, K 8,32,128 and 9 repeats; on the simulator batches 1,4, K 8,32 and 3.
#[derive(Args, Debug, Clone, Default)]
pub struct LoopBenchArgs {
    /// Batch sizes, comma-separated (buckets of the decoder: 1, 2, 4, 8, 16, 32).
    #[arg(long, value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// K values (tokens per sequence per launch), comma-separated; K = 32 is the headline.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// Timed repeats per path, batch size and K; medians are reported.
    #[arg(long)]
    pub repeats: Option<usize>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k cut of sampling (0: none).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Transformer blocks of the decoder, instead of its config's (fewer layers make a
    /// cheaper step, where the host round trip the loop saves weighs more).
    #[arg(long)]
    pub layers: Option<usize>,
}

/// Arguments of `graft bench tp`.
#[derive(Args, Debug, Clone)]
pub struct TpArgs {
    /// Ranks (devices); on fewer GPUs than this it runs on simulated devices.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Batch sizes, comma-separated (buckets of the decoder: 1, 2, 4, 8, 16, 32).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Steps whose tokens are compared across eager, graft and the raw graph.
    #[arg(long, default_value_t = 64)]
    pub check: usize,
    /// Timed steps per mode and round (twice: synced, then pipelined).
    #[arg(long, default_value_t = 24)]
    pub steps: usize,
    /// Rounds; modes are interleaved within each and the median round is reported.
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use simulated devices even when GPUs are available.
    #[arg(long)]
    pub sim: bool,
    /// Run the ranks as N processes, one per GPU (or simulated device), started like a
    /// distributed job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), their votes over
    /// NCCL (over TCP on the simulator), and compare them with N threads of one process.
    #[arg(long, value_name = "N", conflicts_with = "world")]
    pub procs: Option<usize>,
    /// With --procs: seconds the ranks may run before they are killed.
    #[arg(long, value_name = "SECONDS", default_value_t = PROCS_TIMEOUT_S)]
    pub procs_timeout: u64,
    /// Run as one rank of a job, its place from the launcher's environment (graft's own
    /// --procs, torchrun --no-python, srun, mpirun or mpiexec: see ProcessGroup::from_env),
    /// writing its results as JSON to stdout.
    #[arg(long)]
    pub as_rank: bool,
    /// With --procs: this rank kills itself (SIGKILL) during the first attempt of the job, at
    /// the graphed step --at-step of the first batch size (a fault to recover from).
    #[arg(long, value_name = "RANK")]
    pub kill_rank: Option<usize>,
    /// With --kill-rank: the graphed step (from 1) at which that rank dies.
    #[arg(long, value_name = "STEP", default_value_t = 40)]
    pub at_step: usize,
    /// With --procs: how many times a failed job is started again (new processes, a new
    /// rendezvous, new communicators), as torchrun's --max-restarts.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,
    /// Which start of the job a rank belongs to (0: the first): what --procs passes.
    #[arg(long, hide = true, default_value_t = 0)]
    pub attempt: usize,
}

/// The default of `graft bench tp --procs-timeout`, in seconds.
pub const PROCS_TIMEOUT_S: u64 = 900;

/// Arguments of `graft bench capture`, `serve`, `update` and `inputs`.
#[derive(Args, Debug, Clone)]
pub struct ShapesArgs {
    /// capture: how many bucket sizes, spread evenly from 1 to --max.
    #[arg(long, default_value_t = 32)]
    pub buckets: usize,
    /// capture and serve: the largest batch size.
    #[arg(long, default_value_t = 256)]
    pub max: usize,
    /// serve: steps of the trace; inputs: timed calls per mode.
    #[arg(long, default_value_t = 10_000)]
    pub steps: usize,
    /// serve: the graph budget (Config::max_graphs) of the budgeted run.
    #[arg(long, default_value_t = 8)]
    pub budget: usize,
    /// update: re-recordings timed per mode.
    #[arg(long, default_value_t = 15)]
    pub repeats: usize,
    /// Seed of the random weights and of the trace.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
}

/// Arguments of `graft bench micro`.
#[derive(Args, Debug, Clone)]
pub struct MicroArgs {
    /// Timed blocks; the median block is reported.
    #[arg(long, default_value_t = 31)]
    pub repeats: usize,
    /// Calls per block.
    #[arg(long, default_value_t = 200)]
    pub calls: usize,
    /// Inputs per call (at least 8; those past 8 are static and not read by the chain).
    #[arg(long, default_value_t = 8)]
    pub inputs: usize,
    /// Recorded nodes in the tree (the timed one plus siblings of other signatures).
    #[arg(long, default_value_t = 1)]
    pub tree: usize,
    /// Guards on their default schedule, timed past its first 1,024 calls (a guard every
    /// 1,024 calls; off by default: the replays alone).
    #[arg(long)]
    pub guards: bool,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
}

/// Arguments of the decoder benchmark.
#[derive(Args, Debug, Clone)]
pub struct DecoderBenchArgs {
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Timed steps per batch size and mode (after the warmup steps).
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Use the simulator even when a GPU is available.
    #[arg(long)]
    pub sim: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// The device a command runs on, and the decoder configuration that goes with it.
#[derive(Debug, Clone)]
pub enum Backend {
    /// A GPU: the benchmark configuration.
    Cuda(CudaDevice),
    /// The host simulator: the tiny configuration.
    Sim(SimDevice),
}

impl Backend {
    /// The GPU when one is available and `force_sim` is false, else the simulator. A note
    /// explaining a fallback is written to `out`.
    pub fn pick(force_sim: bool, out: &mut dyn Write) -> Result<Backend, CliError> {
        if !force_sim && CudaDevice::is_available() {
            match CudaDevice::new(0) {
                Ok(dev) => return Ok(Backend::Cuda(dev)),
                Err(e) => writeln!(
                    out,
                    "note: a CUDA GPU is present but could not be opened ({e}); using the simulator"
                )?,
            }
        }
        Ok(Backend::Sim(SimDevice::new()))
    }

    /// The device's description.
    pub fn describe(&self) -> String {
        match self {
            Backend::Cuda(d) => d.describe(),
            Backend::Sim(d) => d.describe(),
        }
    }

    /// The decoder configuration for this backend and its name.
    pub fn config(&self) -> (DecoderConfig, &'static str) {
        match self {
            Backend::Cuda(_) => (DecoderConfig::bench(), "bench"),
            Backend::Sim(_) => (DecoderConfig::tiny(), "tiny"),
        }
    }
}

/// Runs a parsed command line, writing the report to `out`, without the raw-graph baselines
/// (what the `graft` binary does).
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<(), CliError> {
    run_with(cli, None, out)
}

/// Runs a parsed command line, writing the report to `out`; with graft-core's token `raw` (a
/// `const`, as `CoreOnly::for_tests_and_benches` makes it: the ranks of `bench tp` are threads),
/// the benchmarks also measure their raw-graph baselines (`graft bench`, `bench micro`,
/// `bench update`, `bench tp` and the demo's tensor-parallel part).
pub fn run_with(
    cli: Cli,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match cli.command {
        Command::Demo(args) => demo::run(&args, raw, out).map(|_| ()),
        Command::Bench(cmd) => match cmd.what {
            None => bench::run(&cmd.decoder, raw, out).map(|_| ()),
            Some(BenchWhat::Decoder(args)) => bench::run(&args, raw, out).map(|_| ()),
            Some(BenchWhat::Micro(args)) => micro::report(&args, raw, out),
            Some(BenchWhat::Capture(args)) => shapes::capture(&args, out),
            Some(BenchWhat::Serve(args)) => serve::serve(&args, out),
            Some(BenchWhat::Update(args)) => shapes::update(&args, raw, out),
            Some(BenchWhat::Inputs(args)) => shapes::inputs(&args, out),
            Some(BenchWhat::Tp(args)) if args.as_rank => tp_procs::as_rank(&args, raw, out),
            Some(BenchWhat::Tp(args)) => match args.procs {
                Some(procs) => tp_procs::run(&args, procs, raw, out),
                None => tp::run(&args, raw, out),
            },
            Some(BenchWhat::Loop(args)) => loop_bench::run(&args, out).map(|_| ()),
            Some(BenchWhat::Guard(args)) => guard_bench::run(&args, out).map(|_| ()),
        },
    }
}

/// The whole program: sets up logging (`RUST_LOG`, default `warn`, on stderr), parses `args`
/// (the program name first), runs the command with `raw` ([`run_with`]) and reports an error
/// on stderr. The `graft` binary calls it without a token, the `graft-baselines` bench with
/// one.
pub fn main(args: impl IntoIterator<Item = String>, raw: Option<&'static CoreOnly>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse_from(args);
    let mut out = std::io::stdout().lock();
    match run_with(cli, raw, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            drop(out);
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
