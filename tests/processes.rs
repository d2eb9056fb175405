//! Ranks as processes: two copies of this test executable are the ranks of a job (their place
//! from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), each with one device
//! and a `Graft` joined to the job's group. The same vote as in-process groups
//! (`tests/multi.rs`) decides: both fall back together, both see a divergence, and a rank that
//! dies, fails, stops or never comes is a typed error on the other within a bound: each rank
//! runs graft's [`Watchdog`] on its peers, which breaks the group and aborts the communicator
//! when a peer's link closes or falls silent, wherever the survivor waits (a vote, an eager
//! collective, a replay's recorded all-reduce). The launcher kills any rank that outlives its
//! deadline, so no scenario can hang.
//!
//! Each scenario runs on two backends. `sim`: simulated devices, the votes over the job's TCP
//! rendezvous (what CI runs; the bodies have no collective, since the simulator's all-reduce
//! is in-process). `cuda` (ignored: needs 2 CUDA GPUs, and skips itself with fewer): one GPU
//! per process, NCCL communicators from `ncclCommInitRank` (the unique id broadcast over the
//! rendezvous), an all-reduce in every body, and the votes over NCCL itself.
//!
//! Built with `harness = false`: graft-testkit's `procs::main` runs the scenarios as tests,
//! and dispatches a copy started as a rank to its scenario's child part.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graft::cuda::{CudaDevice, NcclBallotBox, NcclComm};
use graft::launch::{JoinError, ProcessGroup, Rendezvous, TcpBallotBox, Watchdog};
use graft::sim::SimDevice;
use graft::{
    BodyError, Buffer, CallError, Config, Ctx, DeviceError, EagerReason, FunctionId, FunctionSpec,
    Graft, GroupError, Member, MemoryError, Outcome, Output, RunKind,
};
use graft_testkit::procs::{self, Scenario};
use graft_testkit::{CudaTestKernels, TestDevice, TestQueue};

#[path = "processes/backends.rs"]
mod backends;

use backends::{Backend, Cuda, Sim, nccl_id};

const WORLD: usize = 2;
/// Elements of a rank's input.
const N: usize = 4;
const A: f32 = 2.0;
const B: f32 = 1.0;
/// How long a rank may take to join the job (and, on CUDA, to set up NCCL).
const JOIN: Duration = Duration::from_secs(30);
/// The watchdog: every rank of a scenario ends well before this.
const WATCHDOG: Duration = Duration::from_secs(90);
/// The exit code of a rank that ends itself on purpose.
const KILLED: i32 = 3;
/// How long a peer may stay silent before the watchdog counts it as lost.
const BOUND: Duration = Duration::from_secs(2);
/// How long after a peer's loss a survivor may take to return: the watchdog's bound, the
/// communicator's bounded abort (2 s) and a margin.
const RETURNS: Duration = Duration::from_secs(6);

/// The job's rendezvous, for the tests' own barrier (shared with the simulator's votes).
type Shared = Arc<Mutex<Rendezvous>>;

/// The all-gather tag of the tests' barrier.
const BARRIER: u32 = 0x6261_7272;

/// Waits until every rank got here: a rank that then leaves cannot be taken for gone by a
/// peer still reading the step before (a read is refused once the group broke).
fn barrier<K: Backend>(r: &Rank<K>) {
    r.rv.lock()
        .unwrap()
        .all_gather(BARRIER, &[0], JOIN)
        .expect("every rank reaches the barrier");
}

/// Whether `err` is how rank `rank` learns that `peer` is gone: its watchdog's finding, or
/// (over TCP) its vote's lost connection, whichever came first.
fn lost(err: &GroupError, rank: usize, peer: usize) -> bool {
    matches!(err,
        GroupError::Watchdog { rank: r, peer: p, .. } | GroupError::PeerLost { rank: r, peer: p, .. }
            if *r == rank && *p == peer)
}

/// One rank's runtime, joined to the job's group. `g` is declared first so that its graphs
/// go before the communicator in `extra`; the watchdog goes last.
struct Rank<K: Backend> {
    g: Graft<K::D, u32>,
    extra: K::Extra,
    _watchdog: Watchdog,
    rv: Shared,
    rank: usize,
    f: FunctionId,
    x: Buffer,
    long: Buffer,
}

/// Where this process stands in the job, from the launcher's variables.
fn place() -> ProcessGroup {
    ProcessGroup::from_env().expect("the launcher sets every variable")
}

fn join<K: Backend>(config: Config) -> Rank<K> {
    let place = place();
    let (device, member, extra, watchdog, rv) = K::open(&place);
    let mut g = Graft::new(device, config);
    g.join(member);
    let f = g.register("step", FunctionSpec::default());
    let x = g.alloc(N * 4).unwrap();
    let long = g.alloc(2 * N * 4).unwrap();
    Rank {
        g,
        extra,
        _watchdog: watchdog,
        rv,
        rank: place.rank(),
        f,
        x,
        long,
    }
}

/// What the body does at its recording besides its work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    /// A capture violation: the rank falls back.
    Sync,
    /// The body returns an error.
    Fail,
    /// The process ends inside the capture.
    Exit,
}

#[derive(Debug, thiserror::Error)]
#[error("the body refused on purpose")]
struct Refused;

fn x_of(rank: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (step * 10 + rank * 100 + i) as f32)
        .collect()
}

/// One call of the step function (`a * x + b`, then the backend's all-reduce) at `step`, on
/// the `2 * N` input when `long`; checks the values it reads and returns the outcome.
fn call<K: Backend>(
    r: &mut Rank<K>,
    step: usize,
    long: bool,
    fault: Fault,
) -> Result<Outcome, Failed> {
    let (x, n) = if long {
        (r.long.clone(), 2 * N)
    } else {
        (r.x.clone(), N)
    };
    r.g.write_f32(&x, &x_of(r.rank, step, n)).unwrap();
    let mut out = Vec::new();
    let extra = &r.extra;
    let outcome = r.g.call_into(
        r.f,
        &[&x],
        &[],
        |ctx: &mut Ctx<'_, K::D>| {
            let x = ctx.input(0).clone();
            let out = ctx.alloc(x.len())?;
            ctx.queue().axpb_f32(&out, &x, A, B, n)?;
            if ctx.kind() == RunKind::Recording {
                match fault {
                    Fault::None => {}
                    Fault::Sync => ctx.queue().synchronize()?,
                    Fault::Fail => return Err(BodyError::Framework(Box::new(Refused))),
                    Fault::Exit => std::process::exit(KILLED),
                }
            }
            K::all_reduce(extra, &out, n)?;
            Ok(vec![Output::new(out, n as u32)])
        },
        &mut out,
    )?;
    let expected = K::expected(r.rank, n, |rank| x_of(rank, step, n));
    assert_eq!(
        r.g.read_f32(&out[0].buffer).map_err(Failed::Read)?,
        expected,
        "step {step}"
    );
    Ok(outcome)
}

/// How a step failed: its call, or the read of its output (refused once the group broke,
/// since the collective it waited on may have been aborted).
#[derive(Debug)]
enum Failed {
    Call(CallError),
    Read(MemoryError),
}

impl From<CallError> for Failed {
    fn from(e: CallError) -> Failed {
        Failed::Call(e)
    }
}

fn recorded(o: &Outcome) -> bool {
    matches!(o, Outcome::Recorded(_))
}

fn replayed(o: &Outcome) -> bool {
    matches!(o, Outcome::Replayed(_))
}

/// The group error a failed step returned (its call's, or its read's).
fn group_error(result: Result<Outcome, Failed>) -> GroupError {
    match result {
        Err(Failed::Call(CallError::Group { source, .. }))
        | Err(Failed::Read(MemoryError::Group { source })) => source,
        other => panic!("expected a group error, got {other:?}"),
    }
}

/// The loss a failed step reports. The watchdog may break the group between two calls, and
/// then the next call is refused as `Broken`, naming the loss as its cause.
fn loss(result: Result<Outcome, Failed>) -> GroupError {
    match group_error(result) {
        GroupError::Broken { cause, .. } => *cause,
        err => err,
    }
}

/// Whether a scenario of `backend` must not run here (a CUDA one on a machine with fewer
/// than two GPUs: it says so and passes).
fn skip(backend: &str) -> bool {
    backend == "cuda" && graft_testkit::skip_without_cuda_gpus(WORLD)
}

/// Starts both ranks of `name` and checks how they ended: the rank that ends itself with
/// `KILLED` or by SIGKILL, the others with 0.
fn both(name: &str, killed: Option<usize>) {
    if skip(name.rsplit("::").next().unwrap_or_default()) {
        return;
    }
    let exits = procs::spawn_ranks(name, WORLD, &[0, 1], &[], WATCHDOG);
    for e in &exits {
        // How long a survivor took to return, as it reports it.
        for line in e.stderr.lines().filter(|l| l.contains(" returned ")) {
            println!("{name}: {line}");
        }
        let sigkilled = e.status.and_then(|s| s.signal()) == Some(9);
        if Some(e.rank) == killed && sigkilled {
            continue;
        }
        procs::expect_code(e, if Some(e.rank) == killed { KILLED } else { 0 });
    }
}

// --- One rank's capture fails: both ranks run eagerly, same outcome everywhere.

fn agreement<K: Backend>() {
    let mut r = join::<K>(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    let fault = if r.rank == 1 {
        Fault::Sync
    } else {
        Fault::None
    };
    let outcome = call(&mut r, 2, false, fault).unwrap();
    match r.rank {
        0 => assert_eq!(
            outcome,
            Outcome::Eager(EagerReason::PeerCaptureFailed { rank: 1 })
        ),
        _ => assert!(
            matches!(outcome, Outcome::Eager(EagerReason::CaptureFailed { .. })),
            "{outcome:?}"
        ),
    }
    for step in 3..6 {
        let o = call(&mut r, step, false, Fault::None).unwrap();
        assert!(matches!(o, Outcome::Eager(_)), "step {step}: {o:?}");
    }
    let stats = r.g.stats();
    assert_eq!((stats.agreements, stats.recordings), (1, 0), "{stats:?}");
}

// --- Different shapes: both ranks see the divergence; the group still works after.

fn divergence<K: Backend>() {
    let config = Config {
        warmups: 0,
        ..Config::default()
    };
    let mut r = join::<K>(config);
    let long = r.rank == 1;
    let err = group_error(call(&mut r, 1, long, Fault::None));
    assert!(
        matches!(
            err,
            GroupError::Diverged {
                rank: 0,
                other: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(!r.g.member().unwrap().is_broken());
    assert!(recorded(&call(&mut r, 2, false, Fault::None).unwrap()));
    assert!(replayed(&call(&mut r, 3, false, Fault::None).unwrap()));
}

// --- Rank 1's process ends inside its recording: rank 0's vote fails at once (its watchdog
// finds the link closed and aborts the communicator under the vote), and the group stays
// broken.

fn killed_while_recording<K: Backend>() {
    let mut r = join::<K>(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    barrier(&r);
    let fault = if r.rank == 1 {
        Fault::Exit
    } else {
        Fault::None
    };
    let start = Instant::now();
    let err = loss(call(&mut r, 2, false, fault));
    let took = start.elapsed();
    assert!(took < RETURNS, "noticed after {took:?}");
    assert!(lost(&err, 0, 1), "{err}");
    eprintln!("rank 0 returned {took:?} after rank 1 ended inside its recording: {err}");
    assert!(r.g.member().unwrap().is_broken());
    let later = group_error(call(&mut r, 3, false, Fault::None));
    assert!(
        matches!(&later, GroupError::Broken { rank: 0, cause } if **cause == err),
        "{later}"
    );
}

// --- Rank 0 (the rendezvous's centre) ends between steps: rank 1's next vote fails.

fn killed_between_steps<K: Backend>() {
    let mut r = join::<K>(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    barrier(&r);
    if r.rank == 0 {
        std::process::exit(KILLED);
    }
    let start = Instant::now();
    let err = loss(call(&mut r, 2, false, Fault::None));
    let took = start.elapsed();
    assert!(took < RETURNS, "noticed after {took:?}");
    assert!(lost(&err, 1, 0), "{err}");
    eprintln!("rank 1 returned {took:?} after rank 0 ended between steps: {err}");
    let later = group_error(call(&mut r, 3, false, Fault::None));
    assert!(
        matches!(&later, GroupError::Broken { rank: 1, cause } if **cause == err),
        "{later}"
    );
}

// --- Rank 1 goes at `at` while rank 0 waits on it: killed (SIGKILL) or stopped (SIGSTOP,
// continued after rank 0 is done). At step 1 rank 0 waits in a warmup's eager all-reduce, at
// step 4 in a replay's recorded one (steps 2 and 3 recorded and replayed). Rank 0's watchdog
// finds the link closed, or silent for its bound, breaks the group and aborts the
// communicator, so the all-reduce returns and the read of its output is refused. (On the
// simulator the bodies have no collective: rank 0's steps go on until the watchdog or the
// next vote finds rank 1 gone.)

/// How rank 1 goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Leave {
    Kill,
    Stop,
}

fn gone_at<K: Backend>(at: usize, how: Leave) {
    let mut r = join::<K>(Config::default());
    for step in 1..at {
        let o = call(&mut r, step, false, Fault::None).unwrap();
        let expected = match step {
            1 => matches!(o, Outcome::Warmup),
            2 => recorded(&o),
            _ => replayed(&o),
        };
        assert!(expected, "step {step}: {o:?}");
    }
    barrier(&r);
    if r.rank == 1 {
        leave(how);
    }
    let start = Instant::now();
    let mut step = at;
    let err = loop {
        match call(&mut r, step, false, Fault::None) {
            Ok(_) => {
                assert!(
                    start.elapsed() < RETURNS,
                    "rank 1 not found gone after {:?}",
                    start.elapsed()
                );
                step += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            failed => break loss(failed),
        }
    };
    let took = start.elapsed();
    assert!(took < RETURNS, "returned after {took:?}");
    assert!(lost(&err, 0, 1), "{err}");
    eprintln!("rank 0 returned {took:?} after rank 1 went ({how:?} at step {at}): {err}");
    let later = group_error(call(&mut r, step + 1, false, Fault::None));
    assert!(
        matches!(&later, GroupError::Broken { rank: 0, cause } if **cause == err),
        "{later}"
    );
}

/// Ends this process (SIGKILL), or stops it (SIGSTOP) until well after its peer is done and
/// then ends it so.
fn leave(how: Leave) -> ! {
    let pid = std::process::id().to_string();
    if how == Leave::Stop {
        // Never waited for: it outlives this process, which it continues and which then dies.
        #[expect(clippy::zombie_processes, reason = "the waker must outlive the rank")]
        Command::new("sh")
            .args(["-c", &format!("sleep 15; kill -CONT {pid}")])
            .spawn()
            .expect("sh starts");
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .expect("kill runs");
        // Continued: the peer is gone, and this rank's NCCL threads find it so; end without
        // running the process's exit handlers over them.
    }
    Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .expect("kill runs");
    unreachable!("SIGKILL ends the process");
}

fn killed_in_an_eager_collective<K: Backend>() {
    gone_at::<K>(1, Leave::Kill);
}

fn killed_in_a_replay<K: Backend>() {
    gone_at::<K>(4, Leave::Kill);
}

fn stopped_in_a_replay<K: Backend>() {
    gone_at::<K>(4, Leave::Stop);
}

// --- Rank 1's body fails while recording: its error on rank 1, `PeerFailed` on rank 0; the
// next steps record and replay on both.

fn body_fails<K: Backend>() {
    let mut r = join::<K>(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    let fault = if r.rank == 1 {
        Fault::Fail
    } else {
        Fault::None
    };
    match (r.rank, call(&mut r, 2, false, fault)) {
        (0, Err(Failed::Call(CallError::PeerFailed { rank: 1, .. })))
        | (1, Err(Failed::Call(CallError::Body { .. }))) => {}
        (rank, other) => panic!("rank {rank}: {other:?}"),
    }
    assert!(recorded(&call(&mut r, 3, false, Fault::None).unwrap()));
    assert!(replayed(&call(&mut r, 4, false, Fault::None).unwrap()));
}

// --- A rank that never joins: the rank that came gets a typed error within the deadline.
// Simulator: rank 0 names the missing rank; a rank whose rank 0 never comes cannot reach it.
// CUDA: rank 1 joins the rendezvous but never makes its communicator; rank 0's non-blocking
// NCCL setup times out.

const SHORT_JOIN: Duration = Duration::from_millis(800);

fn never_joins_sim() {
    let start = Instant::now();
    let err = Rendezvous::join(&place(), SHORT_JOIN).unwrap_err();
    assert!(start.elapsed() < SHORT_JOIN * 3, "{:?}", start.elapsed());
    match place().rank() {
        0 => assert!(
            matches!(&err, JoinError::NeverJoined { rank: 0, missing, .. } if missing == &[1]),
            "{err}"
        ),
        _ => assert!(
            matches!(err, JoinError::Unreachable { rank: 1, .. }),
            "{err}"
        ),
    }
}

fn never_joins_sim_parent(name: &str) {
    for alone in [0, 1] {
        let exits = procs::spawn_ranks(name, WORLD, &[alone], &[], WATCHDOG);
        procs::expect_code(&exits[0], 0);
    }
}

const NCCL_INIT: Duration = Duration::from_secs(5);

fn never_joins_cuda() {
    let place = place();
    let dev = CudaDevice::new(place.local_rank()).expect("this rank's GPU");
    let (id, _rv) = nccl_id(&place);
    if place.rank() == 1 {
        // Joined the rendezvous, never makes its communicator.
        std::thread::sleep(NCCL_INIT * 2);
        return;
    }
    let start = Instant::now();
    let err = NcclComm::init_rank(&dev, &id, 0, WORLD, NCCL_INIT).unwrap_err();
    assert!(
        start.elapsed() < NCCL_INIT + Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(err, DeviceError::CollectiveUnanswered { rank: 0, .. }),
        "{err}"
    );
}

/// A scenario on the simulator (run in CI) and on CUDA (ignored: needs 2 GPUs).
macro_rules! on_both {
    ($name:literal, $child:ident, $killed:expr) => {
        [
            Scenario {
                name: concat!($name, "::sim"),
                ignore: None,
                parent: |name| both(name, $killed),
                child: $child::<Sim>,
            },
            Scenario {
                name: concat!($name, "::cuda"),
                ignore: Some("needs 2 CUDA GPUs (skips itself with fewer)"),
                parent: |name| both(name, $killed),
                child: $child::<Cuda>,
            },
        ]
    };
}

fn main() {
    let scenarios: Vec<Scenario> = [
        on_both!("agreement_across_processes", agreement, None),
        on_both!("divergence_across_processes", divergence, None),
        on_both!(
            "a_rank_killed_while_recording",
            killed_while_recording,
            Some(1)
        ),
        on_both!("a_rank_killed_between_steps", killed_between_steps, Some(0)),
        on_both!("a_body_failing_on_one_rank", body_fails, None),
        on_both!(
            "a_rank_killed_in_an_eager_collective",
            killed_in_an_eager_collective,
            Some(1)
        ),
        on_both!("a_rank_killed_in_a_replay", killed_in_a_replay, Some(1)),
        on_both!("a_rank_stopped_in_a_replay", stopped_in_a_replay, Some(1)),
        [
            Scenario {
                name: "a_rank_that_never_joins::sim",
                ignore: None,
                parent: never_joins_sim_parent,
                child: never_joins_sim,
            },
            Scenario {
                name: "a_rank_that_never_makes_its_communicator::cuda",
                ignore: Some("needs 2 CUDA GPUs (skips itself with fewer)"),
                parent: |name| both(name, None),
                child: never_joins_cuda,
            },
        ],
    ]
    .into_iter()
    .flatten()
    .collect();
    procs::main(&scenarios);
}
