//! `graft bench guard`: what guards against baked host values cost on the decoder step.
//!
//! Per step, synchronized, at one batch size: eager; a replay with guards off; a guarded
//! call (`Graft::guard_next_call` before every call: the body is captured again, compared
//! node by node with the recording, the capture dropped and the recording replayed); and the
//! amortised cost of `--calls` calls right after a recording at the default schedule (calls
//! 1, 2, 4, ... guarded) against the same calls with guards off. Tokens are checked equal
//! across all of them.

use std::io::Write;
use std::time::Duration;

use graft_core::{Config, FunctionId, Graft, Guards};
use graft_tensor::Backend as TensorBackend;
use graft_tensor::{Decoder, DecoderConfig, Meta};

use crate::bench::rows;
use crate::demo::make_room;
use crate::timing::{fmt_us, median_us, timed};
use crate::tokens::{compare, first_tokens};
use crate::{Backend, CliError, GuardBenchArgs};

/// The figures of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GuardReport {
    /// Median eager step.
    pub eager_us: f64,
    /// Median replay, guards off.
    pub replay_us: f64,
    /// Median guarded call whose capture equals the recording.
    pub guarded_us: f64,
    /// Mean step over `calls` calls after a recording, guards at the default schedule.
    pub amortised_us: f64,
    /// Mean step over the same calls with guards off.
    pub unguarded_us: f64,
    /// Guarded calls among the amortised ones.
    pub guards: u64,
}

/// `graft bench guard`: runs on the picked backend and prints the figures.
pub fn run(args: &GuardBenchArgs, out: &mut dyn Write) -> Result<GuardReport, CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let model = backend.config();
    match backend {
        Backend::Cuda(dev) => run_on(dev, model, args, out),
        Backend::Sim(dev) => run_on(dev, model, args, out),
    }
}

/// One runtime with its own copy of the decoder (the same seed, the same weights) and its
/// decode step registered once.
struct Runtime<D: TensorBackend> {
    graft: Graft<D, Meta>,
    dec: Decoder<D>,
    fid: FunctionId,
}

impl<D: TensorBackend> Runtime<D> {
    fn new(device: &D, config: Config, model: DecoderConfig, seed: u64) -> Result<Self, CliError> {
        let mut graft = Graft::new(device.clone(), config);
        let dec = Decoder::new(&mut graft, model, seed)?;
        let fid = dec.register(&mut graft);
        Ok(Runtime { graft, dec, fid })
    }

    /// `n` steps of a fresh sequence (on a fresh runtime the first graphed call warms up and
    /// the second records): per-step times and tokens.
    fn steps(
        &mut self,
        args: &GuardBenchArgs,
        n: usize,
        how: How,
    ) -> Result<(Vec<Duration>, Vec<Vec<i32>>), CliError> {
        let Runtime { graft, dec, fid } = self;
        let fid = *fid;
        let device = dec.device().clone();
        let bucket = graft.bucket(fid, args.batch)?.size();
        let mut state = dec.new_state(graft, bucket)?;
        let mut t = dec.tokens(graft, &first_tokens(args.batch, dec.config().vocab))?;
        let (mut times, mut tokens) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            make_room(&mut state, &device)?;
            if how == How::GuardEach && i >= 2 {
                graft.guard_next_call();
            }
            let (next, dt) = timed(&device, || match how {
                How::Eager => dec.step_eager(graft, &mut state, &t),
                How::Graft | How::GuardEach => dec.step_graft(graft, fid, &mut state, &t),
            })?;
            t = next;
            times.push(dt);
            tokens.push(rows(&t, &device, args.batch)?);
        }
        Ok((times, tokens))
    }
}

/// How [`Runtime::steps`] runs each step.
#[derive(Clone, Copy, PartialEq, Eq)]
enum How {
    /// Eager launches.
    Eager,
    /// Through graft, on its schedule.
    Graft,
    /// Through graft, every call from the third on guarded (`Graft::guard_next_call`).
    GuardEach,
}

fn mean_us(times: &[Duration]) -> f64 {
    times.iter().map(|t| t.as_secs_f64() * 1e6).sum::<f64>() / times.len().max(1) as f64
}

fn run_on<D: TensorBackend>(
    device: D,
    (model, model_name): (DecoderConfig, &str),
    args: &GuardBenchArgs,
    out: &mut dyn Write,
) -> Result<GuardReport, CliError> {
    if args.calls < 3 || args.steps == 0 {
        return Err(CliError::BadArgument {
            flag: "--calls",
            why: "at least 3 calls (a warmup, a recording, a call) and 1 timed step are needed"
                .into(),
        });
    }
    let off = Config {
        guards: None,
        ..Config::default()
    };
    let on = Config {
        guards: Some(Guards::default()),
        ..Config::default()
    };
    writeln!(out, "device:  {}", device.describe())?;
    writeln!(
        out,
        "decoder: {model_name} config at batch {}; per step, synchronized; guards at the default schedule (calls 1, 2, 4, ... after a recording, then every {})",
        args.batch,
        Guards::default().max_interval
    )?;
    // A fresh runtime for each figure, so that each one's step records on its second call.
    let runtime = |config: &Config| Runtime::new(&device, config.clone(), model, args.seed);
    let n = args.steps + 2;
    let mut replaying = runtime(&off)?;
    let (eager_t, eager_tokens) = replaying.steps(args, n, How::Eager)?;
    let (replay_t, replay_tokens) = replaying.steps(args, n, How::Graft)?;
    drop(replaying);
    let (guard_t, guard_tokens) = runtime(&off)?.steps(args, n, How::GuardEach)?;
    let mut amortised = runtime(&on)?;
    let (amortised_t, amortised_tokens) = amortised.steps(args, args.calls, How::Graft)?;
    let guards = amortised.graft.stats().guards;
    drop(amortised);
    let (unguarded_t, _) = runtime(&off)?.steps(args, args.calls, How::Graft)?;
    compare(
        args.batch,
        ("eager", &eager_tokens),
        ("replay", &replay_tokens),
    )?;
    compare(
        args.batch,
        ("eager", &eager_tokens),
        ("guarded", &guard_tokens),
    )?;
    let k = amortised_tokens.len().min(eager_tokens.len());
    compare(
        args.batch,
        ("eager", &eager_tokens[..k]),
        ("amortised", &amortised_tokens[..k]),
    )?;
    // The first two calls warm up and record: not part of any figure.
    let r = GuardReport {
        eager_us: median_us(&eager_t[2..]),
        replay_us: median_us(&replay_t[2..]),
        guarded_us: median_us(&guard_t[2..]),
        amortised_us: mean_us(&amortised_t[2..]),
        unguarded_us: mean_us(&unguarded_t[2..]),
        guards,
    };
    writeln!(
        out,
        "eager {}   replay {}   guarded call {} ({:.1}x a replay, {:.2}x eager)",
        fmt_us(r.eager_us),
        fmt_us(r.replay_us),
        fmt_us(r.guarded_us),
        r.guarded_us / r.replay_us,
        r.guarded_us / r.eager_us
    )?;
    writeln!(
        out,
        "{} calls after a recording ({} guarded): {} per call with guards, {} without ({:.3}x)",
        args.calls - 2,
        r.guards,
        fmt_us(r.amortised_us),
        fmt_us(r.unguarded_us),
        r.amortised_us / r.unguarded_us
    )?;
    writeln!(
        out,
        "tokens:  identical across eager, replay, guarded and amortised calls"
    )?;
    Ok(r)
}
