//! Work on two streams in one body (`Ctx::fork`): one node, the same results eager, recorded
//! and replayed, liveness across streams, frees held until the join, the unjoined capture,
//! the refused nestings and an exact rollback, on the simulator and (ignored in CI) on CUDA.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use graft::backend::CoreOnly;
use graft::{
    BodyError, Buffer, BufferError, CallError, CaptureMode, CaptureViolation, Ctx, DeviceError,
    DeviceOp, DevicePtr, ForkRule, FunctionSpec, Outcome, Output,
};

/// out = (2x on the side stream) + (3x + 1 on the runtime stream), joined; `a` is the side
/// stream's buffer, returned as a second output.
fn forked<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let (a, b, out) = (
            ctx.alloc(x.len())?,
            ctx.alloc(x.len())?,
            ctx.alloc(x.len())?,
        );
        ctx.fork(
            |side: &D::Queue| Ok::<(), BodyError>(side.axpb_f32(&a, &x, 2.0, 0.0, n)?),
            |ctx: &mut Ctx<'_, D>| Ok(ctx.queue().axpb_f32(&b, &x, 3.0, 1.0, n)?),
        )?;
        ctx.queue().add_f32(&out, &a, &b, n)?;
        Ok(vec![Output::new(out, 0), Output::new(a, 1)])
    })
}

// (a) The same results warming up, recording and replaying, in one node.
fn a_forked_body_is_one_node_with_eager_results<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("forked", FunctionSpec::default());
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for v in [1.0f32, 2.0, 3.0, 4.0] {
        let x = input(&mut g, &[v, -v, 0.5 * v]);
        let mut out = Vec::new();
        outcomes.push(g.call_into(f, &[&x], &[], forked(&runs), &mut out).unwrap());
        let want: Vec<f32> = [v, -v, 0.5 * v].iter().map(|x| 5.0 * x + 1.0).collect();
        assert_eq!(read(&g, &out[0].buffer), want);
    }
    assert!(
        matches!(
            outcomes[..],
            [
                Outcome::Warmup,
                Outcome::Recorded(_),
                Outcome::Replayed(_),
                Outcome::Replayed(_)
            ]
        ),
        "{outcomes:?}"
    );
    assert_eq!(runs.get(), 2, "replays do not run the body");
    assert_eq!(g.stats().nodes, 1, "a forked recording is one node");
}
device_test!(
    streams_01_a_forked_body_is_one_node_with_eager_results,
    a_forked_body_is_one_node_with_eager_results
);

// (b) An output written on the side stream is invalidated by a replay that overwrites it.
fn a_held_side_output_is_invalidated_by_a_replay<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("forked", FunctionSpec::default());
    let runs = Runs::default();
    let x = input(&mut g, &[1.0, 2.0]);
    let mut held: Vec<Buffer> = Vec::new();
    for _ in 0..4 {
        let out = g.call(f, &[&x], &[], forked(&runs)).unwrap();
        held.push(out[1].buffer.clone());
    }
    // Calls 3 and 4 replay the same graph: call 4 wrote call 3's side output again.
    let err = g.read_f32(&held[2]).unwrap_err();
    assert!(
        matches!(
            err,
            graft::MemoryError::Buffer(BufferError::Overwritten { .. })
        ),
        "{err}"
    );
    assert_eq!(g.read_f32(&held[3]).unwrap(), vec![2.0, 4.0]);
}
device_test!(
    streams_02_a_held_side_output_is_invalidated_by_a_replay,
    a_held_side_output_is_invalidated_by_a_replay
);

// (c) A buffer dropped inside the fork is not handed out before the join.
fn a_buffer_freed_in_a_fork_is_not_reused_before_the_join<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("reuse", FunctionSpec::default());
    let seen: Arc<Mutex<Vec<(DevicePtr, DevicePtr, DevicePtr)>>> = Arc::default();
    let body = |seen: Arc<Mutex<Vec<(DevicePtr, DevicePtr, DevicePtr)>>>| -> Body<'static, D> {
        Box::new(move |ctx: &mut Ctx<'_, D>| {
            let x = ctx.input(0).clone();
            let n = x.len() / 4;
            let t = ctx.alloc(x.len())?;
            let freed = t.addr()?;
            let out = ctx.alloc(x.len())?;
            let y = x.clone();
            let (_, inside) = ctx.fork(
                move |side: &D::Queue| {
                    side.axpb_f32(&t, &y, 2.0, 0.0, n)?;
                    drop(t); // freed while the side stream may still write it
                    Ok::<(), BodyError>(())
                },
                |ctx: &mut Ctx<'_, D>| {
                    let u = ctx.alloc(x.len())?;
                    ctx.queue().fill_f32(&u, n, 7.0)?;
                    ctx.queue().add_f32(&out, &u, &u, n)?;
                    Ok(u.addr()?)
                },
            )?;
            let after = ctx.alloc(x.len())?;
            seen.lock().unwrap().push((freed, inside, after.addr()?));
            Ok(vec![Output::new(out, 0)])
        })
    };
    let x = input(&mut g, &[1.0; 128]);
    for _ in 0..3 {
        let out = g.call(f, &[&x], &[], body(seen.clone())).unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![14.0; 128]);
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "warmup and recording ran the body");
    for &(freed, inside, after) in seen.iter() {
        assert_ne!(
            freed, inside,
            "the block freed in the fork was reused inside it"
        );
        assert_eq!(freed, after, "after the join the freed block is free again");
    }
}
device_test!(
    streams_03_a_buffer_freed_in_a_fork_is_not_reused_before_the_join,
    a_buffer_freed_in_a_fork_is_not_reused_before_the_join
);

// (d) A raw capture left unjoined fails with `Unjoined`; the device works afterwards, and an
// abort closes an open fork.
fn an_unjoined_capture_fails_and_the_device_recovers<D: TestDevice>(dev: D) {
    let core = CoreOnly::for_tests_and_benches();
    let mut g = graft(dev.clone(), unguarded());
    let x = input(&mut g, &[1.0; 8]);
    let side = dev.side_queue().expect("the device has a side stream");
    dev.begin_capture(&core, CaptureMode::ThreadLocal).unwrap();
    dev.fork(&core).unwrap();
    side.fill_f32(&x, 8, 3.0).unwrap();
    let Err(err) = dev.end_capture(&core) else {
        panic!("an unjoined capture ended");
    };
    assert!(
        matches!(
            err,
            DeviceError::Capture {
                violation: CaptureViolation::Unjoined,
                ..
            }
        ),
        "{err}"
    );
    dev.begin_capture(&core, CaptureMode::ThreadLocal).unwrap();
    dev.fork(&core).unwrap();
    side.fill_f32(&x, 8, 4.0).unwrap();
    dev.abort_capture(&core).unwrap();
    dev.synchronize().unwrap();
    dev.queue().fill_f32(&x, 8, 5.0).unwrap();
    assert_eq!(read(&g, &x), vec![5.0; 8]);
    // Forks work eagerly again.
    dev.fork(&core).unwrap();
    side.fill_f32(&x, 8, 6.0).unwrap();
    dev.join(&core).unwrap();
    assert_eq!(read(&g, &x), vec![6.0; 8]);
}
device_test!(
    streams_04_an_unjoined_capture_fails_and_the_device_recovers,
    an_unjoined_capture_fails_and_the_device_recovers
);

fn fork_rule<T: std::fmt::Debug>(result: Result<T, CallError>) -> ForkRule {
    match result {
        Err(CallError::Body {
            source: BodyError::Device(DeviceError::Fork { rule, .. }),
            ..
        }) => rule,
        other => panic!("expected a refused fork, got {other:?}"),
    }
}

// (e) A fork inside a fork, and a fork inside a conditional body, are refused with typed
// errors; the device is usable afterwards.
fn nested_forks_and_forks_in_conditionals_are_refused<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("nested", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let nested = Box::new(|ctx: &mut Ctx<'_, D>| {
        ctx.fork(
            |_: &D::Queue| Ok::<(), BodyError>(()),
            |ctx: &mut Ctx<'_, D>| ctx.fork(|_: &D::Queue| Ok(()), |_: &mut Ctx<'_, D>| Ok(())),
        )?;
        Ok(Vec::new())
    }) as Body<'static, D>;
    assert_eq!(fork_rule(g.call(f, &[&x], &[], nested)), ForkRule::Nested);
    let h = g.register("in_conditional", FunctionSpec::default());
    let flag = input(&mut g, &[1.0]);
    let in_conditional = Box::new(|ctx: &mut Ctx<'_, D>| {
        let flag = ctx.input(1).clone();
        ctx.if_then(&flag, |ctx: &mut Ctx<'_, D>| {
            ctx.fork(|_: &D::Queue| Ok(()), |_: &mut Ctx<'_, D>| Ok(()))?;
            Ok::<(), BodyError>(())
        })?;
        Ok(Vec::new())
    }) as Body<'static, D>;
    assert_eq!(
        fork_rule(g.call(h, &[&x, &flag], &[], in_conditional)),
        ForkRule::InConditional
    );
    let runs = Runs::default();
    let out = g.call(f, &[&x], &[], forked(&runs)).unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![6.0; 4]);
}
device_test!(
    streams_05_nested_forks_and_forks_in_conditionals_are_refused,
    nested_forks_and_forks_in_conditionals_are_refused
);

// (f) A recording that fails inside a fork rolls the pool back exactly.
fn a_failed_forked_recording_rolls_the_pool_back<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("fails", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 64]);
    let body = || -> Body<'static, D> {
        Box::new(|ctx: &mut Ctx<'_, D>| {
            let x = ctx.input(0).clone();
            let n = x.len() / 4;
            let a = ctx.alloc(x.len())?;
            let out = ctx.alloc(x.len())?;
            let recording = ctx.kind() == graft::RunKind::Recording;
            ctx.fork(
                move |side: &D::Queue| {
                    side.axpb_f32(&a, &x, 1.0, 0.0, n)?;
                    drop(a);
                    Ok::<(), BodyError>(())
                },
                |ctx: &mut Ctx<'_, D>| {
                    let t = ctx.alloc(4096)?;
                    ctx.queue().fill_f32(&t, 4, 1.0)?;
                    if recording {
                        return Err(BodyError::Device(DeviceError::InvalidArgument {
                            op: DeviceOp::KernelLaunch,
                            what: "a failure inside the fork, on purpose",
                        }));
                    }
                    Ok(())
                },
            )?;
            ctx.queue().fill_f32(&out, n, 2.0)?;
            Ok(vec![Output::new(out, 0)])
        })
    };
    let warm = g.call(f, &[&x], &[], body()).unwrap();
    drop(warm);
    let before = g.memory_report();
    let err = g.call(f, &[&x], &[], body()).unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Body {
                source: BodyError::Device(DeviceError::InvalidArgument { .. }),
                ..
            }
        ),
        "{err}"
    );
    let after = g.memory_report();
    assert_eq!(before.allocated, after.allocated);
    assert_eq!(before.live_blocks, after.live_blocks);
    assert_eq!(before.free_blocks, after.free_blocks);
    assert_eq!(g.stats().nodes, 0);
}
device_test!(
    streams_06_a_failed_forked_recording_rolls_the_pool_back,
    a_failed_forked_recording_rolls_the_pool_back
);

// The simulator catches the race a reused block would cause: both streams writing one
// buffer between the fork and the join.
#[test]
fn streams_07_the_simulator_reports_a_race_between_the_streams() {
    let dev = common::sim();
    let mut g = graft(dev, unguarded());
    let f = g.register("race", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let racy = || -> Body<'static, graft::sim::SimDevice> {
        Box::new(|ctx: &mut Ctx<'_, graft::sim::SimDevice>| {
            let x = ctx.input(0).clone();
            let t = ctx.alloc(16)?;
            let u = t.clone();
            ctx.fork(
                move |side: &graft::sim::SimQueue| Ok::<(), BodyError>(side.fill_f32(&u, 4, 1.0)?),
                |ctx: &mut Ctx<'_, graft::sim::SimDevice>| {
                    Ok(ctx.queue().add_f32(&t, &x, &x, 4)?)
                },
            )?;
            Ok(Vec::new())
        })
    };
    let err = g.call(f, &[&x], &[], racy()).unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Body {
                source: BodyError::Device(DeviceError::StreamRace { .. }),
                ..
            }
        ),
        "{err}"
    );
}
