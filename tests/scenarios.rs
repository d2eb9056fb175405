//! The scenarios graft promises to handle (a tree, divergence, liveness, feedback loops, copies,
//! fallbacks, ...), each a named test whose body runs on every backend.

mod common;

use common::*;
use graft::{
    BodyError, BufferError, CallError, CaptureViolation, Config, Ctx, Decision, DeviceOp,
    EagerReason, FunctionSpec, MemoryError, Mode, Outcome, Output, RecordReason,
};

fn ctx_alloc<D: TestDevice>(ctx: &mut Ctx<'_, D>, n: usize) -> Result<graft::Buffer, BodyError> {
    Ok(ctx.alloc(n * 4)?)
}

// 1. First call warms up, second records, third replays.
fn first_warmup_then_record_then_replay<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0, 3.0, 4.0]);
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(f, &[&x], &[], affine(2.0, 1.0, &runs), &mut out)
                .unwrap(),
        );
        assert_eq!(read(&g, &out[0].buffer), vec![3.0, 5.0, 7.0, 9.0]);
        assert_eq!(out[0].meta, 4);
    }
    assert!(
        matches!(outcomes[..], [Outcome::Warmup, Outcome::Recorded(a), Outcome::Replayed(b)] if a == b)
    );
    assert_eq!(runs.get(), 2);
    let s = g.stats();
    assert_eq!((s.nodes, s.warmups, s.recordings, s.replays), (1, 1, 1, 1));
}
device_test!(
    scenario_01_first_warmup_then_record_then_replay,
    first_warmup_then_record_then_replay
);

// 2. One function, two input sizes: two root nodes.
fn two_sizes_two_roots<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("f", FunctionSpec::default());
    let small = input(&mut g, &[1.0; 4]);
    let large = input(&mut g, &[1.0; 8]);
    let runs = Runs::default();
    let mut seen = Vec::new();
    for x in [
        &small, &small, &small, &large, &large, &large, &small, &large,
    ] {
        let out = g.call(f, &[x], &[], affine(1.0, 1.0, &runs)).unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![2.0; x.len() / 4]);
        seen.push(out[0].meta);
    }
    let s = g.stats();
    assert_eq!((s.nodes, s.warmups, s.recordings, s.replays), (2, 2, 2, 4));
    assert!(
        g.node_ids().iter().all(|n| g.node_parent(*n).is_none()),
        "both nodes are roots"
    );
    assert_eq!(runs.get(), 4);
}
device_test!(scenario_02_two_sizes_two_roots, two_sizes_two_roots);

/// Runs f1, then f2 or f3, then f4, each out = a*in + b, checking values.
fn branch_step<D: TestDevice>(
    g: &mut G<D>,
    fs: &[graft::FunctionId; 4],
    x: &graft::Buffer,
    left: bool,
    runs: &Runs,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut out = Vec::new();
    outcomes.push(
        g.call_into(fs[0], &[x], &[], affine(2.0, 0.0, runs), &mut out)
            .unwrap(),
    );
    let y = out.pop().unwrap().buffer;
    let (mid, a) = if left { (fs[1], 3.0) } else { (fs[2], 5.0) };
    outcomes.push(
        g.call_into(mid, &[&y], &[], affine(a, 0.0, runs), &mut out)
            .unwrap(),
    );
    let z = out.pop().unwrap().buffer;
    outcomes.push(
        g.call_into(fs[3], &[&z], &[], affine(1.0, 1.0, runs), &mut out)
            .unwrap(),
    );
    let expected: Vec<f32> = read(g, x).iter().map(|v| v * 2.0 * a + 1.0).collect();
    assert_eq!(read(g, &out[0].buffer), expected);
    outcomes
}

fn branch_functions<D: TestDevice>(g: &mut G<D>) -> [graft::FunctionId; 4] {
    ["f1", "f2", "f3", "f4"].map(|n| g.register(n, FunctionSpec::default()))
}

// 3. Branches: after both paths are recorded, alternating them replays only.
fn branches_replay_only<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let fs = branch_functions(&mut g);
    let x = input(&mut g, &[1.0, 2.0, 3.0, 4.0]);
    let runs = Runs::default();
    for left in [true, true, false, false] {
        branch_step(&mut g, &fs, &x, left, &runs);
        g.mark_step_begin();
    }
    let before = g.stats();
    assert_eq!(before.nodes, 5);
    for i in 0..6 {
        let outcomes = branch_step(&mut g, &fs, &x, i % 2 == 0, &runs);
        assert!(
            outcomes.iter().all(|o| matches!(o, Outcome::Replayed(_))),
            "{outcomes:?}"
        );
        g.mark_step_begin();
    }
    let after = g.stats();
    assert_eq!(after.nodes, 5);
    assert_eq!(after.recordings, before.recordings);
    assert_eq!(after.warmups, before.warmups);
    assert_eq!(after.replays, before.replays + 18);
    // f1 is the only root; f2 and f3 hang under it; an f4 under each.
    let roots: Vec<_> = g
        .node_ids()
        .into_iter()
        .filter(|n| g.node_parent(*n).is_none())
        .collect();
    assert_eq!(roots.len(), 1);
    assert_eq!(g.node_function(roots[0]), Some(fs[0]));
}
device_test!(scenario_03_branches_replay_only, branches_replay_only);

// 4. Divergence while replaying restores once, warms up, and runs the rest eagerly.
fn divergence_restores_once<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let fs = branch_functions(&mut g);
    let x = input(&mut g, &[1.0, 2.0, 3.0, 4.0]);
    let runs = Runs::default();
    for _ in 0..3 {
        branch_step(&mut g, &fs, &x, true, &runs);
        g.mark_step_begin();
    }
    let before = g.stats();
    let outcomes = branch_step(&mut g, &fs, &x, false, &runs);
    assert!(
        matches!(
            outcomes[..],
            [Outcome::Replayed(_), Outcome::Warmup, Outcome::Warmup]
        ),
        "{outcomes:?}"
    );
    let after = g.stats();
    assert_eq!(after.restores, before.restores + 1);
    assert_eq!(after.warmups, before.warmups + 2);
    assert_eq!(after.recordings, before.recordings);
    assert!(
        g.explain()
            .any(|d| matches!(d.decision, Decision::Restore { .. }))
    );
}
device_test!(
    scenario_04_divergence_restores_once,
    divergence_restores_once
);

// 5. Liveness shapes the tree: an ancestor's output held versus dropped gives two recordings.
fn liveness_shapes_tree<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f1 = g.register("f1", FunctionSpec::default());
    let f2 = g.register("f2", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 64]);
    let runs = Runs::default();
    let step = |g: &mut G<D>, hold: bool| -> Vec<Outcome> {
        let mut out = Vec::new();
        let o1 = g
            .call_into(f1, &[&x], &[], affine(2.0, 0.0, &runs), &mut out)
            .unwrap();
        let held = out.pop().unwrap().buffer;
        if !hold {
            drop(held);
            let o2 = g
                .call_into(f2, &[&x], &[], affine(3.0, 0.0, &runs), &mut out)
                .unwrap();
            assert_eq!(read(g, &out[0].buffer), vec![3.0; 64]);
            g.mark_step_begin();
            return vec![o1, o2];
        }
        let o2 = g
            .call_into(f2, &[&x], &[], affine(3.0, 0.0, &runs), &mut out)
            .unwrap();
        assert_eq!(read(g, &out[0].buffer), vec![3.0; 64]);
        assert_eq!(read(g, &held), vec![2.0; 64], "the held output survives f2");
        g.mark_step_begin();
        vec![o1, o2]
    };
    step(&mut g, false); // warmups
    step(&mut g, false); // records f1, f2 (f1's output dead)
    let o = step(&mut g, true); // f1's output held: the f2 node may overwrite it, so re-record
    assert!(matches!(o[1], Outcome::Recorded(_)));
    assert_eq!(g.stats().rerecords.expected_dead_alive, 1);
    let dropped = step(&mut g, false);
    let held = step(&mut g, true);
    let (Outcome::Replayed(a), Outcome::Replayed(b)) = (&dropped[1], &held[1]) else {
        panic!("both patterns replay: {dropped:?} {held:?}");
    };
    assert_ne!(a, b, "each pattern has its own node");
    assert_eq!(g.stats().nodes, 3);
}
device_test!(scenario_05_liveness_shapes_tree, liveness_shapes_tree);

/// out = x + 1 after using a scratch buffer of `scratch_floats` (freed inside the body).
fn with_scratch<D: TestDevice>(scratch_floats: usize, runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let scratch = ctx_alloc(ctx, scratch_floats)?;
        ctx.queue().fill_f32(&scratch, scratch_floats, 1.0)?;
        let out = ctx.alloc(x.len())?;
        ctx.queue().add_f32(&out, &x, &scratch, n)?;
        Ok(vec![Output::new(out, 0)])
    })
}

// 6. Memory: two sibling paths cost the larger path, not the sum; reset returns to zero.
fn memory_is_largest_path<D: TestDevice>(dev: D) {
    // The larger path's eager peak: the same functions, never graphed.
    let eager_peak = {
        let mut e = graft(dev.clone(), Config::default());
        let spec = FunctionSpec {
            eager_only: true,
            ..FunctionSpec::default()
        };
        let (f1, f2) = (e.register("f1", spec.clone()), e.register("f2", spec));
        let x = input(&mut e, &[1.0; 256]);
        let base = e.stats().eager_pool.allocated;
        let runs = Runs::default();
        let y = e
            .call(f1, &[&x], &[], affine(1.0, 0.0, &runs))
            .unwrap()
            .pop()
            .unwrap()
            .buffer;
        let z = e
            .call(f2, &[&y], &[], with_scratch(1 << 20, &runs))
            .unwrap();
        drop((y, z));
        e.stats().eager_pool.peak_allocated - base
    };
    let mut g = graft(dev, Config::default());
    let f1 = g.register("f1", FunctionSpec::default());
    let f2 = g.register("f2", FunctionSpec::default());
    let f3 = g.register("f3", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 256]);
    let runs = Runs::default();
    let step = |g: &mut G<D>, f: graft::FunctionId, floats: usize| {
        let y = g
            .call(f1, &[&x], &[], affine(1.0, 0.0, &runs))
            .unwrap()
            .pop()
            .unwrap()
            .buffer;
        let z = g
            .call(f, &[&y], &[], with_scratch(floats, &runs))
            .unwrap()
            .pop()
            .unwrap()
            .buffer;
        assert_eq!(read(g, &z), vec![2.0; 256]);
        g.mark_step_begin();
    };
    for _ in 0..3 {
        step(&mut g, f2, 1 << 20); // 4 MiB of scratch
    }
    let one_path = g.stats().pool.mapped;
    for _ in 0..3 {
        step(&mut g, f3, 768 << 10); // 3 MiB of scratch
    }
    step(&mut g, f2, 1 << 20);
    let s = g.stats();
    assert_eq!(s.nodes, 3);
    assert_eq!(
        s.pool.mapped, one_path,
        "the second path reuses the first path's memory"
    );
    let ratio = s.pool.peak_allocated as f64 / eager_peak as f64;
    assert!(
        ratio <= 1.05,
        "tree peak {} vs eager peak {eager_peak}: {ratio:.3}",
        s.pool.peak_allocated
    );
    drop(runs);
    g.reset().unwrap();
    let s = g.stats();
    assert_eq!((s.pool.live_blocks, s.pool.mapped), (0, 0));
}
device_test!(scenario_06_memory_is_largest_path, memory_is_largest_path);

// 7. An output held across mark_step_begin stays readable until its memory is reused.
fn stale_output_errors_after_reuse<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0]);
    let runs = Runs::default();
    for _ in 0..2 {
        g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        g.mark_step_begin();
    }
    let kept = g
        .call(f, &[&x], &[], affine(2.0, 0.0, &runs))
        .unwrap()
        .pop()
        .unwrap()
        .buffer;
    let node = kept.node().expect("a replayed output names its node");
    g.mark_step_begin();
    assert_eq!(
        read(&g, &kept),
        vec![2.0, 4.0],
        "stale but not reused: still readable"
    );
    let fresh = g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
    assert_eq!(read(&g, &fresh[0].buffer), vec![2.0, 4.0]);
    match kept.addr() {
        Err(BufferError::Overwritten {
            function,
            node: n,
            overwritten_by,
            generation,
        }) => {
            assert_eq!(&*function, "f");
            assert_eq!(n.0, Some(node));
            assert_eq!(overwritten_by.0, Some(node));
            assert_eq!(generation, g.generation() - 1);
        }
        other => panic!("expected the overwritten error, got {other:?}"),
    }
    let err = g.read_f32(&kept).unwrap_err();
    assert!(matches!(
        err,
        MemoryError::Buffer(BufferError::Overwritten { .. })
    ));
    assert!(err.to_string().contains("copy it out"), "{err}");
}
device_test!(
    scenario_07_stale_output_errors_after_reuse,
    stale_output_errors_after_reuse
);

// 8. Autoregressive feedback across generations: 1,000 steps (a few under the sanitizer), same
// values as eager.
fn autoregressive_feedback<D: TestDevice>(dev: D) {
    let mut g = graft(dev.clone(), unguarded());
    let f = g.register("step", FunctionSpec::default());
    let start: Vec<f32> = (0..256).map(|i| i as f32 * 0.25).collect();
    let mut x = input(&mut g, &start);
    let eager = input(&mut g, &start);
    let runs = Runs::default();
    let mut out = Vec::new();
    let steps = graft_testkit::steps(1000, 6);
    for _ in 0..steps {
        g.call_into(f, &[&x], &[], affine(0.5, 1.0, &runs), &mut out)
            .unwrap();
        x = out.pop().unwrap().buffer;
        dev.queue().axpb_f32(&eager, &eager, 0.5, 1.0, 256).unwrap();
    }
    assert_eq!(read(&g, &x), read(&g, &eager));
    let s = g.stats();
    assert_eq!((s.recordings, s.replays), (1, steps as u64 - 2));
    assert_eq!(runs.get(), 2);
}
device_test!(scenario_08_autoregressive_feedback, autoregressive_feedback);

/// out = input0 * input1 (input 0 static).
fn scale<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let (w, x) = (ctx.input(0).clone(), ctx.input(1).clone());
        let out = ctx.alloc(x.len())?;
        ctx.queue().mul_f32(&out, &w, &x, x.len() / 4)?;
        Ok(vec![Output::new(out, 0)])
    })
}

// 9. A static input's address change records a sibling; with the limit at 0 it falls back.
fn static_address_change<D: TestDevice>(dev: D) {
    for limit in [128, 0] {
        let mut g = graft(
            dev.clone(),
            Config {
                rerecord_limit: limit,
                ..Config::default()
            },
        );
        let f = g.register("f", FunctionSpec::inference([0]));
        let w1 = input(&mut g, &[2.0; 4]);
        let w2 = input(&mut g, &[3.0; 4]);
        let x = input(&mut g, &[1.0; 4]);
        let runs = Runs::default();
        for _ in 0..3 {
            g.call(f, &[&w1, &x], &[], scale(&runs)).unwrap();
        }
        let mut out = Vec::new();
        let outcome = g
            .call_into(f, &[&w2, &x], &[], scale(&runs), &mut out)
            .unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![3.0; 4]);
        if limit > 0 {
            assert!(matches!(outcome, Outcome::Recorded(_)), "{outcome:?}");
            assert_eq!(g.stats().rerecords.static_address_changed, 1);
            assert!(matches!(
                g.call_into(f, &[&w1, &x], &[], scale(&runs), &mut out)
                    .unwrap(),
                Outcome::Replayed(_)
            ));
            assert!(matches!(
                g.call_into(f, &[&w2, &x], &[], scale(&runs), &mut out)
                    .unwrap(),
                Outcome::Replayed(_)
            ));
        } else {
            assert!(
                matches!(outcome, Outcome::Eager(EagerReason::RerecordLimit { .. })),
                "{outcome:?}"
            );
            let last = g.explain().last().unwrap().clone();
            let Decision::Eager(EagerReason::RerecordLimit {
                limit: 0,
                last: reason,
            }) = &last.decision
            else {
                panic!("unexpected decision {last}");
            };
            assert!(matches!(
                reason,
                RecordReason::StaticAddressChanged { position: 0, .. }
            ));
            assert!(
                last.to_string().contains("static input address changed"),
                "{last}"
            );
        }
    }
}
device_test!(scenario_09_static_address_change, static_address_change);

/// out0 = x * 2, out1 = x * 3.
fn two_outputs<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let a = ctx.alloc(x.len())?;
        let b = ctx.alloc(x.len())?;
        ctx.queue().axpb_f32(&a, &x, 2.0, 0.0, n)?;
        ctx.queue().axpb_f32(&b, &x, 3.0, 0.0, n)?;
        Ok(vec![Output::new(a, 0), Output::new(b, 1)])
    })
}

// 10. A managed input is used in place; another address is another node.
fn managed_input_in_place<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f1 = g.register("f1", FunctionSpec::inference([0]));
    let f2 = g.register("f2", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 16]);
    let runs = Runs::default();
    let step = |g: &mut G<D>, pick: usize| -> Outcome {
        let mut outs = g.call(f1, &[&x], &[], two_outputs(&runs)).unwrap();
        let y = outs.remove(pick).buffer;
        let mut out = Vec::new();
        let o = g
            .call_into(f2, &[&y], &[], affine(1.0, 1.0, &runs), &mut out)
            .unwrap();
        assert_eq!(
            read(g, &out[0].buffer),
            vec![if pick == 0 { 3.0 } else { 4.0 }; 16]
        );
        g.mark_step_begin();
        o
    };
    step(&mut g, 0);
    step(&mut g, 0);
    let copies = g.stats().copied_inputs;
    assert!(matches!(step(&mut g, 0), Outcome::Replayed(_)));
    assert_eq!(
        g.stats().copied_inputs,
        copies,
        "a managed input is never copied"
    );
    let other = step(&mut g, 1);
    assert!(matches!(other, Outcome::Recorded(_)), "{other:?}");
    assert_eq!(g.stats().rerecords.managed_address_changed, 1);
    assert!(matches!(step(&mut g, 1), Outcome::Replayed(_)));
    assert!(matches!(step(&mut g, 0), Outcome::Replayed(_)));
}
device_test!(scenario_10_managed_input_in_place, managed_input_in_place);

// 11. A copied input: the caller's buffer is unchanged, the placeholder holds the copy.
fn copied_input<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let runs = Runs::default();
    // Returns its (placeholder) input as output 1: graft copies it into the output.
    let body = |runs: &Runs| {
        let mut inner = affine::<D>(2.0, 0.0, runs);
        move |ctx: &mut Ctx<'_, D>| {
            let mut outs = inner(ctx)?;
            outs.push(Output::new(ctx.input(0).clone(), 7));
            Ok(outs)
        }
    };
    let mut held = Vec::new();
    for i in 0..5 {
        let values = vec![i as f32; 8];
        // Every input at a new address (the old ones stay held), except the last call, which
        // passes the previous buffer again with new contents.
        let x = if i < 4 {
            input(&mut g, &values)
        } else {
            held.pop().unwrap()
        };
        g.write_f32(&x, &values).unwrap();
        let copies = g.stats().copied_inputs;
        let out = g.call(f, &[&x], &[], body(&runs)).unwrap();
        assert_eq!(read(&g, &x), values, "the caller's buffer is never written");
        assert_eq!(read(&g, &out[0].buffer), vec![2.0 * i as f32; 8]);
        assert_eq!(
            read(&g, &out[1].buffer),
            values,
            "the placeholder held the copy"
        );
        if i >= 1 {
            // Recorded and replayed: the output is graft's copy of the placeholder. (A warmup
            // runs eagerly on the caller's buffer, so it hands that buffer back.)
            assert!(!out[1].buffer.same_storage(&x));
        }
        if i >= 2 {
            assert_eq!(g.stats().copied_inputs, copies + 1);
        }
        held.push(x);
    }
    let s = g.stats();
    assert_eq!(s.replays, 3);
    // The graph's copy node was re-pointed for the two replays with new addresses, not for the
    // one that passed the same buffer again.
    assert_eq!(s.copy_sources_updated, 2);
}
device_test!(scenario_11_copied_input, copied_input);

// 12. A capture failure falls back to eager for good, with the operation named; also when the
// body hands the device's error back wrapped in the framework's own error type.
fn capture_failure_falls_back<D: TestDevice>(dev: D) {
    for wrapped in [false, true] {
        capture_failure_falls_back_with(dev.clone(), wrapped);
    }
}

fn capture_failure_falls_back_with<D: TestDevice>(dev: D, wrapped: bool) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let syncing = |runs: &Runs| {
        let mut inner = affine::<D>(2.0, 0.0, runs);
        move |ctx: &mut Ctx<'_, D>| {
            let outs = inner(ctx)?;
            match ctx.queue().synchronize() {
                Ok(()) => Ok(outs),
                Err(e) if wrapped => Err(BodyError::Framework(Box::new(e) as graft::AnyError)),
                Err(e) => Err(e.into()),
            }
        }
    };
    let mut held = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..4 {
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(f, &[&x], &[], syncing(&runs), &mut out)
                .unwrap(),
        );
        assert_eq!(read(&g, &out[0].buffer), vec![2.0; 4]);
        held.push(out.pop().unwrap().buffer);
    }
    assert!(
        matches!(
            &outcomes[..],
            [
                Outcome::Warmup,
                Outcome::Eager(EagerReason::CaptureFailed { .. }),
                Outcome::Eager(EagerReason::CaptureFailed { .. }),
                Outcome::Eager(EagerReason::CaptureFailed { .. })
            ]
        ),
        "wrapped {wrapped}: {outcomes:?}"
    );
    let s = g.stats();
    assert_eq!((s.capture_failures, s.recordings, s.nodes), (1, 0, 0));
    let failure = g
        .explain()
        .find_map(|d| match &d.decision {
            Decision::Eager(EagerReason::CaptureFailed { op, violation }) => {
                Some((*op, *violation))
            }
            _ => None,
        })
        .expect("the capture failure is logged");
    // Wrapped, the operation that broke the capture is hidden in the framework's error: the
    // device reports the capture invalidated when graft ends it.
    let op = if wrapped {
        DeviceOp::EndCapture
    } else {
        DeviceOp::Synchronize
    };
    assert_eq!(failure.0, op);
    assert!(matches!(
        failure.1,
        CaptureViolation::Unsupported | CaptureViolation::Invalidated
    ));
    // Pool live blocks equal the buffers callers hold: the warmup output in the graph pool,
    // three eager outputs and the input in the eager pool.
    assert_eq!(s.pool.live_blocks, 1);
    assert_eq!(s.eager_pool.live_blocks, 4);
    held.remove(0);
    assert_eq!(g.stats().pool.live_blocks, 0);
}
device_test!(
    scenario_12_capture_failure_falls_back,
    capture_failure_falls_back
);

// 13. Distinct signatures past the warn limit warn exactly once. Each shape is called twice:
// shapes that change on every call are named as churn instead (`tests/diagnostics.rs`).
fn signature_warning_once<D: TestDevice>(dev: D) {
    let warnings = count_warnings("pad or bucket", || {
        let mut g = graft(dev, Config::default());
        let f = g.register("f", FunctionSpec::default());
        let runs = Runs::default();
        for n in 1..=12 {
            let x = input(&mut g, &vec![1.0; n]);
            for _ in 0..2 {
                g.call(f, &[&x], &[n as u64], affine(1.0, 0.0, &runs))
                    .unwrap();
            }
        }
    });
    assert_eq!(warnings, 1);
}
device_test!(scenario_13_signature_warning_once, signature_warning_once);

// 14. With a backward pending, calls do not start a new generation.
fn backward_pending_holds_generation<D: TestDevice>(dev: D) {
    let warnings = count_warnings("still need a backward", || {
        let mut g = graft(dev, Config::default());
        let fwd = g.register("fwd", FunctionSpec::default().mode(Mode::Forward));
        let bwd = g.register("bwd", FunctionSpec::default().mode(Mode::Backward));
        let x = input(&mut g, &[1.0; 4]);
        let runs = Runs::default();
        let y = g
            .call(fwd, &[&x], &[], affine(2.0, 0.0, &runs))
            .unwrap()
            .pop()
            .unwrap()
            .buffer;
        let start = g.generation();
        // A second forward before the backward: same generation.
        g.call(fwd, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        g.call(fwd, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        assert_eq!(g.generation(), start);
        g.call(bwd, &[&y], &[], affine(1.0, 0.0, &runs)).unwrap();
        g.call(fwd, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        assert_eq!(
            g.generation(),
            start + 1,
            "after the backward, the forward starts a generation"
        );
        g.call(fwd, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        assert_eq!(g.generation(), start + 1);
        g.mark_step_begin();
        assert_eq!(g.generation(), start + 2);
    });
    assert_eq!(warnings, 1);
}
device_test!(
    scenario_14_backward_pending_holds_generation,
    backward_pending_holds_generation
);

// 15. Aliasing: a static input comes back as itself; shared outputs stay shared.
fn aliasing<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::inference([0]));
    let w = input(&mut g, &[5.0; 4]);
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let body = |runs: &Runs| {
        let mut inner = scale::<D>(runs);
        move |ctx: &mut Ctx<'_, D>| {
            let outs = inner(ctx)?;
            let shared = outs[0].buffer.clone();
            Ok(vec![
                Output::new(ctx.input(0).clone(), 0),
                outs.into_iter().next().unwrap(),
                Output::new(shared, 2),
            ])
        }
    };
    let mut held = Vec::new();
    for _ in 0..4 {
        let out = g.call(f, &[&w, &x], &[], body(&runs)).unwrap();
        assert!(out[0].buffer.same_storage(&w));
        assert!(out[1].buffer.same_storage(&out[2].buffer));
        assert_eq!(read(&g, &out[2].buffer), vec![5.0; 4]);
        assert_eq!(out[2].meta, 2);
        held.push(out[0].buffer.clone()); // holding the static input changes nothing
    }
    let s = g.stats();
    assert_eq!((s.nodes, s.recordings, s.replays), (1, 1, 2));
}
device_test!(scenario_15_aliasing, aliasing);

// 16. Zero-size outputs are not tracked.
fn zero_size_outputs<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let body = |runs: &Runs| {
        let mut inner = affine::<D>(1.0, 1.0, runs);
        move |ctx: &mut Ctx<'_, D>| {
            let mut outs = inner(ctx)?;
            outs.push(Output::new(ctx.alloc(0)?, 9));
            Ok(outs)
        }
    };
    let mut empties = Vec::new();
    for _ in 0..5 {
        let out = g.call(f, &[&x], &[], body(&runs)).unwrap();
        assert!(out[1].buffer.is_empty());
        assert_eq!(out[1].meta, 9);
        empties.push(out[1].buffer.clone());
        g.mark_step_begin();
    }
    assert!(
        empties.iter().all(|b| b.addr().is_ok()),
        "empty outputs are never invalidated"
    );
    let s = g.stats();
    assert_eq!(
        (s.nodes, s.recordings, s.replays),
        (1, 1, 3),
        "holding empty outputs changes nothing"
    );
}
device_test!(scenario_16_zero_size_outputs, zero_size_outputs);

// 18. reset() with buffers held: later access errors; nothing touches freed memory.
fn reset_invalidates<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            g.call(f, &[&x], &[], affine(2.0, 0.0, &runs))
                .unwrap()
                .pop()
                .unwrap()
                .buffer,
        );
    }
    // The recording's output was overwritten by the replay; the replay's is still valid.
    assert!(matches!(
        held[1].addr(),
        Err(BufferError::Overwritten { .. })
    ));
    assert!(held[2].addr().is_ok());
    g.reset().unwrap();
    for b in &held[1..] {
        assert!(b.addr().is_err());
    }
    assert!(
        matches!(held[2].addr(), Err(BufferError::Reset { .. })),
        "{:?}",
        held[2].addr()
    );
    assert!(matches!(
        g.read_f32(&held[2]),
        Err(MemoryError::Buffer(BufferError::Reset { .. }))
    ));
    assert!(
        held[0].addr().is_err(),
        "the warmup's output lived in the graph pool too"
    );
    let err = g
        .call(f, &[&held[2]], &[], affine(2.0, 0.0, &runs))
        .unwrap_err();
    assert!(
        matches!(err, CallError::InvalidInput { position: 0, .. }),
        "{err}"
    );
    assert_eq!(g.stats().pool.mapped, 0);
    assert_eq!(
        read(&g, &x),
        vec![1.0; 4],
        "memory from Graft::alloc survives reset"
    );
    drop(held);
    // The tree works again after a reset.
    for _ in 0..3 {
        let out = g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![2.0; 4]);
    }
    assert_eq!(g.stats().replays, 2);
}
device_test!(scenario_18_reset_invalidates, reset_invalidates);

// 19. A `Forward` function begins a training step when no backward is pending, wherever it was
// first called. Here an inference function starts the runtime's generations, so the training
// step's forward is first called mid-path and never became root-level: its steps used to warm
// up without end, or, once recorded, add a node to the path on every call.
fn forward_begins_a_step_wherever_first_called<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let infer = g.register("infer", FunctionSpec::default());
    let fwd = g.register("fwd", FunctionSpec::default().mode(Mode::Forward));
    let bwd = g.register("bwd", FunctionSpec::default().mode(Mode::Backward));
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    for _ in 0..3 {
        g.call(infer, &[&x], &[], affine(3.0, 0.0, &runs)).unwrap();
    }
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let mut y = Vec::new();
        outcomes.push(
            g.call_into(fwd, &[&x], &[], affine(2.0, 0.0, &runs), &mut y)
                .unwrap(),
        );
        let mut dx = Vec::new();
        outcomes.push(
            g.call_into(bwd, &[&y[0].buffer], &[], affine(0.5, 1.0, &runs), &mut dx)
                .unwrap(),
        );
        assert_eq!(read(&g, &dx[0].buffer), vec![2.0; 4]);
    }
    let tail = &outcomes[6..];
    assert!(
        tail.iter().all(|o| matches!(o, Outcome::Replayed(_))),
        "from the fourth step on every call replays: {outcomes:?}"
    );
    assert_eq!(
        g.nodes().len(),
        3,
        "infer, fwd and bwd under it: {outcomes:?}"
    );
}
device_test!(
    scenario_19_forward_begins_a_step_wherever_first_called,
    forward_begins_a_step_wherever_first_called
);

// 20. A decode loop after a prefill, without `mark_step_begin`: the decode function was first
// called mid-path (after the prefill), but its second call repeats its first (the same function,
// signature and static inputs), so it begins a new generation, and from the third call on every
// decode replays one node. Several requests add one node (the prefill's), not one per decode
// position. With marks, the same.
fn decode_after_prefill<D: TestDevice>(dev: D) {
    for mark in [false, true] {
        let mut g = graft(dev.clone(), unguarded());
        let prefill = g.register("prefill", FunctionSpec::inference([1]));
        let decode = g.register("decode", FunctionSpec::inference([1]));
        let w = input(&mut g, &[0.0; 4]);
        let x = input(&mut g, &[1.0; 4]);
        let runs = Runs::default();
        let warnings = count_warnings("without a new one", || {
            for request in 0..3 {
                let mut y = Vec::new();
                g.call_into(prefill, &[&x, &w], &[], add(&runs), &mut y)
                    .unwrap();
                let mut t = y.pop().unwrap().buffer;
                let mut outcomes = Vec::new();
                for _ in 0..300 {
                    if mark {
                        g.mark_step_begin();
                    }
                    let mut z = Vec::new();
                    let o = g.call_into(decode, &[&t, &w], &[], affine(1.0, 1.0, &runs), &mut z);
                    outcomes.push(o.unwrap());
                    t = z.pop().unwrap().buffer;
                }
                assert_eq!(read(&g, &t), vec![301.0; 4]);
                let from = if request == 0 { 2 } else { 0 };
                assert!(
                    outcomes[from..]
                        .iter()
                        .all(|o| matches!(o, Outcome::Replayed(_))),
                    "mark {mark}, request {request}: {:?}",
                    &outcomes[..4]
                );
            }
        });
        assert_eq!(warnings, 0);
        assert_eq!(
            g.nodes().len(),
            2,
            "mark {mark}: the decode's node and the prefill's"
        );
    }
}
device_test!(scenario_20_decode_after_prefill, decode_after_prefill);
