//! `graft bench tp --procs N`: the tensor-parallel benchmark with one process per rank.
//!
//! The parent starts N copies of its own executable as a job on this host (graft's
//! `launch_local`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set for
//! each, and a watchdog), each running one rank (`--as-rank`; a rank also runs under torchrun,
//! srun or mpirun, whose variables `ProcessGroup::from_env` reads). On GPUs a rank opens its GPU
//! (`LOCAL_RANK`), gets rank 0's NCCL unique id over the job's TCP rendezvous, makes its
//! communicator with `ncclCommInitRank` (non-blocking, bounded) and votes over NCCL itself. On
//! simulated devices the votes and the all-reduces travel over the rendezvous (the simulator
//! has no NCCL). Each rank writes its results as JSON to stdout; the parent gathers them, runs
//! the same benchmark with the ranks as threads of one process, checks the tokens are the
//! same, and prints each rank's graft / raw graph and the processes' step time against the
//! threads'. The ranks are copies of the running executable, so they measure the raw graph
//! exactly when it does (graft-cli's `graft-baselines` bench, which holds graft-core's token;
//! not the `graft` binary).

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graft_core::backend::CoreOnly;
use graft_core::{Ballot, BallotBox, Member};
use graft_cuda::{CudaDevice, NcclBallotBox, NcclComm, UNIQUE_ID_BYTES};
use graft_launch::{ProcessGroup, RankExit, Rendezvous, TcpBallotBox, Watchdog, launch_local};
use graft_sim::{SimComm, SimDevice};
use graft_tensor::{Backend, Collective, DecoderConfig};
use serde::{Deserialize, Serialize};

use crate::error::CliError;
use crate::timing::{fmt_us, median_us};
use crate::tokens::compare;
use crate::tp::{
    AGREEMENT, RankReport, SIM_COLLECTIVE, Times, check_steps, collectives, graft_over_raw,
    measure_tp, rank, sim_group, threads, usable_gpus,
};
use crate::{NO_RAW, TpArgs};

/// How long a rank may take to join the job (and to set up NCCL).
const JOIN: Duration = Duration::from_secs(120);
/// The lines of a failed rank's stderr an error quotes.
const STDERR_LINES: usize = 20;

/// What one rank of a `--procs` job reports (its stdout, as JSON).
#[derive(Debug, Serialize, Deserialize)]
struct ProcReport {
    rank: usize,
    world: usize,
    device: String,
    /// Each batch size with what the rank measured at it.
    batches: Vec<(usize, RankReport)>,
    /// The median time of one vote on this rank's transport, in µs.
    #[serde(default)]
    vote_us: f64,
}

/// What the ranks' NCCL needs in their environment, set for them: eager connections
/// (`NcclComm::init_rank` refuses lazy ones) and no NVLink multicast (the lent machines'
/// fabric manager does not offer it).
const RANK_ENV: [(&str, &str); 2] = [("NCCL_RUNTIME_CONNECT", "0"), ("NCCL_NVLS_ENABLE", "0")];

/// Votes timed per rank.
const VOTES: usize = 200;

/// The median time of one vote (a recorded ballot on function 0) over `ballots`, in µs: what a
/// recording pays to agree with the other ranks.
fn time_votes(ballots: &dyn BallotBox) -> Result<f64, CliError> {
    let ballot = Ballot::from_words([1, 0, 0]).expect("[1, 0, 0] is a recorded ballot");
    let mut took = Vec::with_capacity(VOTES);
    for _ in 0..VOTES {
        let t = Instant::now();
        ballots.exchange(ballot, AGREEMENT)?;
        took.push(t.elapsed());
    }
    Ok(median_us(&took))
}

/// One rank of a `--procs` job, its place from the environment: its results as JSON on
/// `out` (the raw graph's too with graft-core's token `raw`).
pub(crate) fn as_rank(
    args: &TpArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let place = ProcessGroup::from_env()?;
    let mut rv = Rendezvous::join(&place, JOIN)?;
    // Declared before the runtimes: dropped after them, saying goodbye once the rank is done.
    let _watchdog: Watchdog;
    let vote_us;
    let report = if args.sim {
        let device = SimDevice::new();
        let rv = Arc::new(Mutex::new(rv));
        let comm = SimComm::over_rendezvous(&device, rv.clone(), SIM_COLLECTIVE);
        let ballots = Arc::new(TcpBallotBox::new(rv.clone()));
        vote_us = time_votes(&*ballots)?;
        let member = Member::new(ballots, AGREEMENT);
        // The simulator's all-reduce travels over the rendezvous and finds a lost peer itself.
        _watchdog = Watchdog::start(
            &mut rv.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            &place,
            JOIN,
            Watchdog::DEFAULT_BOUND,
            &member,
            |_| {},
        )?;
        measure_rank(
            device,
            Arc::new(comm),
            member,
            DecoderConfig::tiny(),
            &place,
            args,
            raw,
        )?
    } else {
        let device = CudaDevice::new(place.local_rank())?;
        let mut id = [0; UNIQUE_ID_BYTES];
        if place.rank() == 0 {
            id = NcclComm::unique_id()?;
        }
        rv.broadcast(&mut id, JOIN)?;
        let comm = NcclComm::init_rank(&device, &id, place.rank(), place.world(), JOIN)?;
        let comm = Arc::new(comm);
        let ballots = Arc::new(NcclBallotBox::new(comm.clone())?);
        vote_us = time_votes(&*ballots)?;
        let member = Member::new(ballots, AGREEMENT);
        _watchdog = comm.watchdog(&mut rv, &place, JOIN, Watchdog::DEFAULT_BOUND, &member)?;
        let config = DecoderConfig::tensor_parallel();
        measure_rank(device, comm, member, config, &place, args, raw)?
    };
    let report = ProcReport { vote_us, ..report };
    serde_json::to_writer(&mut *out, &report)?;
    writeln!(out)?;
    Ok(())
}

/// Builds this rank and measures every batch size of `args` on it.
fn measure_rank<D: Backend>(
    device: D,
    comm: Arc<dyn Collective>,
    member: Member,
    config: DecoderConfig,
    place: &ProcessGroup,
    args: &TpArgs,
    raw: Option<&CoreOnly>,
) -> Result<ProcReport, CliError> {
    check_steps(&config, args)?;
    let description = device.describe();
    let mut r = rank(device, comm, member, config, args.seed)?;
    let dies = args.attempt == 0 && args.kill_rank == Some(place.rank());
    let batches = args
        .batches
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            let die_at = (dies && i == 0).then_some(args.at_step);
            let (check, steps, rounds) = (args.check, args.steps, args.rounds);
            Ok((b, measure_tp(&mut r, b, check, steps, rounds, raw, die_at)?))
        })
        .collect::<Result<_, CliError>>()?;
    Ok(ProcReport {
        rank: place.rank(),
        world: place.world(),
        device: description,
        batches,
        vote_us: 0.0,
    })
}

/// The arguments of a rank of this benchmark at start `attempt` of the job: the same
/// measurements, on simulated devices when `sim`.
fn rank_args(args: &TpArgs, sim: bool, attempt: usize) -> Vec<String> {
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut a: Vec<String> = ["bench", "tp", "--as-rank", "--batches"]
        .map(str::to_owned)
        .into();
    a.push(list(&args.batches));
    for (flag, value) in [
        ("--check", args.check.to_string()),
        ("--steps", args.steps.to_string()),
        ("--rounds", args.rounds.to_string()),
        ("--seed", args.seed.to_string()),
        ("--attempt", attempt.to_string()),
        ("--at-step", args.at_step.to_string()),
    ] {
        a.push(flag.to_owned());
        a.push(value);
    }
    if let Some(rank) = args.kill_rank {
        a.push("--kill-rank".to_owned());
        a.push(rank.to_string());
    }
    if sim {
        a.push("--sim".to_owned());
    }
    a
}

/// The reports of a finished job, in rank order; or the first failed rank's error (a rank
/// that failed before one the watchdog killed: the failure is why the others were stopped).
fn gather(exits: Vec<RankExit>) -> Result<Vec<ProcReport>, CliError> {
    if let Some(e) = exits
        .iter()
        .find(|e| e.status.is_some_and(|s| !s.success()))
    {
        let lines: Vec<&str> = e.stderr.lines().collect();
        return Err(CliError::RankFailed {
            rank: e.rank,
            code: e.code(),
            stderr: lines[lines.len().saturating_sub(STDERR_LINES)..].join("\n"),
        });
    }
    if let Some(e) = exits.iter().find(|e| e.status.is_none()) {
        return Err(CliError::RankTimedOut {
            rank: e.rank,
            waited: e.took,
        });
    }
    exits
        .iter()
        .map(|e| {
            serde_json::from_slice(&e.stdout).map_err(|source| CliError::RankReport {
                rank: e.rank,
                source,
            })
        })
        .collect()
}

/// How the ranks of a job with a killed rank ended: each survivor's exit and how long after
/// the killed rank's death it returned (its watchdog's doing). A survivor still running at
/// the deadline is the error: its wait was not bounded.
fn survivors(
    exits: &[RankExit],
    killed: Option<usize>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let Some(dead) = exits
        .iter()
        .find(|e| Some(e.rank) == killed && e.status.and_then(|s| s.signal()) == Some(9))
    else {
        return Ok(());
    };
    for e in exits.iter().filter(|e| Some(e.rank) != killed) {
        if e.status.is_none() {
            return Err(CliError::RankTimedOut {
                rank: e.rank,
                waited: e.took,
            });
        }
        writeln!(
            out,
            "rank {} killed itself; rank {} returned {:.2} s later with exit code {:?}",
            dead.rank,
            e.rank,
            e.took.saturating_sub(dead.took).as_secs_f64(),
            e.code()
        )?;
    }
    Ok(())
}

/// `graft bench tp --procs N`.
pub(crate) fn run(
    args: &TpArgs,
    procs: usize,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if procs < 2 {
        return Err(CliError::BadArgument {
            flag: "--procs",
            why: "tensor parallelism needs at least 2 ranks".into(),
        });
    }
    let gpus = usable_gpus(args.sim);
    let sim = args.sim || gpus < procs;
    if sim && !args.sim {
        writeln!(
            out,
            "note: {gpus} CUDA GPU(s) found, {procs} needed; running on simulated devices"
        )?;
    }
    let (config, name, per, votes) = if sim {
        (DecoderConfig::tiny(), "tiny", "simulated device", "TCP")
    } else {
        (DecoderConfig::tensor_parallel(), "tp", "GPU", "NCCL")
    };
    check_steps(&config, args)?;
    let program = std::env::current_exe().map_err(|source| CliError::OwnPath { source })?;
    writeln!(
        out,
        "tensor-parallel decoder ({name}: {config}) as {procs} processes, one per {per}, voting over {votes}"
    )?;
    if args.kill_rank.is_some_and(|r| r >= procs) {
        return Err(CliError::BadArgument {
            flag: "--kill-rank",
            why: format!("the job has ranks 0..{procs}"),
        });
    }
    let start = Instant::now();
    let ranks: Vec<usize> = (0..procs).collect();
    let deadline = Duration::from_secs(args.procs_timeout);
    let mut attempt = 0;
    let reports = loop {
        // A job with a rank that dies on purpose lets the others find it gone on their own
        // (their watchdogs); otherwise the first failure ends the job at once.
        let fault = attempt == 0 && args.kill_rank.is_some();
        let exits = launch_local(
            &program,
            &rank_args(args, sim, attempt),
            procs,
            &ranks,
            &RANK_ENV.map(|(k, v)| (k, v.to_owned())),
            deadline,
            !fault,
        )?;
        if fault {
            survivors(&exits, args.kill_rank, out)?;
        }
        match gather(exits) {
            Ok(reports) => break reports,
            Err(e) if attempt < args.max_restarts => {
                attempt += 1;
                writeln!(
                    out,
                    "the job failed ({e}); starting it again (restart {attempt} of {})",
                    args.max_restarts
                )?;
            }
            Err(e) => return Err(e),
        }
    };
    writeln!(
        out,
        "{procs} processes ran in {:.1} s; the same ranks as threads of this process, for comparison:",
        start.elapsed().as_secs_f64()
    )?;
    let rows = if sim {
        let (devices, comms) = sim_group(procs);
        threads(devices, comms, config, args, raw, out)?
    } else {
        let devices = (0..procs)
            .map(CudaDevice::new)
            .collect::<Result<Vec<_>, _>>()?;
        let comms = collectives(NcclComm::init_all(&devices)?);
        threads(devices, comms, config, args, raw, out)?
    };
    for (i, (batch, threaded)) in rows.iter().enumerate() {
        for p in &reports {
            compare(
                *batch,
                ("threads", &threaded[0].tokens),
                ("processes", &p.batches[i].1.tokens),
            )?;
        }
    }
    writeln!(
        out,
        "tokens: every process = every thread = eager{}, over {} steps at each batch size",
        if raw.is_some() { " = raw graph" } else { "" },
        args.check
    )?;
    if raw.is_none() {
        writeln!(out, "{NO_RAW}")?;
    }
    table(&rows, &reports, args, out)
}

/// The per-step table: graft's step as processes against threads, and each rank's graft /
/// raw graph both ways.
fn table(
    rows: &[(usize, Vec<RankReport>)],
    reports: &[ProcReport],
    args: &TpArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let votes: Vec<String> = reports.iter().map(|r| fmt_us(r.vote_us)).collect();
    writeln!(
        out,
        "\none vote (what each recording pays to agree), median of {VOTES} per rank: {}",
        votes.join(" / ")
    )?;
    writeln!(
        out,
        "\nper step, median of {} rounds of {} steps; processes on {}",
        args.rounds, args.steps, reports[0].device
    )?;
    writeln!(
        out,
        "| B | timing | threads: TP graft | processes: TP graft | processes / threads | processes: graft / raw, per rank | threads: graft / raw, per rank |"
    )?;
    writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |")?;
    let ratios = |rs: &mut dyn Iterator<Item = &RankReport>, pick: fn(&Times) -> f64| {
        rs.map(|r| graft_over_raw(r, pick))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    for (i, (batch, threaded)) in rows.iter().enumerate() {
        for (label, pick) in [
            ("synced", (|t: &Times| t.synced) as fn(&Times) -> f64),
            ("pipelined", |t: &Times| t.pipelined),
        ] {
            let procs = pick(&reports[0].batches[i].1.graft);
            let threads = pick(&threaded[0].graft);
            writeln!(
                out,
                "| {batch} | {label} | {} | {} | {:.3}x | {} | {} |",
                fmt_us(threads),
                fmt_us(procs),
                procs / threads,
                ratios(&mut reports.iter().map(|p| &p.batches[i].1), pick),
                ratios(&mut threaded.iter(), pick),
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::ExitStatus;

    fn exit(rank: usize, status: Option<ExitStatus>, stdout: &str, stderr: &str) -> RankExit {
        RankExit {
            rank,
            status,
            stdout: stdout.as_bytes().to_vec(),
            stderr: stderr.to_owned(),
            took: Duration::from_secs(3),
        }
    }

    fn ok(rank: usize, stdout: &str) -> RankExit {
        exit(rank, Some(ExitStatus::from_raw(0)), stdout, "")
    }

    #[test]
    fn a_failed_rank_is_named_with_the_end_of_its_stderr_before_the_killed_ones() {
        let stderr: String = (0..30).map(|i| format!("line {i}\n")).collect();
        let exits = vec![
            exit(0, None, "", ""),
            exit(1, Some(ExitStatus::from_raw(1 << 8)), "", &stderr),
        ];
        match gather(exits) {
            Err(CliError::RankFailed {
                rank: 1,
                code: Some(1),
                stderr,
            }) => {
                assert!(stderr.starts_with("line 10\n") && stderr.ends_with("line 29"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_killed_rank_is_a_timeout_and_bad_output_is_named() {
        let killed = gather(vec![ok(0, "{}"), exit(1, None, "", "")]);
        assert!(
            matches!(killed, Err(CliError::RankTimedOut { rank: 1, .. })),
            "{killed:?}"
        );
        let bad = gather(vec![ok(0, "not json")]);
        assert!(
            matches!(bad, Err(CliError::RankReport { rank: 0, .. })),
            "{bad:?}"
        );
    }

    #[test]
    fn reports_come_back_in_rank_order() {
        let json = |rank: usize| {
            serde_json::to_string(&ProcReport {
                rank,
                world: 2,
                device: "host simulator".into(),
                batches: vec![(1, RankReport::default())],
                vote_us: 0.0,
            })
            .unwrap()
        };
        let reports = gather(vec![ok(0, &json(0)), ok(1, &json(1))]).unwrap();
        assert_eq!(
            reports.iter().map(|r| r.rank).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    #[test]
    fn a_rank_gets_the_same_measurements_and_the_backend() {
        let args = crate::TpArgs {
            world: 2,
            batches: vec![1, 8],
            check: 4,
            steps: 2,
            rounds: 1,
            seed: 9,
            sim: false,
            procs: Some(2),
            procs_timeout: 5,
            as_rank: false,
            kill_rank: None,
            at_step: 40,
            max_restarts: 0,
            attempt: 0,
        };
        assert_eq!(
            rank_args(&args, true, 1).join(" "),
            "bench tp --as-rank --batches 1,8 --check 4 --steps 2 --rounds 1 --seed 9 --attempt 1 --at-step 40 --sim"
        );
        assert!(!rank_args(&args, false, 0).contains(&"--sim".to_owned()));
    }
}
