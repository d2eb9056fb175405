//! `graft bench tp`: the benchmark decoder split tensor-parallel over several devices (NCCL
//! on GPUs, the in-process all-reduce on the simulator), one rank per thread under a
//! [`Coordinator`]: tokens of graft against eager and a raw graph per rank, then per-step
//! times of eager, graft and raw-graph tensor parallelism against the whole model on one
//! device. The raw graph needs graft-core's token (graft-cli's `graft-baselines` bench);
//! without it (the `graft` binary) its tokens and times are left out. With `--procs` the ranks
//! are processes instead (`tp_procs.rs`).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use graft_core::backend::CoreOnly;
use graft_core::{Config, Coordinator, Device, DeviceError, FunctionId, Graft, Member};
use graft_cuda::{CudaDevice, NcclComm};
use graft_sim::{SimComm, SimDevice};
use graft_tensor::{Backend, Collective, Decoder, DecoderConfig, KvState, Meta, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::CliError;
use crate::timing::{fmt_us, median, median_us};
use crate::tokens::{compare, first_tokens};
use crate::{NO_RAW, PROCS_TIMEOUT_S, TpArgs};

/// How long a rank waits for the others at a recording's vote.
pub(crate) const AGREEMENT: Duration = Duration::from_secs(120);
/// How long a simulated all-reduce waits for the other ranks.
pub(crate) const SIM_COLLECTIVE: Duration = Duration::from_secs(30);

/// One rank's state. Field order is drop order: the runtime (and its graphs) before the
/// decoder, whose communicator NCCL wants destroyed after the graphs that captured it.
pub(crate) struct Rank<D: Backend> {
    graft: Graft<D, Meta>,
    decoder: Decoder<D>,
    fid: FunctionId,
}

/// Per-step times of one mode at one batch size, in microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Times {
    /// Median of steps each followed by a synchronize.
    pub(crate) synced: f64,
    /// Steps enqueued back to back, one synchronize at the end, per step.
    pub(crate) pipelined: f64,
}

/// What one rank measured at one batch size.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct RankReport {
    pub(crate) eager: Times,
    pub(crate) graft: Times,
    /// `None`: not measured (no token).
    pub(crate) raw: Option<Times>,
    /// The tokens of the checked steps (eager's; graft's and the raw graph's equal them).
    pub(crate) tokens: Vec<Vec<i32>>,
}

/// `graft bench tp` with the ranks as threads of this process (`--procs` and `--as-rank` are
/// `tp_procs.rs`'s); the raw graph too with graft-core's token `raw`.
pub fn run(
    args: &TpArgs,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    run_with(args, false, raw, out)
}

/// The tensor-parallel part of `graft demo`: a short run of the benchmark, on simulated
/// devices when there are not two GPUs or NCCL cannot be used here (with a note saying why).
pub(crate) fn demo(
    sim: bool,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let args = TpArgs {
        world: 2,
        batches: vec![1, 8],
        check: 32,
        steps: 8,
        rounds: 3,
        seed: 7,
        sim,
        procs: None,
        procs_timeout: PROCS_TIMEOUT_S,
        as_rank: false,
        kill_rank: None,
        at_step: 40,
        max_restarts: 0,
        attempt: 0,
    };
    run_with(&args, true, raw, out)
}

/// [`run`]; with `sim_if_unavailable`, NCCL being unusable (not installed, or
/// `NCCL_RUNTIME_CONNECT` not 0) falls back to simulated devices instead of failing.
fn run_with(
    args: &TpArgs,
    sim_if_unavailable: bool,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if args.world < 2 {
        return Err(CliError::BadArgument {
            flag: "--world",
            why: "tensor parallelism needs at least 2 ranks".into(),
        });
    }
    let gpus = usable_gpus(args.sim);
    if gpus >= args.world {
        let devices = (0..args.world)
            .map(CudaDevice::new)
            .collect::<Result<Vec<_>, _>>()?;
        let comms = NcclComm::version().and_then(|v| Ok((v, NcclComm::init_all(&devices)?)));
        match comms {
            Ok(((major, minor, patch), comms)) => {
                writeln!(out, "NCCL {major}.{minor}.{patch}")?;
                let config = DecoderConfig::tensor_parallel();
                return run_on(devices, collectives(comms), config, "tp", args, raw, out);
            }
            Err(e @ DeviceError::Unavailable { .. }) if sim_if_unavailable => {
                writeln!(out, "note: {e}; running on simulated devices")?;
            }
            Err(e) => return Err(e.into()),
        }
    } else if !args.sim {
        writeln!(
            out,
            "note: {gpus} CUDA GPU(s) found, {} needed; running on simulated devices",
            args.world
        )?;
    }
    let (devices, comms) = sim_group(args.world);
    run_on(
        devices,
        comms,
        DecoderConfig::tiny(),
        "tiny",
        args,
        raw,
        out,
    )
}

/// The CUDA GPUs a run may use: none with `--sim`, or without a driver.
pub(crate) fn usable_gpus(sim: bool) -> usize {
    if !sim && CudaDevice::is_available() {
        CudaDevice::device_count().unwrap_or(0)
    } else {
        0
    }
}

/// `world` simulated devices and their in-process all-reduce.
pub(crate) fn sim_group(world: usize) -> (Vec<SimDevice>, Vec<Arc<dyn Collective>>) {
    let devices: Vec<SimDevice> = (0..world).map(|_| SimDevice::new()).collect();
    let comms = collectives(SimComm::group(&devices, SIM_COLLECTIVE));
    (devices, comms)
}

/// Communicators as the decoder's collectives.
pub(crate) fn collectives<C: Collective>(comms: Vec<C>) -> Vec<Arc<dyn Collective>> {
    comms
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect()
}

fn run_on<D: Backend>(
    devices: Vec<D>,
    comms: Vec<Arc<dyn Collective>>,
    config: DecoderConfig,
    name: &str,
    args: &TpArgs,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    check_steps(&config, args)?;
    writeln!(
        out,
        "tensor-parallel decoder ({name}: {config}) on {} ranks: {}",
        devices.len(),
        devices[0].describe()
    )?;
    let first = devices[0].clone();
    let rows = threads(devices, comms, config, args, raw, out)?;
    writeln!(
        out,
        "tokens: graft = eager{} on every rank, and every rank the same, over {} steps at B={}",
        if raw.is_some() { " = raw graph" } else { "" },
        args.check,
        args.batches
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    if raw.is_none() {
        writeln!(out, "{NO_RAW}")?;
    }

    let mut one = Graft::<D, Meta>::new(first, Config::default());
    let whole = Decoder::new(&mut one, config, args.seed)?;
    let fid = whole.register(&mut one);
    writeln!(
        out,
        "\nper step, median of {} rounds of {} steps (synced: each step then a synchronize; pipelined: {} steps, one synchronize)",
        args.rounds, args.steps, args.steps
    )?;
    writeln!(
        out,
        "| B | timing | 1 device eager | 1 device graft | TP eager | TP graft | TP raw graph | TP graft / raw, per rank | 1 device graft / TP graft | TP eager / TP graft |"
    )?;
    writeln!(
        out,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )?;
    for (batch, reports) in &rows {
        let single = measure_one(&mut one, &whole, fid, *batch, args.steps, args.rounds)?;
        for (label, pick) in [
            ("synced", (|t: &Times| t.synced) as fn(&Times) -> f64),
            ("pipelined", |t: &Times| t.pipelined),
        ] {
            let r0 = &reports[0];
            let ratios: Vec<String> = reports.iter().map(|r| graft_over_raw(r, pick)).collect();
            writeln!(
                out,
                "| {batch} | {label} | {} | {} | {} | {} | {} | {} | {:.2}x | {:.2}x |",
                fmt_us(pick(&single.eager)),
                fmt_us(pick(&single.graft)),
                fmt_us(pick(&r0.eager)),
                fmt_us(pick(&r0.graft)),
                r0.raw.as_ref().map_or("-".into(), |t| fmt_us(pick(t))),
                ratios.join(" / "),
                pick(&single.graft) / pick(&r0.graft),
                pick(&r0.eager) / pick(&r0.graft),
            )?;
        }
    }
    let stats = one.stats();
    writeln!(
        out,
        "\none-device runtime: {} recordings, {} replays",
        stats.recordings, stats.replays
    )?;
    Ok(())
}

/// A rank's graft time over its raw graph's, as a table cell ("-" when not measured).
pub(crate) fn graft_over_raw(r: &RankReport, pick: fn(&Times) -> f64) -> String {
    r.raw.as_ref().map_or("-".into(), |raw| {
        format!("{:.3}", pick(&r.graft) / pick(raw))
    })
}

/// Refuses `--steps` and `--check` the decoder's context cannot hold.
pub(crate) fn check_steps(config: &DecoderConfig, args: &TpArgs) -> Result<(), CliError> {
    if args.steps == 0 || 2 * args.steps + 2 > config.ctx || args.check > config.ctx {
        return Err(CliError::BadArgument {
            flag: "--steps",
            why: format!(
                "--steps must be 1..={} and --check at most {} (the context)",
                (config.ctx - 2) / 2,
                config.ctx
            ),
        });
    }
    Ok(())
}

/// One rank's state on `device`: its runtime joined to the group through `member`, and its
/// shard of the decoder, whose all-reduces run on `comm`.
pub(crate) fn rank<D: Backend>(
    device: D,
    comm: Arc<dyn Collective>,
    member: Member,
    config: DecoderConfig,
    seed: u64,
) -> Result<Rank<D>, CliError> {
    let mut graft = Graft::new(device, Config::default());
    graft.join(member);
    let decoder = Decoder::new_sharded(&mut graft, config, seed, comm)?;
    let fid = decoder.register(&mut graft);
    Ok(Rank {
        graft,
        decoder,
        fid,
    })
}

/// The ranks as threads of this process (a [`Coordinator`]): builds them, times an empty step,
/// measures every batch size of `args` on every rank, and checks every rank decoded the same
/// tokens. Returns each batch size with its ranks' reports, in rank order.
pub(crate) fn threads<D: Backend>(
    devices: Vec<D>,
    comms: Vec<Arc<dyn Collective>>,
    config: DecoderConfig,
    args: &TpArgs,
    raw: Option<&'static CoreOnly>,
    out: &mut dyn Write,
) -> Result<Vec<(usize, Vec<RankReport>)>, CliError> {
    let seed = args.seed;
    let start = Instant::now();
    let seeds: Vec<(D, Arc<dyn Collective>)> = devices.into_iter().zip(comms).collect();
    let ranks = Coordinator::start(
        seeds,
        AGREEMENT,
        move |(device, comm): (D, Arc<dyn Collective>), member: Member| {
            rank(device, comm, member, config, seed)
        },
    )
    .map_err(|e| CliError::Ranks(Box::new(e)))?;
    writeln!(out, "ranks built in {:.1} s", start.elapsed().as_secs_f64())?;
    let mut empty = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        ranks.step(|_, _| ())?;
        empty.push(t.elapsed());
    }
    writeln!(
        out,
        "coordinator: an empty step on every rank takes {} (median of 200)",
        fmt_us(median_us(&empty))
    )?;
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let (check, steps, rounds) = (args.check, args.steps, args.rounds);
        let reports = ranks.step(move |_, rank: &mut Rank<D>| {
            measure_tp(rank, batch, check, steps, rounds, raw, None)
        })?;
        let reports = reports.into_iter().collect::<Result<Vec<_>, _>>()?;
        same_tokens(batch, &reports)?;
        rows.push((batch, reports));
    }
    Ok(rows)
}

/// Checks every rank's tokens at `batch` equal rank 0's.
pub(crate) fn same_tokens(batch: usize, reports: &[RankReport]) -> Result<(), CliError> {
    for r in &reports[1..] {
        compare(
            batch,
            ("rank 0", &reports[0].tokens),
            ("another rank", &r.tokens),
        )?;
    }
    Ok(())
}

/// Steps `state` `n` times with `step`, returning the tokens after each step.
fn run_steps<D: Device>(
    device: &D,
    state: &mut KvState,
    n: usize,
    mut step: impl FnMut(&mut KvState) -> Result<Tensor, CliError>,
) -> Result<Vec<Vec<i32>>, CliError> {
    (0..n)
        .map(|_| Ok(step(state)?.to_vec_i32(device)?))
        .collect()
}

/// Times of one mode: `rounds` rounds of `steps` synced steps and `steps` pipelined ones,
/// each from position 0. `step` runs one step and returns nothing the host reads.
fn time_mode<D: Device>(
    device: &D,
    state: &mut KvState,
    steps: usize,
    mut step: impl FnMut(&mut KvState) -> Result<(), CliError>,
) -> Result<Times, CliError> {
    state.reset(device)?;
    // Warm: the first steps record (graft) and touch every page.
    for _ in 0..2 {
        step(state)?;
    }
    device.synchronize()?;
    let mut synced = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        step(state)?;
        device.synchronize()?;
        synced.push(t.elapsed());
    }
    let t = Instant::now();
    for _ in 0..steps {
        step(state)?;
    }
    device.synchronize()?;
    Ok(Times {
        synced: median_us(&synced),
        pipelined: t.elapsed().as_secs_f64() * 1e6 / steps as f64,
    })
}

/// One round of eager steps, then graft steps, each from `start` at position 0.
fn time_round<D: Backend>(
    graft: &mut Graft<D, Meta>,
    decoder: &Decoder<D>,
    fid: FunctionId,
    state: &mut KvState,
    start: &Tensor,
    steps: usize,
) -> Result<[Times; 2], CliError> {
    let device = decoder.device();
    let mut tokens = start.clone();
    let eager = time_mode(device, state, steps, |s| {
        tokens = decoder.step_eager(graft, s, &tokens)?;
        Ok(())
    })?;
    let mut tokens = start.clone();
    let graphed = time_mode(device, state, steps, |s| {
        tokens = decoder.step_graft(graft, fid, s, &tokens)?;
        Ok(())
    })?;
    Ok([eager, graphed])
}

/// The median over rounds of each field.
fn median_times(rounds: &[Times]) -> Times {
    let field = |f: fn(&Times) -> f64| median(rounds.iter().map(f).collect());
    Times {
        synced: field(|t| t.synced),
        pipelined: field(|t| t.pipelined),
    }
}

/// Kills this process (SIGKILL), as `--kill-rank` asks: a rank that dies without a word.
fn die() -> ! {
    let pid = std::process::id().to_string();
    // If `kill` cannot run, aborting still ends the process without cleanup.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status();
    std::process::abort()
}

/// One rank at one batch size: the tokens of `check` steps eagerly, through graft and (with
/// graft-core's token `raw`) as a raw graph, which must agree, then the times of each mode,
/// interleaved over `rounds`. With `die_at`, the process kills itself at that graphed step
/// (`--kill-rank`'s fault).
pub(crate) fn measure_tp<D: Backend>(
    rank: &mut Rank<D>,
    batch: usize,
    check: usize,
    steps: usize,
    rounds: usize,
    raw: Option<&CoreOnly>,
    die_at: Option<usize>,
) -> Result<RankReport, CliError> {
    let Rank {
        graft,
        decoder,
        fid,
    } = rank;
    let device = decoder.device().clone();
    let ids = first_tokens(batch, decoder.config().vocab);
    let mut state = decoder.new_state(graft, batch)?;
    let start = decoder.tokens(graft, &ids)?;

    let mut tokens = start.clone();
    let eager = run_steps(&device, &mut state, check, |s| {
        tokens = decoder.step_eager(graft, s, &tokens)?;
        Ok(tokens.clone())
    })?;
    state.reset(&device)?;
    let mut tokens = start.clone();
    let mut graphed_steps = 0;
    let graphed = run_steps(&device, &mut state, check, |s| {
        graphed_steps += 1;
        if die_at == Some(graphed_steps) {
            die();
        }
        tokens = decoder.step_graft(graft, *fid, s, &tokens)?;
        Ok(tokens.clone())
    })?;
    compare(batch, ("eager", &eager), ("graft", &graphed))?;
    state.reset(&device)?;
    let raw = match raw {
        Some(core) => {
            let raw_tokens = decoder.tokens(graft, &ids)?;
            let graph = decoder.capture_raw(core, graft, &state, &raw_tokens)?;
            let replayed = run_steps(&device, &mut state, check, |s| {
                graph.step(core, s)?;
                Ok(graph.tokens().clone())
            })?;
            compare(batch, ("eager", &eager), ("raw graph", &replayed))?;
            Some((core, graph))
        }
        None => None,
    };

    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..rounds {
        let [eager, graphed] = time_round(graft, decoder, *fid, &mut state, &start, steps)?;
        times[0].push(eager);
        times[1].push(graphed);
        if let Some((core, graph)) = &raw {
            times[2].push(time_mode(&device, &mut state, steps, |s| {
                Ok(graph.step(core, s)?)
            })?);
        }
    }
    Ok(RankReport {
        eager: median_times(&times[0]),
        graft: median_times(&times[1]),
        raw: raw.map(|_| median_times(&times[2])),
        tokens: eager,
    })
}

/// The whole model on one device at one batch size: eager and graft times.
fn measure_one<D: Backend>(
    graft: &mut Graft<D, Meta>,
    decoder: &Decoder<D>,
    fid: FunctionId,
    batch: usize,
    steps: usize,
    rounds: usize,
) -> Result<RankReport, CliError> {
    let ids = first_tokens(batch, decoder.config().vocab);
    let mut state = decoder.new_state(graft, batch)?;
    let start = decoder.tokens(graft, &ids)?;
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        let [eager, graphed] = time_round(graft, decoder, fid, &mut state, &start, steps)?;
        times[0].push(eager);
        times[1].push(graphed);
    }
    Ok(RankReport {
        eager: median_times(&times[0]),
        graft: median_times(&times[1]),
        ..RankReport::default()
    })
}
