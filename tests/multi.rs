//! Tensor-parallel groups: two ranks, each with its own device, `Graft` (joined to the group)
//! and communicator, driven by a `Coordinator`. Every step computes `out = a * x + b` and
//! all-reduces `out`, so each rank reads the sum over ranks. The scenarios check that the
//! ranks agree at every recording: all record, all fall back, or all fail, and that no rank
//! ever waits for a peer longer than the group's timeout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graft::{
    BodyError, Buffer, CallError, Config, Coordinator, Ctx, Decision, DevicePtr, EagerReason,
    FunctionId, FunctionSpec, Graft, GroupError, MemoryError, Outcome, Output, RunKind, StepError,
};
use graft_testkit::{TestGroupDevice, TestQueue};

const WORLD: usize = 2;
/// Elements per rank's input.
const N: usize = 4;
const A: f32 = 2.0;
const B: f32 = 1.0;
/// The group's agreement timeout, unless a scenario needs another.
const AGREEMENT: Duration = Duration::from_secs(2);
/// Every scenario finishes well within this: the guard against a hang. Generous, so that a
/// run under compute-sanitizer (memcheck made one 3 s scenario take 33 s) stays inside it;
/// the scenarios assert their own, tighter bounds on what must be prompt.
const TEST_BOUND: Duration = Duration::from_secs(90);

/// Defines `mod $name { sim, cuda }` running `$body` on each backend within [`TEST_BOUND`].
/// The `cuda` variant needs [`WORLD`] GPUs: on a machine with fewer it says so on stderr and
/// passes without running, so the GPU suite stays green on a one-GPU machine.
macro_rules! group_test {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn sim() {
                super::bounded(super::$body::<graft::sim::SimDevice>);
            }
            #[test]
            #[ignore = "needs 2 CUDA GPUs (skips itself with fewer)"]
            fn cuda() {
                if graft_testkit::skip_without_cuda_gpus(super::WORLD) {
                    return;
                }
                super::bounded(super::$body::<graft::cuda::CudaDevice>);
            }
        }
    };
}

/// Like [`group_test!`], on the simulator only.
macro_rules! sim_group_test {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn sim() {
                super::bounded(super::$body::<graft::sim::SimDevice>);
            }
        }
    };
}

fn bounded(test: fn()) {
    let start = Instant::now();
    test();
    let took = start.elapsed();
    assert!(took < TEST_BOUND, "the scenario took {took:?}");
}

/// One rank's state. `g` is declared before `comm` so it is dropped first: the graphs that
/// captured the communicator's collectives go before it.
struct Rank<D: TestGroupDevice> {
    g: Graft<D, u32>,
    comm: D::Comm,
    /// The step function (`a * x + b`, all-reduced).
    f: FunctionId,
    /// The same body registered as a second function.
    other: FunctionId,
    /// The input, outside the graph pool.
    x: Buffer,
    /// A longer input (`2 * N` elements), for a different signature.
    long: Buffer,
    /// Raw allocations taking the device's memory (see [`exhaust`]).
    hog: Vec<DevicePtr>,
}

/// What the body does besides its work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    /// Synchronizes the stream while recording: a capture violation.
    SyncWhileRecording,
    /// Panics while recording.
    PanicWhileRecording,
}

/// A group of [`WORLD`] ranks on fresh devices and communicators, with `config`.
fn start<D: TestGroupDevice>(config: Config, agreement: Duration) -> Coordinator<Rank<D>> {
    let devices = D::devices(WORLD);
    let comms = D::comms(&devices);
    let seeds: Vec<(D, D::Comm)> = devices.into_iter().zip(comms).collect();
    Coordinator::start(seeds, agreement, move |(dev, comm), member| {
        let mut g: Graft<D, u32> = Graft::new(dev, config.clone());
        g.join(member);
        let f = g.register("step", FunctionSpec::default());
        let other = g.register("other", FunctionSpec::default());
        let x = g.alloc(N * 4)?;
        let long = g.alloc(2 * N * 4)?;
        Ok::<_, MemoryError>(Rank {
            g,
            comm,
            f,
            other,
            x,
            long,
            hog: Vec::new(),
        })
    })
    .expect("every rank starts")
}

/// Rank `rank`'s input at `step`: distinct on every rank and step.
fn x_of(rank: usize, step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (step * 10 + rank * 100 + i) as f32)
        .collect()
}

/// What every rank reads after `step`: the sum over ranks of `a * x + b`.
fn expected(step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0..WORLD).map(|r| A.mul_add(x_of(r, step, n)[i], B)).sum())
        .collect()
}

/// `out = a * x + b`, all-reduced over the group, with `fault`.
fn body<'c, D: TestGroupDevice>(
    comm: &'c D::Comm,
    fault: Fault,
) -> impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> + 'c {
    move |ctx: &mut Ctx<'_, D>| {
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        ctx.queue().axpb_f32(&out, &x, A, B, n)?;
        if ctx.kind() == RunKind::Recording {
            match fault {
                Fault::None => {}
                Fault::SyncWhileRecording => ctx.queue().synchronize()?,
                Fault::PanicWhileRecording => panic!("injected panic while recording"),
            }
        }
        D::all_reduce(comm, &out, n)?;
        Ok(vec![Output::new(out, n as u32)])
    }
}

type StepResult = Result<(Outcome, Vec<f32>), CallError>;

/// One call of `function` (the step function when `None`) on `rank` at `step`, on its `N`
/// element input (or its `2 * N` one when `long`), and the output it reads.
fn call<D: TestGroupDevice>(
    r: &mut Rank<D>,
    rank: usize,
    step: usize,
    other: bool,
    long: bool,
    fault: Fault,
) -> StepResult {
    let (x, n) = if long {
        (r.long.clone(), 2 * N)
    } else {
        (r.x.clone(), N)
    };
    r.g.write_f32(&x, &x_of(rank, step, n)).unwrap();
    let f = if other { r.other } else { r.f };
    let mut out = Vec::new();
    let outcome =
        r.g.call_into(f, &[&x], &[], body::<D>(&r.comm, fault), &mut out)?;
    let values = r.g.read_f32(&out[0].buffer).unwrap();
    Ok((outcome, values))
}

/// A plain step on every rank.
fn step<D: TestGroupDevice>(c: &Coordinator<Rank<D>>, step: usize) -> Vec<StepResult> {
    c.step(move |rank, r| call(r, rank, step, false, false, Fault::None))
        .expect("no rank panics")
}

/// Checks that every rank read the right values, and returns the outcomes.
fn values_ok(results: Vec<StepResult>, step: usize) -> Vec<Outcome> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            let (outcome, values) = r.unwrap_or_else(|e| panic!("rank {rank}, step {step}: {e}"));
            assert_eq!(values, expected(step, N), "rank {rank}, step {step}");
            outcome
        })
        .collect()
}

/// Checks every rank recorded.
fn assert_all_recorded(outcomes: &[Outcome]) {
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Recorded(_))),
        "{outcomes:?}"
    );
}

/// Checks every rank replayed.
fn assert_all_replayed(outcomes: &[Outcome]) {
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Replayed(_))),
        "{outcomes:?}"
    );
}

/// Takes (nearly) all of the device's free memory with raw allocations: halving chunks from
/// 1 GiB down to 2 MiB (the pool's mapping granularity), so what is left is too little for
/// graft's pool to map anything.
fn exhaust<D: TestGroupDevice>(dev: &D) -> Vec<DevicePtr> {
    let mut hog = Vec::new();
    let mut chunk = 1usize << 30;
    loop {
        match dev.queue().raw_alloc(chunk) {
            Ok(p) => hog.push(p),
            Err(_) if chunk > 2 << 20 => chunk /= 2,
            Err(_) => break,
        }
    }
    hog
}

fn free_all<D: TestGroupDevice>(r: &mut Rank<D>) {
    for p in r.hog.drain(..) {
        r.g.device().queue().raw_free(p).unwrap();
    }
}

/// (a) Warmup, record, replay on both ranks, with the same outcomes and the right values;
/// the recording is agreed once.
fn steps_record_and_replay<D: TestGroupDevice>() {
    let c = start::<D>(Config::default(), AGREEMENT);
    for s in 1..=10 {
        let outcomes = values_ok(step(&c, s), s);
        match s {
            1 => assert!(
                outcomes.iter().all(|o| *o == Outcome::Warmup),
                "{outcomes:?}"
            ),
            2 => assert_all_recorded(&outcomes),
            _ => assert_all_replayed(&outcomes),
        }
    }
    let stats = c.step(|_, r| r.g.stats()).unwrap();
    for s in stats {
        assert_eq!((s.agreements, s.recordings, s.replays), (1, 1, 8), "{s:?}");
        assert_eq!((s.warmups, s.fallbacks), (1, 0), "{s:?}");
    }
}
group_test!(steps_record_and_replay, steps_record_and_replay);

/// Rank `rank`'s input at `step` in new memory outside graft (freed by [`free_all`]), marked
/// in place: a framework's fresh token tensor.
fn fresh_input<D: TestGroupDevice>(r: &mut Rank<D>, rank: usize, step: usize) -> Buffer {
    let at = r.g.device().queue().raw_alloc(N * 4).unwrap();
    r.hog.push(at);
    let x = Buffer::external(r.g.device().id(), at, N * 4, None);
    x.mark_in_place();
    r.g.write_f32(&x, &x_of(rank, step, N)).unwrap();
    x
}

/// Every rank's stats, after its stream finished and its raw allocations were freed.
fn settle_and_count<D: TestGroupDevice>(c: &Coordinator<Rank<D>>) -> Vec<graft::Stats> {
    c.step(|_, r| {
        r.g.device().queue().synchronize().unwrap();
        free_all(r);
        r.g.stats()
    })
    .unwrap()
}

/// A step whose input is new memory on every call, used in place (a framework's fresh token
/// tensor): the graph holds the all-reduce (NCCL's kernel on CUDA, whose parameters graft
/// cannot read), so it cannot follow the input. The first move records once more with the
/// input copied into the graph, and every later step replays that recording, on every rank,
/// with the right values.
fn moved_inputs_of_a_collective_replay_after_one_recording<D: TestGroupDevice>() {
    let c = start::<D>(Config::default(), AGREEMENT);
    for s in 1..=10 {
        let results = c
            .step(move |rank, r| {
                let x = fresh_input(r, rank, s);
                let mut out = Vec::new();
                let outcome =
                    r.g.call_into(r.f, &[&x], &[], body::<D>(&r.comm, Fault::None), &mut out)?;
                Ok((outcome, r.g.read_f32(&out[0].buffer).unwrap()))
            })
            .expect("no rank panics");
        let outcomes = values_ok(results, s);
        match s {
            1 => assert!(
                outcomes.iter().all(|o| *o == Outcome::Warmup),
                "{outcomes:?}"
            ),
            2 | 3 => assert_all_recorded(&outcomes),
            _ => assert_all_replayed(&outcomes),
        }
    }
    let stats = settle_and_count(&c);
    for s in stats {
        assert_eq!((s.recordings, s.replays), (2, 7), "{s:?}");
        assert_eq!(s.rerecords.in_place_input_moved, 1, "{s:?}");
    }
}
group_test!(
    moved_inputs_of_a_collective,
    moved_inputs_of_a_collective_replay_after_one_recording
);

/// The same when the collective writes the moved input itself (an all-reduce in place, as a
/// rank sums its residual stream): once copied, the write is caught on the recording's first
/// launch and copied back inside the graph from then on, so every caller's buffer holds the
/// sum after its call, as eager execution leaves it.
fn moved_inputs_a_collective_writes_stay_eager<D: TestGroupDevice>() {
    let c = start::<D>(Config::default(), AGREEMENT);
    let mut replays = vec![0usize; WORLD];
    for s in 1..=10 {
        let results = c
            .step(move |rank, r| {
                let x = fresh_input(r, rank, s);
                let comm = &r.comm;
                let body = |ctx: &mut Ctx<'_, D>| {
                    let x = ctx.input(0).clone();
                    D::all_reduce(comm, &x, N)?;
                    let out = ctx.alloc(x.len())?;
                    ctx.queue().axpb_f32(&out, &x, A, B, N)?;
                    Ok(vec![Output::new(out, N as u32)])
                };
                let mut out = Vec::new();
                let outcome = r.g.call_into(r.f, &[&x], &[], body, &mut out)?;
                let sum = r.g.read_f32(&x).unwrap();
                Ok::<_, CallError>((outcome, sum, r.g.read_f32(&out[0].buffer).unwrap()))
            })
            .expect("no rank panics");
        let sum: Vec<f32> = (0..N)
            .map(|i| (0..WORLD).map(|r| x_of(r, s, N)[i]).sum())
            .collect();
        let want: Vec<f32> = sum.iter().map(|v| A.mul_add(*v, B)).collect();
        for (rank, result) in results.into_iter().enumerate() {
            let (outcome, x, out) = result.unwrap_or_else(|e| panic!("rank {rank}, step {s}: {e}"));
            assert_eq!(
                x, sum,
                "rank {rank}, step {s}: the caller's buffer ({outcome:?})"
            );
            assert_eq!(out, want, "rank {rank}, step {s}: the output ({outcome:?})");
            replays[rank] += usize::from(matches!(outcome, Outcome::Replayed(_)));
        }
    }
    let stats = settle_and_count(&c);
    // Recorded in place, then copied (its write caught, the node retired), then copied with
    // the copy back: three recordings, then replays.
    for (s, replays) in stats.into_iter().zip(replays) {
        assert_eq!((s.recordings, s.mutated_inputs), (3, 1), "{s:?}");
        assert_eq!(replays, 6, "{s:?}");
    }
}
group_test!(
    moved_inputs_a_collective_writes,
    moved_inputs_a_collective_writes_stay_eager
);

/// (b) Rank 1's capture fails: both ranks run the call eagerly, with the right values, and the
/// signature stays eager on both.
fn one_capture_failure_makes_every_rank_eager<D: TestGroupDevice>() {
    let c = start::<D>(Config::default(), AGREEMENT);
    values_ok(step(&c, 1), 1);
    let results = c
        .step(|rank, r| {
            let fault = if rank == 1 {
                Fault::SyncWhileRecording
            } else {
                Fault::None
            };
            call(r, rank, 2, false, false, fault)
        })
        .unwrap();
    let outcomes = values_ok(results, 2);
    assert!(
        matches!(
            &outcomes[..],
            [
                Outcome::Eager(EagerReason::PeerCaptureFailed { rank: 1 }),
                Outcome::Eager(EagerReason::CaptureFailed { .. })
            ]
        ),
        "{outcomes:?}"
    );
    let decisions = c
        .step(|_, r| {
            r.g.explain()
                .filter_map(|d| match &d.decision {
                    Decision::Eager(why) => Some(why.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
    assert_eq!(
        decisions[0],
        vec![EagerReason::PeerCaptureFailed { rank: 1 }]
    );
    assert!(
        matches!(&decisions[1][..], [EagerReason::CaptureFailed { .. }]),
        "{:?}",
        decisions[1]
    );
    for s in 3..=6 {
        let outcomes = values_ok(step(&c, s), s);
        assert!(
            outcomes.iter().all(|o| matches!(o, Outcome::Eager(_))),
            "step {s}: {outcomes:?}"
        );
    }
    let stats = c.step(|_, r| r.g.stats()).unwrap();
    assert_eq!(
        stats.iter().map(|s| s.capture_failures).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(
        stats
            .iter()
            .all(|s| s.agreements == 1 && s.recordings == 0 && s.fallbacks == 1)
    );
}
group_test!(
    one_capture_failure_makes_every_rank_eager,
    one_capture_failure_makes_every_rank_eager
);

/// (c) Rank 0 runs out of memory at its recording: it returns the pool's error, rank 1
/// `PeerFailed`, nobody waits; once memory is back, the next step records on both.
fn out_of_memory_on_one_rank_fails_every_rank<D: TestGroupDevice>() {
    let config = Config {
        warmups: 0,
        ..Config::default()
    };
    let c = start::<D>(config, AGREEMENT);
    let taken = c
        .step(|rank, r| {
            if rank == 0 {
                r.hog = exhaust(r.g.device());
            }
            r.hog.len()
        })
        .unwrap();
    assert!(taken[0] > 0 && taken[1] == 0, "{taken:?}");
    let started = Instant::now();
    let results = step(&c, 1);
    assert!(started.elapsed() < AGREEMENT, "{:?}", started.elapsed());
    let mut results = results.into_iter();
    let err0 = results.next().unwrap().unwrap_err();
    assert!(
        matches!(
            &err0,
            CallError::Pool { .. }
                | CallError::Body {
                    source: BodyError::Pool(_),
                    ..
                }
        ),
        "{err0}"
    );
    let err1 = results.next().unwrap().unwrap_err();
    assert!(
        matches!(err1, CallError::PeerFailed { rank: 0, .. }),
        "{err1}"
    );
    c.step(|_, r| free_all(r)).unwrap();
    let outcomes = values_ok(step(&c, 2), 2);
    assert_all_recorded(&outcomes);
    let outcomes = values_ok(step(&c, 3), 3);
    assert_all_replayed(&outcomes);
    let stats = c.step(|_, r| r.g.stats()).unwrap();
    assert!(
        stats.iter().all(|s| s.agreements == 2 && s.recordings == 1),
        "{stats:?}"
    );
}
group_test!(
    out_of_memory_on_one_rank_fails_every_rank,
    out_of_memory_on_one_rank_fails_every_rank
);

/// (d) A body panics on rank 0 while recording: the step reports the panic, rank 1 returns
/// `PeerFailed` at once (not after the agreement timeout), and the next step records on both.
fn a_panic_while_recording_fails_the_peers_at_once<D: TestGroupDevice>() {
    let agreement = Duration::from_secs(10);
    let c = start::<D>(Config::default(), agreement);
    values_ok(step(&c, 1), 1);
    // The step returns only the panic: rank 1's result comes back through here.
    let peer: Arc<Mutex<Option<StepResult>>> = Arc::default();
    let slot = peer.clone();
    let started = Instant::now();
    let err = c
        .step(move |rank, r| {
            let fault = if rank == 0 {
                Fault::PanicWhileRecording
            } else {
                Fault::None
            };
            let result = call(r, rank, 2, false, false, fault);
            *slot.lock().unwrap() = Some(result);
        })
        .unwrap_err();
    let took = started.elapsed();
    let result = peer.lock().unwrap().take().expect("rank 1 returned");
    assert!(
        matches!(result, Err(CallError::PeerFailed { rank: 0, .. })),
        "rank 1: {result:?}"
    );
    assert!(
        matches!(&err, StepError::Panicked { rank: 0, message } if message.contains("injected panic")),
        "{err}"
    );
    assert!(took < agreement / 4, "the step took {took:?}");
    let outcomes = values_ok(step(&c, 3), 3);
    assert_all_recorded(&outcomes);
    let outcomes = values_ok(step(&c, 4), 4);
    assert_all_replayed(&outcomes);
}
group_test!(
    a_panic_while_recording_fails_the_peers_at_once,
    a_panic_while_recording_fails_the_peers_at_once
);

/// (e) Rank 1 skips the recording call: rank 0 times out after the agreement timeout, and
/// the group is broken: every later recording fails at once on both ranks.
fn a_rank_that_skips_a_call_times_out_its_peer<D: TestGroupDevice>() {
    let c = start::<D>(Config::default(), AGREEMENT);
    values_ok(step(&c, 1), 1);
    let started = Instant::now();
    let results = c
        .step(|rank, r| (rank == 0).then(|| call(r, rank, 2, false, false, Fault::None)))
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= AGREEMENT && took < AGREEMENT * 3,
        "the step took {took:?}"
    );
    let err = results[0].as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Group {
                source: GroupError::Timeout {
                    rank: 0,
                    missing,
                    ..
                },
                ..
            } if missing == &[1]
        ),
        "{err}"
    );
    let started = Instant::now();
    let results = step(&c, 3);
    assert!(started.elapsed() < AGREEMENT / 2, "{:?}", started.elapsed());
    for (rank, r) in results.iter().enumerate() {
        let err = r.as_ref().unwrap_err();
        assert!(
            matches!(
                err,
                CallError::Group {
                    source: GroupError::Broken { rank: r, cause },
                    ..
                } if *r == rank && matches!(**cause, GroupError::Timeout { rank: 0, .. })
            ),
            "rank {rank}: {err}"
        );
    }
    assert!(
        c.step(|_, r| r.g.member().unwrap().is_broken())
            .unwrap()
            .iter()
            .all(|b| *b)
    );
}
sim_group_test!(
    a_rank_that_skips_a_call_times_out_its_peer,
    a_rank_that_skips_a_call_times_out_its_peer
);

/// (f) The ranks record different functions: both get `Diverged`, nothing runs, and the group
/// still works when they call alike again.
fn ranks_recording_different_functions_diverge<D: TestGroupDevice>() {
    let config = Config {
        warmups: 0,
        ..Config::default()
    };
    let c = start::<D>(config, AGREEMENT);
    let started = Instant::now();
    let results = c
        .step(|rank, r| call(r, rank, 1, rank == 1, false, Fault::None))
        .unwrap();
    assert!(started.elapsed() < AGREEMENT, "{:?}", started.elapsed());
    for (rank, r) in results.iter().enumerate() {
        let err = r.as_ref().unwrap_err();
        assert!(
            matches!(
                err,
                CallError::Group {
                    source: GroupError::Diverged {
                        rank: 0,
                        function: 0,
                        other: 1,
                        other_function: 1,
                        ..
                    },
                    ..
                }
            ),
            "rank {rank}: {err}"
        );
    }
    let outcomes = values_ok(step(&c, 2), 2);
    assert_all_recorded(&outcomes);
}
group_test!(
    ranks_recording_different_functions_diverge,
    ranks_recording_different_functions_diverge
);

/// (f') The ranks record one function with inputs of different lengths: both get `Diverged`
/// before anything runs.
fn ranks_recording_different_lengths_diverge<D: TestGroupDevice>() {
    let config = Config {
        warmups: 0,
        ..Config::default()
    };
    let c = start::<D>(config, AGREEMENT);
    let results = c
        .step(|rank, r| call(r, rank, 1, false, rank == 1, Fault::None))
        .unwrap();
    for (rank, r) in results.iter().enumerate() {
        let err = r.as_ref().map(|(o, _)| o).unwrap_err();
        assert!(
            matches!(
                err,
                CallError::Group {
                    source: GroupError::Diverged { .. },
                    ..
                }
            ),
            "rank {rank}: {err}"
        );
    }
}
group_test!(
    ranks_recording_different_lengths_diverge,
    ranks_recording_different_lengths_diverge
);
