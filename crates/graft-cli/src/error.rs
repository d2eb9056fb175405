//! Errors of the `graft` command.

use std::path::PathBuf;

use graft_core::DeviceError;
use graft_tensor::TensorError;

/// Why a command failed. Each message says what happened and what to do.
#[derive(thiserror::Error, Debug)]
pub enum CliError {
    /// Graft replay and eager execution produced different tokens: a correctness bug.
    #[error(
        "tokens differ at batch {batch}, step {step}, row {row}: {first} gave {a}, {second} gave {b}; \
         this is a bug in graft or its kernels: rerun with RUST_LOG=graft_core=debug and report it"
    )]
    TokensDiffer {
        /// Batch size.
        batch: usize,
        /// Step (0-based).
        step: usize,
        /// Row of the batch.
        row: usize,
        /// Name of the first run.
        first: &'static str,
        /// Its token.
        a: i32,
        /// Name of the second run.
        second: &'static str,
        /// Its token.
        b: i32,
    },
    /// A flag value the command cannot use.
    #[error("invalid {flag}: {why}")]
    BadArgument {
        /// The flag.
        flag: &'static str,
        /// What is wrong and what to pass instead.
        why: String,
    },
    /// The tensor layer or graft failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A graft call failed.
    #[error(transparent)]
    Call(#[from] graft_core::CallError),
    /// Allocating, reading or writing graft memory failed.
    #[error(transparent)]
    Memory(#[from] graft_core::MemoryError),
    /// The micro benchmark failed.
    #[error(transparent)]
    Micro(#[from] crate::micro::MicroError),
    /// graft-candle's demo binary could not run, or failed (its output says why).
    #[error(
        "the candle demo {} failed (exit status {status:?}{}); run it alone to see its report",
        path.display(),
        source.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
    )]
    Candle {
        /// The binary.
        path: PathBuf,
        /// Its exit status, when it ran.
        status: Option<i32>,
        /// Why it could not start.
        source: Option<std::io::Error>,
    },
    /// Writing a file failed.
    #[error("could not write {path}: {source}; check the path and permissions")]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Writing the report failed.
    /// A rank of the tensor-parallel benchmark could not start.
    #[error(transparent)]
    Ranks(Box<graft_core::StartError<CliError>>),
    /// A step of the tensor-parallel benchmark panicked on a rank.
    #[error(transparent)]
    Step(#[from] graft_core::StepError),
    #[error("could not write the report: {0}")]
    Output(#[from] std::io::Error),
    /// `--procs`: the ranks' processes could not be started.
    #[error(transparent)]
    Launch(#[from] graft_launch::LaunchError),
    /// `--procs`: this program's own path is unknown, so it cannot start its ranks.
    #[error("cannot find this program's own path to start the ranks: {source}")]
    OwnPath {
        /// The system's error.
        source: std::io::Error,
    },
    /// A rank's place in the job (its environment variables) is missing or wrong.
    #[error(transparent)]
    Place(#[from] graft_launch::ProcessGroupError),
    /// A rank could not join the job's rendezvous.
    #[error(transparent)]
    Join(#[from] graft_launch::JoinError),
    /// A rank could not receive NCCL's unique id from rank 0.
    #[error(transparent)]
    Exchange(#[from] graft_launch::ExchangeError),
    /// `--procs`: a timed vote failed.
    #[error(transparent)]
    Group(#[from] graft_core::GroupError),
    /// `--procs`: a rank's watchdog could not start.
    #[error(transparent)]
    Watchdog(#[from] graft_launch::WatchdogError),
    /// `--procs`: a rank failed; its last lines of stderr say why.
    #[error("rank {rank} of the job failed (exit code {code:?}); its stderr ends with:\n{stderr}")]
    RankFailed {
        /// The rank.
        rank: usize,
        /// Its exit code (`None`: ended by a signal).
        code: Option<i32>,
        /// The last lines it wrote to stderr.
        stderr: String,
    },
    /// `--procs`: a rank was still running at the deadline and was killed.
    #[error(
        "rank {rank} of the job was still running after {waited:?} and was killed; raise --procs-timeout, or see why it hung (RUST_LOG=graft_core=debug,graft_launch=debug)"
    )]
    RankTimedOut {
        /// The rank.
        rank: usize,
        /// How long it ran.
        waited: std::time::Duration,
    },
    /// `--procs`: a rank's stdout is not the report `--as-rank` writes.
    #[error(
        "rank {rank}'s report is not the JSON a rank of `graft bench tp --procs` writes ({source}); run this program's own build for every rank"
    )]
    RankReport {
        /// The rank.
        rank: usize,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// Serializing JSON failed.
    #[error("could not serialize the results as JSON: {0}")]
    Json(#[from] serde_json::Error),
}
