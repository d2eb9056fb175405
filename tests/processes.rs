//! Ranks as processes, on the simulator: two copies of this test executable are the ranks of a
//! job (their place from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
//! each with a simulated device and a `Graft` joined to a group whose votes travel over the
//! job's TCP rendezvous. The same vote as in-process groups (`tests/multi.rs`) decides: both
//! fall back together, both see a divergence, and a rank that dies, fails or never comes is a
//! typed error on the other within its timeout. A watchdog kills any rank that outlives its
//! deadline, so no scenario can hang.
//!
//! Built with `harness = false`: graft-testkit's `procs::main` runs the scenarios as tests, and
//! dispatches a copy started as a rank to its scenario's child part.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graft::sim::SimDevice;
use graft::{
    BodyError, Buffer, CallError, Config, Ctx, EagerReason, FunctionId, FunctionSpec, Graft,
    GroupError, JoinError, Member, Outcome, Output, ProcessGroup, Rendezvous, RunKind,
    TcpBallotBox,
};
use graft_testkit::TestQueue;
use graft_testkit::procs::{self, Scenario};

const WORLD: usize = 2;
/// Elements of a rank's input.
const N: usize = 4;
const A: f32 = 2.0;
const B: f32 = 1.0;
/// How long a rank waits for the others at a vote.
const VOTE: Duration = Duration::from_secs(3);
/// How long a rank may take to join the job.
const JOIN: Duration = Duration::from_secs(15);
/// The watchdog: every rank of a scenario ends well before this.
const WATCHDOG: Duration = Duration::from_secs(45);
/// The exit code of a rank that kills itself on purpose.
const KILLED: i32 = 3;

/// One rank's runtime, joined to the job's group.
struct Rank {
    rank: usize,
    g: Graft<SimDevice, u32>,
    f: FunctionId,
    x: Buffer,
    long: Buffer,
}

/// Where this process stands in the job, from the launcher's variables.
fn place() -> ProcessGroup {
    ProcessGroup::from_env().expect("the launcher sets every variable")
}

fn join(config: Config) -> Rank {
    let place = place();
    let rv = Rendezvous::join(&place, JOIN).expect("every rank joins");
    let transport = Arc::new(TcpBallotBox::new(Arc::new(Mutex::new(rv))));
    let mut g = Graft::new(SimDevice::new(), config);
    g.join(Member::new(transport, VOTE));
    let f = g.register("step", FunctionSpec::default());
    let x = g.alloc(N * 4).unwrap();
    let long = g.alloc(2 * N * 4).unwrap();
    Rank {
        rank: place.rank(),
        g,
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

/// One call of the step function (`a * x + b`) at `step`, on the `2 * N` input when `long`;
/// checks the values it reads and returns the outcome.
fn call(r: &mut Rank, step: usize, long: bool, fault: Fault) -> Result<Outcome, CallError> {
    let (x, n) = if long {
        (r.long.clone(), 2 * N)
    } else {
        (r.x.clone(), N)
    };
    let input = x_of(r.rank, step, n);
    r.g.write_f32(&x, &input).unwrap();
    let mut out = Vec::new();
    let outcome = r.g.call_into(
        r.f,
        &[&x],
        &[],
        |ctx: &mut Ctx<'_, SimDevice>| {
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
            Ok(vec![Output::new(out, n as u32)])
        },
        &mut out,
    )?;
    let expected: Vec<f32> = input.iter().map(|v| A.mul_add(*v, B)).collect();
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

/// Starts both ranks of `name` and checks their exit codes (`KILLED` for a rank that kills
/// itself, 0 for the others).
fn both(name: &str, killed: Option<usize>) {
    let exits = procs::spawn_ranks(name, WORLD, &[0, 1], &[], WATCHDOG);
    for e in &exits {
        e.expect_code(if Some(e.rank) == killed { KILLED } else { 0 });
    }
}

// --- One rank's capture fails: both ranks run eagerly, same outcome everywhere.

fn agreement_child() {
    let mut r = join(Config::default());
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

fn divergence_child() {
    let config = Config {
        warmups: 0,
        ..Config::default()
    };
    let mut r = join(config);
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

// --- Rank 1's process ends inside its recording: rank 0 loses it at once, not after the
// timeout, and the group stays broken.

fn killed_while_recording_child() {
    let mut r = join(Config::default());
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
    assert!(
        start.elapsed() < VOTE,
        "noticed after {:?}",
        start.elapsed()
    );
    let lost = GroupError::PeerLost {
        rank: 0,
        peer: 1,
        kind: std::io::ErrorKind::UnexpectedEof,
    };
    assert_eq!(err, lost);
    assert!(r.g.member().unwrap().is_broken());
    let later = group_error(call(&mut r, 3, false, Fault::None));
    assert_eq!(
        later,
        GroupError::Broken {
            rank: 0,
            cause: Box::new(lost)
        }
    );
}

// --- Rank 0 (the rendezvous's centre) ends between steps: rank 1's next vote loses it.

fn killed_between_steps_child() {
    let mut r = join(Config::default());
    assert_eq!(
        call(&mut r, 1, false, Fault::None).unwrap(),
        Outcome::Warmup
    );
    if r.rank == 0 {
        std::process::exit(KILLED);
    }
    let start = Instant::now();
    let err = group_error(call(&mut r, 2, false, Fault::None));
    assert!(
        start.elapsed() < VOTE,
        "noticed after {:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            err,
            GroupError::PeerLost {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{err}"
    );
    let later = group_error(call(&mut r, 3, false, Fault::None));
    assert!(
        matches!(&later, GroupError::Broken { rank: 1, cause } if **cause == err),
        "{later}"
    );
}

// --- Rank 1's body fails while recording: its error on rank 1, `PeerFailed` on rank 0; the
// next steps record and replay on both.

fn body_fails_child() {
    let mut r = join(Config::default());
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
        (0, Err(CallError::PeerFailed { rank: 1, .. })) => {}
        (1, Err(CallError::Body { .. })) => {}
        (rank, other) => panic!("rank {rank}: {other:?}"),
    }
    assert!(recorded(&call(&mut r, 3, false, Fault::None).unwrap()));
    assert!(replayed(&call(&mut r, 4, false, Fault::None).unwrap()));
}

// --- A rank that never joins: the rank that came gets a typed error within the deadline
// (rank 0 names the missing rank; a rank whose rank 0 never comes cannot reach it).

const SHORT_JOIN: Duration = Duration::from_millis(800);

fn never_joins_child() {
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

fn never_joins(name: &str) {
    for alone in [0, 1] {
        let exits = procs::spawn_ranks(name, WORLD, &[alone], &[], WATCHDOG);
        exits[0].expect_code(0);
    }
}

fn main() {
    procs::main(&[
        Scenario {
            name: "agreement_across_processes",
            ignore: None,
            parent: |name| both(name, None),
            child: agreement_child,
        },
        Scenario {
            name: "divergence_across_processes",
            ignore: None,
            parent: |name| both(name, None),
            child: divergence_child,
        },
        Scenario {
            name: "a_rank_killed_while_recording",
            ignore: None,
            parent: |name| both(name, Some(1)),
            child: killed_while_recording_child,
        },
        Scenario {
            name: "a_rank_killed_between_steps",
            ignore: None,
            parent: |name| both(name, Some(0)),
            child: killed_between_steps_child,
        },
        Scenario {
            name: "a_body_failing_on_one_rank",
            ignore: None,
            parent: |name| both(name, None),
            child: body_fails_child,
        },
        Scenario {
            name: "a_rank_that_never_joins",
            ignore: None,
            parent: never_joins,
            child: never_joins_child,
        },
    ]);
}
