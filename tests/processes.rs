//! Ranks as processes: two copies of this test executable are the ranks of a job (their place
//! from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), each with one device
//! and a `Graft` joined to the job's group. The same vote as in-process groups
//! (`tests/multi.rs`) decides: both fall back together, both see a divergence, and a rank that
//! dies, fails or never comes is a typed error on the other within its timeout. A watchdog
//! kills any rank that outlives its deadline, so no scenario can hang.
//!
//! Each scenario runs on two backends. `sim`: simulated devices, the votes over the job's TCP
//! rendezvous (what CI runs; the bodies have no collective, since the simulator's all-reduce
//! is in-process). `cuda` (ignored: needs 2 CUDA GPUs, and skips itself with fewer): one GPU
//! per process, NCCL communicators from `ncclCommInitRank` (the unique id broadcast over the
//! rendezvous), an all-reduce in every body, and the votes over NCCL itself.
//!
//! Built with `harness = false`: graft-testkit's `procs::main` runs the scenarios as tests,
//! and dispatches a copy started as a rank to its scenario's child part.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graft::cuda::{CudaDevice, NcclBallotBox, NcclComm};
use graft::sim::SimDevice;
use graft::{
    BodyError, Buffer, CallError, Config, Ctx, DeviceError, EagerReason, FunctionId, FunctionSpec,
    Graft, GroupError, JoinError, Member, Outcome, Output, ProcessGroup, Rendezvous, RunKind,
    TcpBallotBox,
};
use graft_testkit::procs::{self, Scenario};
use graft_testkit::{CudaTestKernels, TestDevice, TestQueue};

const WORLD: usize = 2;
/// Elements of a rank's input.
const N: usize = 4;
const A: f32 = 2.0;
const B: f32 = 1.0;
/// How long a rank may take to join the job (and, on CUDA, to set up NCCL).
const JOIN: Duration = Duration::from_secs(30);
/// The watchdog: every rank of a scenario ends well before this.
const WATCHDOG: Duration = Duration::from_secs(90);
/// The exit code of a rank that kills itself on purpose.
const KILLED: i32 = 3;

/// One device per process and what carries its votes (and its all-reduces).
trait Backend: 'static {
    type D: TestDevice;
    /// What a rank keeps besides its runtime: its communicator and kernels on CUDA.
    type Extra;
    /// How long a rank waits for the others at a vote.
    const VOTE: Duration;
    /// How long a rank may take to notice a peer that died (a vote's failure).
    const LOSS_NOTICED: Duration;

    /// This process's device, its member of the job's group, and what else it keeps.
    fn open(place: &ProcessGroup) -> (Self::D, Member, Self::Extra);

    /// The body's collective over `out` (`n` f32s).
    fn all_reduce(extra: &Self::Extra, out: &Buffer, n: usize) -> Result<(), DeviceError>;

    /// What rank `rank` reads after a step whose `n` inputs are `x(r)` on rank `r`.
    fn expected(rank: usize, n: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32>;

    /// Whether `err` is how rank `rank`'s vote reports that `peer` died.
    fn lost(err: &GroupError, rank: usize, peer: usize) -> bool;
}

/// Simulated devices, votes over TCP, no collective in the bodies.
struct Sim;

impl Backend for Sim {
    type D = SimDevice;
    type Extra = ();
    const VOTE: Duration = Duration::from_secs(3);
    const LOSS_NOTICED: Duration = Self::VOTE;

    fn open(place: &ProcessGroup) -> (SimDevice, Member, ()) {
        let rv = Rendezvous::join(place, JOIN).expect("every rank joins");
        let transport = Arc::new(TcpBallotBox::new(Arc::new(Mutex::new(rv))));
        (SimDevice::new(), Member::new(transport, Self::VOTE), ())
    }

    fn all_reduce(_: &(), _: &Buffer, _: usize) -> Result<(), DeviceError> {
        Ok(())
    }

    fn expected(rank: usize, _: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
        x(rank).iter().map(|v| A.mul_add(*v, B)).collect()
    }

    fn lost(err: &GroupError, rank: usize, peer: usize) -> bool {
        matches!(err, GroupError::PeerLost { rank: r, peer: p, .. } if *r == rank && *p == peer)
    }
}

/// One GPU per process, NCCL communicators from `init_rank`, votes over NCCL.
struct Cuda;

impl Backend for Cuda {
    type D = CudaDevice;
    /// Field order is drop order: the communicator after the runtime's graphs.
    type Extra = (Arc<NcclComm>, CudaTestKernels);
    const VOTE: Duration = Duration::from_secs(5);
    /// NCCL may notice a dead peer only at the vote's deadline (within a host it often
    /// reports nothing), so the bound is the deadline and a margin.
    const LOSS_NOTICED: Duration = Duration::from_secs(8);

    fn open(place: &ProcessGroup) -> (CudaDevice, Member, Self::Extra) {
        let (dev, comm, kernels) = nccl_rank(place);
        let comm = Arc::new(comm);
        let ballots = NcclBallotBox::new(comm.clone()).expect("the vote's memory");
        let member = Member::new(Arc::new(ballots), Self::VOTE);
        (dev, member, (comm, kernels))
    }

    fn all_reduce(extra: &Self::Extra, out: &Buffer, n: usize) -> Result<(), DeviceError> {
        extra.0.all_reduce_sum_f32(out, n)
    }

    fn expected(_: usize, n: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
        (0..n)
            .map(|i| (0..WORLD).map(|r| A.mul_add(x(r)[i], B)).sum())
            .collect()
    }

    fn lost(err: &GroupError, rank: usize, _: usize) -> bool {
        matches!(err,
            GroupError::Device { rank: r, .. } | GroupError::Unanswered { rank: r, .. } if *r == rank)
    }
}

/// The GPU of this process (its `LOCAL_RANK`) with the test kernels, and its NCCL
/// communicator: rank 0 makes the unique id, the rendezvous broadcasts it.
fn nccl_rank(place: &ProcessGroup) -> (CudaDevice, NcclComm, CudaTestKernels) {
    let dev = CudaDevice::new(place.local_rank()).expect("this rank's GPU");
    let kernels = CudaTestKernels::load(&dev).expect("the test kernels load");
    let id = nccl_id(place);
    let comm = NcclComm::init_rank(&dev, &id, place.rank(), place.world(), JOIN)
        .expect("the NCCL communicator");
    (dev, comm, kernels)
}

/// Rank 0's NCCL unique id, on every rank.
fn nccl_id(place: &ProcessGroup) -> [u8; graft::cuda::UNIQUE_ID_BYTES] {
    let mut rv = Rendezvous::join(place, JOIN).expect("every rank joins");
    let mut id = if place.rank() == 0 {
        NcclComm::unique_id().expect("an NCCL unique id")
    } else {
        [0; graft::cuda::UNIQUE_ID_BYTES]
    };
    rv.broadcast(&mut id, JOIN)
        .expect("the id reaches every rank");
    id
}

/// One rank's runtime, joined to the job's group. `g` is declared first so that its graphs
/// go before the communicator in `extra`.
struct Rank<K: Backend> {
    g: Graft<K::D, u32>,
    extra: K::Extra,
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
    let (device, member, extra) = K::open(&place);
    let mut g = Graft::new(device, config);
    g.join(member);
    let f = g.register("step", FunctionSpec::default());
    let x = g.alloc(N * 4).unwrap();
    let long = g.alloc(2 * N * 4).unwrap();
    Rank {
        g,
        extra,
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
) -> Result<Outcome, CallError> {
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
        r.g.read_f32(&out[0].buffer).unwrap(),
        expected,
        "step {step}"
    );
    Ok(outcome)
}

fn recorded(o: &Outcome) -> bool {
    matches!(o, Outcome::Recorded(_))
}

fn replayed(o: &Outcome) -> bool {
    matches!(o, Outcome::Replayed(_))
}

/// The group error a failed call returned.
fn group_error(result: Result<Outcome, CallError>) -> GroupError {
    match result {
        Err(CallError::Group { source, .. }) => source,
        other => panic!("expected a group error, got {other:?}"),
    }
}

/// Whether a scenario of `backend` must not run here (a CUDA one on a machine with fewer
/// than two GPUs: it says so and passes).
fn skip(backend: &str) -> bool {
    backend == "cuda" && graft_testkit::skip_without_cuda_gpus(WORLD)
}

/// Starts both ranks of `name` and checks their exit codes (`KILLED` for a rank that kills
/// itself, 0 for the others).
fn both(name: &str, killed: Option<usize>) {
    if skip(name.rsplit("::").next().unwrap_or_default()) {
        return;
    }
    let exits = procs::spawn_ranks(name, WORLD, &[0, 1], &[], WATCHDOG);
    for e in &exits {
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

// --- Rank 1's process ends inside its recording: rank 0's vote fails (at once over TCP;
// over NCCL at the latest at the vote's deadline), and the group stays broken.

fn killed_while_recording<K: Backend>() {
    let mut r = join::<K>(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    let fault = if r.rank == 1 {
        Fault::Exit
    } else {
        Fault::None
    };
    let start = Instant::now();
    let err = group_error(call(&mut r, 2, false, fault));
    let took = start.elapsed();
    assert!(took < K::LOSS_NOTICED, "noticed after {took:?}");
    assert!(K::lost(&err, 0, 1), "{err}");
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
    if r.rank == 0 {
        std::process::exit(KILLED);
    }
    let start = Instant::now();
    let err = group_error(call(&mut r, 2, false, Fault::None));
    let took = start.elapsed();
    assert!(took < K::LOSS_NOTICED, "noticed after {took:?}");
    assert!(K::lost(&err, 1, 0), "{err}");
    let later = group_error(call(&mut r, 3, false, Fault::None));
    assert!(
        matches!(&later, GroupError::Broken { rank: 1, cause } if **cause == err),
        "{later}"
    );
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
        (0, Err(CallError::PeerFailed { rank: 1, .. })) | (1, Err(CallError::Body { .. })) => {}
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
    let id = nccl_id(&place);
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
