//! Guards against host values baked into a recording (`Config::guards`): a scalar the body
//! passes to a kernel that changes on every call is found at the first guard and every later
//! call is right; one that changes once is found at the next scheduled guard; one that never
//! changes is never flagged and replays as before; addresses that move as graft predicts
//! (copied and in-place inputs, held outputs) are no difference.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use graft::{
    Config, Ctx, EagerReason, FunctionSpec, GraphDifference, Guards, Outcome, Output, RecordReason,
};

fn guarded() -> Config {
    Config {
        guards: Some(Guards::default()),
        ..Config::default()
    }
}

// Call 0 warms up, call 1 records, call 2 is the first guard (the call right after the
// recording): it finds `a` changed and its capture takes the recording's place. From then on
// every call is guarded: it is captured (and takes the place again), or runs eagerly where
// that took less time; none replays blind.
fn changes_every_call<D: TestDevice>(dev: D) {
    let mut g = graft(dev, guarded());
    let runs = Runs::default();
    let calls = run_scaled(&mut g, 40, |i| i as f32, &runs);
    assert!(calls.iter().all(|(_, right)| *right), "{calls:?}");
    assert!(matches!(calls[1].0, Outcome::Recorded(_)));
    assert!(matches!(calls[2].0, Outcome::Recorded(_)));
    assert!(
        calls[3..].iter().all(|(o, _)| matches!(
            o,
            Outcome::Eager(EagerReason::HostValueChanging) | Outcome::Recorded(_)
        )),
        "{calls:?}"
    );
    assert_eq!(runs.get(), 40, "the body runs once per call");
    let findings = g.guard_findings();
    assert_eq!(findings.len(), 1, "reported once: {findings:?}");
    let GraphDifference::Argument {
        kernel,
        index,
        recorded,
        now,
        ..
    } = &findings[0].difference
    else {
        panic!("{findings:?}");
    };
    // `axpb_f32` on the simulator, `graft_axpb_f32` on CUDA; its arguments (dst, x, a, b, n).
    assert!(kernel.ends_with("axpb_f32"), "{kernel}");
    assert_eq!(*index, 2);
    assert_eq!(**recorded, 1.0f32.to_le_bytes());
    assert_eq!(**now, 2.0f32.to_le_bytes());
    assert_eq!(findings[0].call, 1);
    let message = findings[0].to_string();
    assert!(
        message.contains("axpb_f32` argument 2 changed"),
        "{message}"
    );
    assert!(
        message.contains("hold it in a device tensor or declare it a key"),
        "{message}"
    );
    let stats = g.stats();
    let captured = calls[2..]
        .iter()
        .filter(|(o, _)| matches!(o, Outcome::Recorded(_)))
        .count() as u64;
    assert_eq!(stats.guards, captured);
    assert_eq!(stats.guard_differences, captured);
    assert_eq!(stats.rerecords.host_value_changed, captured);
    assert_eq!(stats.eager_runs, 38 - captured);
    assert_eq!(stats.replays, 0);
    assert_eq!(stats.fallbacks, 0, "the signature is not eager for good");
    assert_eq!(stats.nodes, 1, "the last capture is the node");
}
device_test!(
    a_scalar_that_changes_every_call_is_found_at_the_first_guard,
    changes_every_call
);

// `a` changes at call 11 (the 10th call after the recording at call 1). Guards run at calls
// 1, 2, 4, 8, 16 after the recording (global calls 2, 3, 5, 9, 17): calls 11 to 16 replay
// the stale value (the window the guide states), call 17 finds it and its capture takes the
// recording's place. Every call from there on is guarded (captured, or eager where that took
// less time, with a capture at most 8 eager calls later) until two captures in a row equal
// the node: then plain replays again, on the schedule. Every call from 17 on is right.
fn changes_once<D: TestDevice>(dev: D) {
    let mut g = graft(dev, guarded());
    let runs = Runs::default();
    let calls = run_scaled(&mut g, 40, |i| if i < 11 { 3.0 } else { 5.0 }, &runs);
    let wrong: Vec<usize> = (0..40).filter(|&i| !calls[i].1).collect();
    assert_eq!(wrong, (11..17).collect::<Vec<_>>());
    assert!(matches!(calls[17].0, Outcome::Recorded(_)));
    assert_eq!(g.guard_findings().len(), 1);
    assert_eq!(g.guard_findings()[0].call, 16);
    assert_eq!(g.stats().guard_differences, 1);
    assert_eq!(g.stats().fallbacks, 0);
    let resumed = 18
        + calls[18..]
            .iter()
            .position(|(o, _)| matches!(o, Outcome::Replayed(_)))
            .expect("replays resume");
    assert!(
        resumed <= 18 + 1 + 8 + 2,
        "replays resume at call {resumed}"
    );
    assert!(
        calls[18..resumed].iter().all(|(o, _)| matches!(
            o,
            Outcome::Eager(EagerReason::HostValueChanging) | Outcome::Replayed(_)
        )),
        "{calls:?}"
    );
    assert!(
        calls[resumed..]
            .iter()
            .all(|(o, _)| matches!(o, Outcome::Replayed(_))),
        "{calls:?}"
    );
    assert!(
        calls[..11]
            .iter()
            .skip(2)
            .all(|(o, _)| matches!(o, Outcome::Replayed(_)))
    );
    // Strict guards (every call) close the window: no call is stale.
    let mut strict = graft(
        g.device().clone(),
        Config {
            guards: Some(Guards::every_call()),
            ..Config::default()
        },
    );
    let calls = run_scaled(&mut strict, 40, |i| if i < 11 { 3.0 } else { 5.0 }, &runs);
    assert!(calls.iter().all(|(_, right)| *right), "{calls:?}");
}
device_test!(
    a_scalar_that_changes_once_is_found_at_the_next_guard,
    changes_once
);

// A scalar that never changes: never flagged, every call after the recording replays (the
// guarded ones too), and the body runs only on the guarded calls.
fn never_changes<D: TestDevice>(dev: D) {
    let mut g = graft(dev, guarded());
    let runs = Runs::default();
    let calls = run_scaled(&mut g, 100, |_| 2.5, &runs);
    assert!(calls.iter().all(|(_, right)| *right));
    assert!(
        calls[2..]
            .iter()
            .all(|(o, _)| matches!(o, Outcome::Replayed(_)))
    );
    assert!(g.guard_findings().is_empty());
    let stats = g.stats();
    // Guards at calls 1, 2, 4, 8, 16, 32, 64 after the recording.
    assert_eq!(stats.guards, 7);
    assert_eq!(stats.replays, 98);
    assert_eq!(stats.recordings, 1);
    assert_eq!(runs.get(), 2 + 7);
}
device_test!(a_scalar_that_never_changes_is_never_flagged, never_changes);

// A guard's capture is ended to be compared, not instantiated: where it equals the
// recording it is dropped without ever being prepared to launch (on CUDA no instantiation,
// no upload, no memory mapped for its allocations), so a guarded call costs the capture, the
// compare and the replay. (Where it differs, it is prepared to run in the recording's place:
// the simulator refuses to launch it otherwise, so the tests above, whose findings run their
// captures, cover that.)
#[test]
fn equal_guard_captures_are_never_instantiated() {
    let dev = sim();
    let mut g = graft(dev.clone(), guarded());
    run_scaled(&mut g, 100, |_| 2.5, &Runs::default());
    assert_eq!(g.stats().guards, 7);
    assert_eq!(dev.stats().instantiations, 1, "the recording only");
}

// Addresses move as graft predicts: the copied input alternates between two buffers, an
// in-place input moves every call, and the outputs of earlier calls stay held, so the
// guard's capture allocates elsewhere than the recording. None of it is a difference.
fn moved_addresses<D: TestDevice>(dev: D) {
    let mut g = graft(dev, guarded());
    let f = g.register("step", FunctionSpec::default());
    let xs = [input(&mut g, &[1.0; 4]), input(&mut g, &[2.0; 4])];
    let runs = Runs::default();
    let mut body = {
        let runs = runs.clone();
        move |ctx: &mut Ctx<'_, D>| {
            runs.hit();
            let (x, y) = (ctx.input(0).clone(), ctx.input(1).clone());
            let out = ctx.alloc(16)?;
            ctx.queue().add_f32(&out, &x, &y, 4)?;
            ctx.queue().axpb_f32(&out, &out, 2.0, 0.0, 4)?;
            Ok(vec![Output::new(out, 4)])
        }
    };
    let mut held = Vec::new();
    for i in 0..70 {
        let y = input(&mut g, &[i as f32; 4]);
        y.mark_in_place();
        let x = &xs[i % 2];
        let out = g.call(f, &[x, &y], &[], &mut body).unwrap();
        let expected = 2.0 * ((i % 2 + 1) as f32 + i as f32);
        assert_eq!(read(&g, &out[0].buffer), vec![expected; 4], "call {i}");
        held.push(out);
        if held.len() > 3 {
            held.remove(0);
        }
    }
    assert!(g.guard_findings().is_empty(), "{:?}", g.guard_findings());
    let stats = g.stats();
    assert_eq!(stats.guards, 7);
    assert_eq!(stats.guard_differences, 0);
    assert_eq!(stats.recordings, 1);
}
device_test!(
    addresses_that_move_as_predicted_are_no_difference,
    moved_addresses
);

// With guards off, `guard_next_call` guards one call on demand; what it finds makes the
// signature eager as a scheduled guard's finding does.
fn on_demand<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let scale = Arc::new(AtomicU32::new(0));
    let runs = Runs::default();
    let mut body = scaled::<D>(&scale, &runs);
    let mut out = Vec::new();
    let mut call = |g: &mut G<D>, a: f32| {
        scale.store(a.to_bits(), Ordering::Relaxed);
        let o = g.call_into(f, &[&x], &[], &mut body, &mut out).unwrap();
        (o, read(g, &out[0].buffer)[0])
    };
    call(&mut g, 1.0);
    call(&mut g, 1.0);
    assert!(
        matches!(call(&mut g, 4.0), (Outcome::Replayed(_), 2.0)),
        "unguarded: stale"
    );
    g.guard_next_call();
    let (o, v) = call(&mut g, 4.0);
    assert!(matches!(o, Outcome::Recorded(_)));
    assert_eq!(v, 5.0);
    assert_eq!(g.guard_findings().len(), 1);
    let (o, v) = call(&mut g, 6.0);
    assert!(matches!(
        o,
        Outcome::Eager(EagerReason::HostValueBaked { .. })
    ));
    assert_eq!(v, 7.0);
    assert_eq!(g.stats().guards, 1);
    let replaced = g.explain().any(|d| {
        matches!(
            &d.decision,
            graft::Decision::Record(RecordReason::HostValueChanged)
        )
    });
    assert!(replaced);
}
device_test!(guard_next_call_guards_one_call, on_demand);

// The warning names the kernel once, however many calls find the value again.
// (Tracing's callsite cache makes a count of warnings flaky while the other tests of this
// binary hit the same callsite without a subscriber on their threads: the warning is counted
// at most once, and the finding, which is what is warned, exactly once.)
#[test]
fn the_difference_is_warned_once() {
    let mut findings = 0;
    let warnings = count_warnings("argument 2 changed", || {
        let mut g = graft(sim(), guarded());
        run_scaled(&mut g, 20, |i| i as f32, &Runs::default());
        findings = g.guard_findings().len();
    });
    assert_eq!(findings, 1);
    assert_eq!(warnings, 1, "warned once, when found");
}

// A node recorded with an input copied (a buffer from outside the path) replays when the
// input is an output of its parent instead (the copy reads it there). A guard of such a call
// captures the input copied, as the node does, so the two graphs compare node for node: the
// capture used to take the input in place (managed by the path) and one copy node fewer read
// as a host value baked into the recording. Found by a framework author's trial.
fn copied_input_fed_by_the_path<D: TestDevice>(dev: D) {
    let mut g = graft(dev, guarded());
    let first = g.register("first", FunctionSpec::inference([0]));
    let shift = g.register("shift", FunctionSpec::inference([0]));
    let product = g.register("product", FunctionSpec::default());
    let (w, c) = (input(&mut g, &[0.5; 4]), input(&mut g, &[1.0; 4]));
    let (x, y) = (input(&mut g, &[2.0; 4]), input(&mut g, &[3.0; 4]));
    let runs = Runs::default();
    let call = |g: &mut G<D>, f, a: &graft::Buffer, b: &graft::Buffer| {
        let mut out = Vec::new();
        let o = g.call_into(f, &[a, b], &[], add(&runs), &mut out).unwrap();
        let want: Vec<f32> = read(g, a)
            .iter()
            .zip(read(g, b))
            .map(|(p, q)| p + q)
            .collect();
        let y = out.pop().unwrap().buffer;
        assert_eq!(read(g, &y), want);
        (o, y)
    };
    call(&mut g, first, &w, &x);
    call(&mut g, product, &x, &y);
    call(&mut g, shift, &c, &x);
    g.mark_step_begin();
    let held = call(&mut g, shift, &c, &x);
    // Recorded under shift with both inputs copied (shift's output held, as in the loop).
    let (o, _) = call(&mut g, product, &x, &y);
    assert!(matches!(o, Outcome::Recorded(_)), "{o:?}");
    drop(held);
    for _ in 0..6 {
        let (_, s) = call(&mut g, shift, &c, &x);
        // Fed shift's output of this step: managed by the path, the node copies it.
        let (o, _) = call(&mut g, product, &x, &s);
        assert!(matches!(o, Outcome::Replayed(_)), "{o:?}");
    }
    assert!(g.guard_findings().is_empty(), "{:?}", g.guard_findings());
    assert_eq!(g.stats().eager_runs, 0);
    assert!(g.stats().guards >= 2, "the replays were guarded");
}
device_test!(
    a_copied_input_fed_by_the_path_is_no_difference,
    copied_input_fed_by_the_path
);
