//! Promises under misuse: bodies that write their inputs, bodies that panic, buffers of another
//! runtime, a runtime called inside another's recording, buffers outliving their runtime.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::*;
use graft::{
    BodyError, BufferError, CallError, Config, Ctx, Decision, EagerReason, EvictReason,
    FunctionSpec, InputKind, Outcome, Output, Phase, RunKind,
};

/// `x += 1` on input 0 in place, and out = 2x: a step counter kept in the caller's buffer.
fn count_up<D: TestDevice>(ctx: &mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> {
    let x = ctx.input(0).clone();
    let n = x.len() / 4;
    ctx.queue().axpb_f32(&x, &x, 1.0, 1.0, n)?;
    let out = ctx.alloc(x.len())?;
    ctx.queue().axpb_f32(&out, &x, 2.0, 0.0, n)?;
    Ok(vec![Output::new(out, 0)])
}

fn written_input_matches_eager<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("count", FunctionSpec::default());
    let counter = input(&mut g, &[0.0; 4]);
    let steps = graft_testkit::steps(100, 6);
    for step in 1..=steps {
        let out = g.call(f, &[&counter], &[], count_up).unwrap();
        let want = step as f32;
        assert_eq!(
            read(&g, &counter),
            vec![want; 4],
            "counter after call {step}"
        );
        assert_eq!(
            read(&g, &out[0].buffer),
            vec![2.0 * want; 4],
            "output of call {step}"
        );
    }
    let s = g.stats();
    assert_eq!(s.mutated_inputs, 1, "detected once");
    assert!(s.replays >= steps as u64 - 5, "{s:?}");
    let logged = g
        .explain()
        .filter(|d| d.decision == Decision::InputMutated { position: 0 })
        .count();
    assert_eq!(logged, 1);
}
device_test!(written_input_matches_eager, written_input_matches_eager);

/// A recording that finds its body writes an input is retired: it is freed at once (no graph
/// kept, nothing counted against the budget) while the call's outputs stay valid, and the next
/// call records the graph that copies the input back without evicting anything for room.
fn retired_recording_is_freed_at_once<D: TestDevice>(dev: D) {
    let config = Config {
        max_graphs: Some(1),
        ..Config::default()
    };
    let mut g = graft(dev, config);
    let f = g.register("count", FunctionSpec::default());
    let counter = input(&mut g, &[0.0; 4]);
    g.call(f, &[&counter], &[], count_up).unwrap();
    let mut out = Vec::new();
    let outcome = g
        .call_into(f, &[&counter], &[], count_up, &mut out)
        .unwrap();
    assert!(matches!(outcome, Outcome::Recorded(_)), "{outcome:?}");
    assert_eq!(g.stats().mutated_inputs, 1);
    assert_eq!(g.node_ids(), Vec::new(), "the retired node is gone");
    assert_eq!(g.stats().nodes, 0);
    assert_eq!(read(&g, &counter), vec![2.0; 4]);
    assert_eq!(read(&g, &out[0].buffer), vec![4.0; 4], "this call's output");
    let next = g.call(f, &[&counter], &[], count_up).unwrap();
    assert_eq!(g.stats().nodes, 1);
    assert_eq!(read(&g, &out[0].buffer), vec![4.0; 4], "still valid");
    assert_eq!(read(&g, &next[0].buffer), vec![6.0; 4]);
    let budget_evictions = g
        .explain()
        .filter(|d| {
            matches!(
                d.decision,
                Decision::Evict {
                    why: EvictReason::Budget { .. },
                    ..
                }
            )
        })
        .count();
    assert_eq!(budget_evictions, 0, "the budget never had to make room");
    for step in 4..=10 {
        let out = g.call(f, &[&counter], &[], count_up).unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![2.0 * step as f32; 4]);
    }
    assert!(g.stats().replays >= 7, "{:?}", g.stats());
}
device_test!(
    retired_recording_is_freed_at_once,
    retired_recording_is_freed_at_once
);

/// The same counter when the caller's buffer moves between two addresses every step: the copy
/// back follows the caller's buffer.
fn written_input_follows_a_moving_buffer<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("count", FunctionSpec::default());
    let counters = [input(&mut g, &[0.0; 4]), input(&mut g, &[10.0; 4])];
    let mut want = [0.0f32, 10.0];
    for step in 0..graft_testkit::steps(40, 6) {
        let i = step % 2;
        g.call(f, &[&counters[i]], &[], count_up).unwrap();
        want[i] += 1.0;
        assert_eq!(read(&g, &counters[0]), vec![want[0]; 4], "step {step}");
        assert_eq!(read(&g, &counters[1]), vec![want[1]; 4], "step {step}");
    }
    assert!(g.stats().copy_sources_updated > 0);
}
device_test!(
    written_input_follows_a_moving_buffer,
    written_input_follows_a_moving_buffer
);

/// A step of two calls: a root that reads its input, then one of two branches (by key); only
/// branch 0 writes its input. Every buffer equals what eager execution gives.
fn input_written_on_one_branch<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let root = g.register("root", FunctionSpec::default());
    let branch = g.register("branch", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let counter = input(&mut g, &[0.0; 4]);
    let runs = Runs::default();
    let mut want = 0.0f32;
    let steps = graft_testkit::steps(60, 8) as u64;
    for step in 0..steps {
        let key = step % 2;
        let h = g.call(root, &[&x], &[], affine(3.0, 0.0, &runs)).unwrap();
        let out = g
            .call(
                branch,
                &[&counter, &h[0].buffer],
                &[key],
                |ctx: &mut Ctx<'_, D>| {
                    let c = ctx.input(0).clone();
                    let h = ctx.input(1).clone();
                    let n = c.len() / 4;
                    if key == 0 {
                        ctx.queue().axpb_f32(&c, &c, 1.0, 1.0, n)?;
                    }
                    let out = ctx.alloc(c.len())?;
                    ctx.queue().add_f32(&out, &c, &h, n)?;
                    Ok(vec![Output::new(out, 0)])
                },
            )
            .unwrap();
        if key == 0 {
            want += 1.0;
        }
        assert_eq!(read(&g, &counter), vec![want; 4], "step {step}");
        assert_eq!(read(&g, &out[0].buffer), vec![want + 3.0; 4], "step {step}");
    }
    assert_eq!(g.stats().mutated_inputs, 1);
    assert!(g.stats().replays > (2 * steps).saturating_sub(20));
}
device_test!(input_written_on_one_branch, input_written_on_one_branch);

/// Calls `f` expecting it to panic.
fn expect_panic(f: impl FnOnce()) {
    assert!(
        catch_unwind(AssertUnwindSafe(f)).is_err(),
        "the body should have panicked"
    );
}

fn panics_leave_graft_as_it_was<D: TestDevice>(dev: D) {
    for at in [RunKind::Warmup, RunKind::Recording, RunKind::Eager] {
        let config = Config {
            // Verify mode re-runs the body eagerly after each replay: the third kind of run.
            verify_replays: at == RunKind::Eager,
            ..Config::default()
        };
        let mut g = graft(dev.clone(), config);
        let f = g.register("f", FunctionSpec::default());
        let x = input(&mut g, &[2.0; 8]);
        let runs = Runs::default();
        let mut good = affine::<D>(3.0, 1.0, &runs);
        let mut call = |g: &mut G<D>, panic_at: Option<RunKind>| {
            g.call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
                let _scratch = ctx.alloc(4096)?;
                if Some(ctx.kind()) == panic_at {
                    panic!("body panics on purpose");
                }
                good(ctx)
            })
        };
        // Reach the run kind that panics.
        let before = match at {
            RunKind::Warmup => 0,
            RunKind::Recording => 1,
            RunKind::Eager => 2,
        };
        for _ in 0..before {
            call(&mut g, None).unwrap();
        }
        let nodes = g.stats().nodes;
        expect_panic(|| drop(call(&mut g, Some(at))));
        // (A call may start a new generation before it runs the body: the phase can be Idle.)
        assert!(
            !matches!(g.phase(), Phase::Recording { .. }),
            "panic at {at:?} left a capture open"
        );
        assert_eq!(g.stats().nodes, nodes, "panic at {at:?} left a node");
        // The next calls work and are correct.
        for _ in 0..3 {
            let out = call(&mut g, None).unwrap();
            assert_eq!(
                read(&g, &out[0].buffer),
                vec![7.0; 8],
                "after a panic at {at:?}"
            );
        }
        g.reset().unwrap();
        let out = call(&mut g, None).unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![7.0; 8]);
    }
}
device_test!(panics_leave_graft_as_it_was, panics_leave_graft_as_it_was);

/// A panic during a recording rolls the pool back: nothing it allocated stays allocated.
fn panic_while_recording_rolls_the_pool_back<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    drop(g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap());
    let live = g.stats().pool.live_blocks;
    expect_panic(|| {
        let _ = g.call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
            let _a = ctx.alloc(1 << 20)?;
            let _b = ctx.alloc(3 << 20)?;
            panic!("body panics on purpose");
        });
    });
    assert_eq!(g.stats().pool.live_blocks, live);
    let out = g.call(f, &[&x], &[], affine(5.0, 0.0, &runs)).unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![5.0; 4]);
    assert_eq!(g.stats().recordings, 1);
}
device_test!(
    panic_while_recording_rolls_the_pool_back,
    panic_while_recording_rolls_the_pool_back
);

/// An output of another runtime on the same device is a copied input, never a managed one,
/// even when its node id and generation match a node on this runtime's path.
fn buffer_of_another_runtime_is_copied<D: TestDevice>(dev: D) {
    let mut mine = graft(dev.clone(), Config::default());
    let mut theirs = graft(dev, Config::default());
    let root = mine.register("root", FunctionSpec::default());
    let use_it = mine.register("use", FunctionSpec::default());
    let make = theirs.register("make", FunctionSpec::default());
    let x = input(&mut mine, &[1.0; 4]);
    let y = input(&mut theirs, &[2.0; 4]);
    let runs = Runs::default();
    for step in 0..6 {
        // Same step count on both, so generations and node ids line up.
        let foreign = theirs
            .call(make, &[&y], &[], affine(1.0, 1.0, &runs))
            .unwrap();
        let h = mine
            .call(root, &[&x], &[], affine(1.0, 0.0, &runs))
            .unwrap();
        let out = mine
            .call(use_it, &[&h[0].buffer, &foreign[0].buffer], &[], add(&runs))
            .unwrap();
        assert_eq!(read(&mine, &out[0].buffer), vec![4.0; 4], "step {step}");
    }
    let node = mine
        .nodes()
        .into_iter()
        .find(|n| n.function == use_it)
        .expect("the second function was recorded");
    assert_eq!(node.inputs, vec![InputKind::Managed, InputKind::Copied]);
}
device_test!(
    buffer_of_another_runtime_is_copied,
    buffer_of_another_runtime_is_copied
);

/// A runtime called from inside another runtime's recording cannot begin its own capture: it
/// falls back to eager with a typed reason, and its work becomes part of the outer graph.
fn call_inside_another_recording_falls_back<D: TestDevice>(dev: D) {
    let mut outer = graft(dev.clone(), Config::default());
    let mut inner = graft(dev, Config::default());
    let f = outer.register("outer", FunctionSpec::default());
    let h = inner.register("inner", FunctionSpec::default());
    let x = input(&mut outer, &[1.0; 4]);
    let runs = Runs::default();
    for step in 0..5 {
        let out = outer
            .call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
                let x = ctx.input(0).clone();
                let y = inner
                    .call(h, &[&x], &[], affine(2.0, 0.0, &runs))
                    .map_err(|e| -> BodyError { BodyError::Framework(Box::new(e)) })?;
                let out = ctx.alloc(x.len())?;
                ctx.queue().axpb_f32(&out, &y[0].buffer, 1.0, 1.0, 4)?;
                Ok(vec![Output::new(out, 0)])
            })
            .unwrap();
        assert_eq!(read(&outer, &out[0].buffer), vec![3.0; 4], "step {step}");
    }
    assert!(outer.stats().replays >= 3);
    assert!(
        inner.explain().any(|d| matches!(
            d.decision,
            Decision::Eager(EagerReason::BeginCaptureFailed { .. })
        )),
        "the inner runtime explains its fallback"
    );
}
device_test!(
    call_inside_another_recording_falls_back,
    call_inside_another_recording_falls_back
);

/// Buffers outliving their runtime name the drop, whichever pool they came from.
fn buffers_outliving_the_runtime_name_the_drop<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let kept = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut last = Vec::new();
    for _ in 0..3 {
        last = g.call(f, &[&kept], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    drop(g);
    for b in [&kept, &last[0].buffer] {
        let err = b.addr().unwrap_err();
        assert!(matches!(err, BufferError::Dropped { .. }), "{err}");
        assert!(err.to_string().contains("dropped"), "{err}");
    }
}
device_test!(
    buffers_outliving_the_runtime_name_the_drop,
    buffers_outliving_the_runtime_name_the_drop
);

/// An error in the body during a recording still leaves the runtime usable (the pre-existing
/// rule, kept next to the panic tests that extend it).
fn outcome_after_recovery_is_replay<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    expect_panic(|| {
        let _ = g.call(
            f,
            &[&x],
            &[],
            |_: &mut Ctx<'_, D>| -> Result<_, BodyError> { panic!("first call panics") },
        );
    });
    let mut out = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        outcomes.push(
            g.call_into(f, &[&x], &[], affine(1.0, 0.0, &runs), &mut out)
                .unwrap(),
        );
    }
    assert!(matches!(
        outcomes[..],
        [Outcome::Warmup, Outcome::Recorded(_), Outcome::Replayed(_)]
    ));
    assert!(matches!(g.phase(), Phase::Replaying { .. }));
    assert!(!matches!(
        g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)),
        Err(CallError::State { .. })
    ));
}
device_test!(
    outcome_after_recovery_is_replay,
    outcome_after_recovery_is_replay
);

/// A recording that runs out of device memory while idle memory sits in the eager pool
/// releases it and records on the second try (releasing is illegal during the capture itself).
#[test]
fn recording_out_of_memory_releases_idle_memory_and_retries() {
    let dev = graft::sim::SimDevice::with_memory_limit(16 << 20);
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default().warmups(0));
    let x = input(&mut g, &[1.0; 4]);
    drop(g.alloc(12 << 20).unwrap()); // the eager pool keeps its 12 MiB mapped, idle
    let out = g
        .call(f, &[&x], &[], |ctx: &mut Ctx<'_, graft::sim::SimDevice>| {
            let scratch = ctx.alloc(8 << 20)?;
            let out = ctx.alloc(16)?;
            ctx.queue().fill_f32(&scratch, 4, 2.0)?;
            ctx.queue().add_f32(&out, &scratch, ctx.input(0), 4)?;
            Ok(vec![Output::new(out, 0)])
        })
        .unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![3.0; 4]);
    assert_eq!(g.stats().recordings, 1);
    assert!(
        g.stats().eager_pool.mapped < 12 << 20,
        "{:?}",
        g.stats().eager_pool
    );
}

/// A guard's capture that differs from its recording (a scalar changed) and then cannot be
/// instantiated: the call fails with the device's error (its kernels never ran, so there is
/// no result to hand back), the recording that holds the old value never replays again, and
/// every later call runs eagerly with the right values.
#[test]
fn a_differing_guard_capture_that_cannot_be_instantiated_fails_the_call() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    let dev = sim();
    let mut g = graft(dev.clone(), Config::default());
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0, 3.0, 4.0]);
    let scale = Arc::new(AtomicU32::new(1.0f32.to_bits()));
    let mut body = scaled::<graft::sim::SimDevice>(&scale, &Runs::default());
    let mut out = Vec::new();
    for _ in 0..2 {
        g.call_into(f, &[&x], &[], &mut body, &mut out).unwrap();
    }
    // Call 2 is the first guard: the scale changed, and the capture cannot be instantiated.
    scale.store(3.0f32.to_bits(), Ordering::Relaxed);
    dev.fail_next_instantiate();
    let e = g.call_into(f, &[&x], &[], &mut body, &mut out).unwrap_err();
    assert!(matches!(e, CallError::Device { .. }), "{e}");
    for _ in 0..3 {
        let o = g.call_into(f, &[&x], &[], &mut body, &mut out).unwrap();
        assert!(
            matches!(o, Outcome::Eager(EagerReason::HostValueBaked { .. })),
            "{o:?}"
        );
        assert_eq!(
            read(&g, &out[0].buffer),
            host_affine(&[1.0, 2.0, 3.0, 4.0], 3.0, 1.0)
        );
    }
}
