//! Diagnostics: dumps, explain, verify mode, the captured-graph view, the memory report, and
//! the cause named when a function's calls never replay (`Graft::churn`).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use graft::{
    Buckets, CallError, Churn, Config, Ctx, Decision, FunctionSpec, InputKind, Outcome, Output,
    RecordReason, VerifyTarget,
};

fn three_steps<D: TestDevice>(g: &mut G<D>, f: graft::FunctionId, x: &graft::Buffer) {
    let runs = Runs::default();
    for _ in 0..3 {
        g.call(f, &[x], &[7], affine(2.0, 1.0, &runs)).unwrap();
    }
}

fn dumps_describe_the_tree<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("decode", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 32]);
    three_steps(&mut g, f, &x);
    let nodes = g.nodes();
    assert_eq!(nodes.len(), 1);
    let n = &nodes[0];
    assert_eq!(
        (
            &*n.function_name,
            n.input_sizes.as_slice(),
            n.keys.as_slice()
        ),
        ("decode", &[128][..], &[7][..])
    );
    assert_eq!(n.inputs, vec![InputKind::Copied]);
    assert_eq!(
        (n.replays, n.graph.kernels),
        (1, 1),
        "one replay; the body launched one kernel"
    );
    assert!(n.footprint_bytes >= 2 * 128, "placeholder and output");
    let text = g.dump_text();
    assert!(
        text.contains("decode(128B copied) keys=[7] replays=1"),
        "{text}"
    );
    let dot = g.dump_dot();
    assert!(
        dot.starts_with("digraph graft {") && dot.trim_end().ends_with('}'),
        "{dot}"
    );
    assert_eq!(dot.matches("->").count(), 1, "{dot}");
    assert!(dot.contains("decode"));
}
device_test!(dumps_describe_the_tree, dumps_describe_the_tree);

fn explain_gives_details<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::inference([0]));
    let w1 = input(&mut g, &[1.0; 4]);
    let w2 = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    for w in [&w1, &w1, &w1, &w2] {
        g.call(f, &[w], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    let log: Vec<_> = g.explain().cloned().collect();
    let kinds: Vec<String> = log.iter().map(|d| d.decision.to_string()).collect();
    assert!(matches!(log[0].decision, Decision::Warmup(_)), "{kinds:?}");
    assert!(matches!(
        log[1].decision,
        Decision::Record(RecordReason::FirstRecording)
    ));
    let changed = log
        .iter()
        .find_map(|d| match &d.decision {
            Decision::Record(RecordReason::StaticAddressChanged {
                position,
                recorded,
                now,
            }) => Some((*position, *recorded, *now)),
            _ => None,
        })
        .expect("the static change is explained");
    assert_eq!(changed, (0, w1.addr().unwrap(), w2.addr().unwrap()));
    let line = log
        .iter()
        .map(|d| d.to_string())
        .find(|l| l.contains("static input address changed"))
        .unwrap();
    assert!(line.contains(&format!("{}", w2.addr().unwrap())), "{line}");
}
device_test!(explain_gives_details, explain_gives_details);

fn verify_mode_passes_on_pure_bodies<D: TestDevice>(dev: D) {
    let mut g = graft(
        dev,
        Config {
            verify_replays: true,
            ..Config::default()
        },
    );
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[3.0; 8]);
    three_steps(&mut g, f, &x);
    assert_eq!(g.stats().replays, 1);
}
device_test!(
    verify_mode_passes_on_pure_bodies,
    verify_mode_passes_on_pure_bodies
);

fn verify_mode_catches_host_state<D: TestDevice>(dev: D) {
    let mut g = graft(
        dev,
        Config {
            verify_replays: true,
            ..Config::default()
        },
    );
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[0.0; 8]);
    // A body that bakes a host counter into the graph: the replay keeps the value of the
    // recording, eager execution does not.
    let counter = Arc::new(AtomicU32::new(1));
    let body = |counter: Arc<AtomicU32>| {
        move |ctx: &mut Ctx<'_, D>| {
            let v = counter.fetch_add(1, Ordering::Relaxed) as f32;
            let out = ctx.alloc(ctx.input(0).len())?;
            ctx.queue().fill_f32(&out, 8, v)?;
            Ok(vec![Output::new(out, 0)])
        }
    };
    g.call(f, &[&x], &[], body(counter.clone())).unwrap();
    g.call(f, &[&x], &[], body(counter.clone())).unwrap();
    let err = g.call(f, &[&x], &[], body(counter.clone())).unwrap_err();
    match &err {
        CallError::VerifyMismatch {
            function,
            what,
            byte,
            ..
        } => {
            assert_eq!((&**function, *what), ("f", VerifyTarget::Output(0)));
            assert!(*byte < 4, "the first float differs");
        }
        other => panic!("expected a verify mismatch, got {other}"),
    }
    assert!(err.to_string().contains("host state"), "{err}");
}
device_test!(
    verify_mode_catches_host_state,
    verify_mode_catches_host_state
);

/// A training step's shape: the body updates a static in place, and (like a framework's
/// closure over its weights) writes the static it captured rather than the ctx's buffer.
/// Verify mode must apply the update once per call, not once for the replay and again for
/// the eager run, and must not report the in-place update as a difference.
fn verify_mode_applies_in_place_updates_once<D: TestDevice>(dev: D) {
    let mut g = graft(
        dev,
        Config {
            verify_replays: true,
            ..Config::default()
        },
    );
    let f = g.register("train", FunctionSpec::inference([1]));
    let grad = input(&mut g, &[0.5; 8]);
    let weight = input(&mut g, &[1.0; 8]);
    for step in 1..=5u8 {
        let captured = weight.clone();
        let out = g
            .call(f, &[&grad, &weight], &[], |ctx: &mut Ctx<'_, D>| {
                let grad = ctx.input(0).clone();
                ctx.queue().add_f32(&captured, &captured, &grad, 8)?;
                let loss = ctx.alloc(32)?;
                ctx.queue().axpb_f32(&loss, &captured, 2.0, 0.0, 8)?;
                Ok(vec![Output::new(loss, 0)])
            })
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        let expected = 1.0 + 0.5 * f32::from(step);
        assert_eq!(read(&g, &weight), vec![expected; 8], "after step {step}");
        assert_eq!(read(&g, &out[0].buffer), vec![2.0 * expected; 8]);
    }
    assert_eq!(g.stats().replays, 3, "steps 3 to 5 replayed, each verified");
}
device_test!(
    verify_mode_applies_in_place_updates_once,
    verify_mode_applies_in_place_updates_once
);

fn memory_report_attributes_held_outputs<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 256]);
    let runs = Runs::default();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            g.call(f, &[&x], &[], affine(1.0, 1.0, &runs))
                .unwrap()
                .pop()
                .unwrap(),
        );
    }
    let report = g.memory_report();
    assert!(!report.mapped.is_empty());
    assert_eq!(
        report.mapped_bytes,
        report.mapped.iter().map(|s| s.1).sum::<usize>()
    );
    let node = held[2].buffer.node().unwrap();
    // The replay overwrote the recording's output: only the replay's output is held by the node.
    assert_eq!(report.held_by_node, vec![(node, 1, 1024)]);
    assert_eq!(report.held_outside_nodes, (1, 1024), "the warmup's output");
    assert!((0.0..=1.0).contains(&report.fragmentation));
}
device_test!(
    memory_report_attributes_held_outputs,
    memory_report_attributes_held_outputs
);

fn outcome_and_node_accessors<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut out = Vec::new();
    g.call_into(f, &[&x], &[], affine(1.0, 0.0, &runs), &mut out)
        .unwrap();
    let Outcome::Recorded(n) = g
        .call_into(f, &[&x], &[], affine(1.0, 0.0, &runs), &mut out)
        .unwrap()
    else {
        panic!("second call records")
    };
    assert_eq!(g.node_function(n), Some(f));
    assert_eq!(g.node_replays(n), Some(0));
    assert_eq!(g.function_name(f), Some("f"));
    assert_eq!(
        g.probe(f, &[&x], &[]).unwrap(),
        None,
        "at the tip, f has no child"
    );
    g.mark_step_begin();
    assert_eq!(
        g.probe(f, &[&x], &[]).unwrap(),
        Some(n),
        "from the roots, the node matches"
    );
}
device_test!(outcome_and_node_accessors, outcome_and_node_accessors);

// The user's bug: the decode position passed as `keys[0]`. Every call is a new signature; the
// ninth is the eighth change in a row, and names the key, once, instead of blaming shapes.
fn churn_names_a_changing_key<D: TestDevice>(dev: D) {
    let mut named = Vec::new();
    // Without the count, so a warning repeated on later calls (9, 10, ...) would be seen.
    let warnings = count_warnings("keys[0] of `decode` changed on each of the last", || {
        let mut g = graft(dev, Config::default());
        let f = g.register("decode", FunctionSpec::inference([1]));
        let x = input(&mut g, &[1.0; 4]);
        let w = input(&mut g, &[0.5; 4]);
        let runs = Runs::default();
        for position in 0..30u64 {
            let outcome = g
                .call_into(f, &[&x, &w], &[position], add(&runs), &mut Vec::new())
                .unwrap();
            assert_eq!(outcome, Outcome::Warmup, "position {position}");
            named.push(g.churn(f).copied());
        }
        assert_eq!(g.stats().replays, 0);
    });
    assert_eq!(warnings, 1, "warned once, on the ninth call");
    assert!(named[..8].iter().all(Option::is_none), "{named:?}");
    assert_eq!(named[8], Some(Churn::Key { index: 0, calls: 8 }));
    assert_eq!(
        named[29],
        Some(Churn::Key {
            index: 0,
            calls: 29
        })
    );
    assert!(
        named[29]
            .unwrap()
            .to_string()
            .starts_with("keys[0] changed on each of the last 29 calls")
    );
    assert!(
        named[29]
            .unwrap()
            .to_string()
            .contains("keep it on the device")
    );
}
device_test!(churn_names_a_changing_key, churn_names_a_changing_key);

// A key that changes on every call explains the signature count: the warning that blames
// shapes is not given as well. Shapes used more than once still get it.
fn churn_replaces_the_shapes_warning<D: TestDevice>(dev: D) {
    let shapes = |dev: D, calls_per_key: u64| {
        count_warnings("pad or bucket", || {
            let mut g = graft(dev, Config::default());
            let f = g.register("f", FunctionSpec::default());
            let x = input(&mut g, &[1.0; 4]);
            let runs = Runs::default();
            for key in 0..12 {
                for _ in 0..calls_per_key {
                    g.call(f, &[&x], &[key], affine(1.0, 0.0, &runs)).unwrap();
                }
            }
            assert_eq!(g.churn(f).is_some(), calls_per_key == 1);
        })
    };
    assert_eq!(shapes(dev.clone(), 1), 0, "the churn is the cause");
    assert_eq!(shapes(dev, 2), 1, "twelve shapes, each called twice");
}
device_test!(
    churn_replaces_the_shapes_warning,
    churn_replaces_the_shapes_warning
);

// An input whose size grows on every call (a sequence fed whole) is named by position.
fn churn_names_a_changing_input_size<D: TestDevice>(dev: D) {
    let mut churn = None;
    let warnings = count_warnings(
        "input 0 of `prefill` changed size on each of the last",
        || {
            let mut g = graft(dev, Config::default());
            let f = g.register("prefill", FunctionSpec::default());
            let runs = Runs::default();
            for n in 1..=12 {
                let x = input(&mut g, &vec![1.0; n]);
                g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
            }
            churn = g.churn(f).copied();
        },
    );
    assert_eq!(warnings, 1);
    assert_eq!(
        churn,
        Some(Churn::InputSize {
            position: 0,
            calls: 11
        })
    );
}
device_test!(
    churn_names_a_changing_input_size,
    churn_names_a_changing_input_size
);

// A static input reallocated before every call re-records every call; the eighth move in a row
// names it.
fn churn_names_a_moving_static<D: TestDevice>(dev: D) {
    let mut churn = None;
    let warnings = count_warnings(
        "input 1 (static) of `decode` moved on each of the last",
        || {
            let mut g = graft(dev, Config::default());
            let f = g.register("decode", FunctionSpec::inference([1]));
            let x = input(&mut g, &[1.0; 4]);
            let runs = Runs::default();
            // Every cache stays allocated, so each one lies at a new address.
            let mut caches = Vec::new();
            let mut outcomes = Vec::new();
            for step in 0..14 {
                caches.push(input(&mut g, &[step as f32; 4]));
                let mut out = Vec::new();
                outcomes.push(
                    g.call_into(f, &[&x, caches.last().unwrap()], &[], add(&runs), &mut out)
                        .unwrap(),
                );
                assert_eq!(read(&g, &out[0].buffer), vec![1.0 + step as f32; 4]);
            }
            assert_eq!(outcomes[0], Outcome::Warmup);
            assert!(
                outcomes[1..]
                    .iter()
                    .all(|o| matches!(o, Outcome::Recorded(_)))
            );
            assert_eq!(g.stats().rerecords.static_address_changed, 12);
            churn = g.churn(f).copied();
        },
    );
    assert_eq!(warnings, 1);
    assert_eq!(
        churn,
        Some(Churn::StaticAddress {
            position: 1,
            calls: 12
        })
    );
}
device_test!(churn_names_a_moving_static, churn_names_a_moving_static);

// What is not churn: two or three keys, sizes or statics taking turns, a key that changes every
// other call, a static that moves every other call (replaying in between), and buckets (each
// new once, `keys[0]` and the sizes changing together).
fn alternating_signatures_are_not_churn<D: TestDevice>(dev: D) {
    // Every churn warning says this, whatever it names.
    let warnings = count_warnings("on each of the last", || {
        let mut g = graft(dev, Config::default());
        let runs = Runs::default();
        let keys = g.register("keys", FunctionSpec::default());
        let sizes = g.register("sizes", FunctionSpec::default());
        let statics = g.register("statics", FunctionSpec::inference([0]));
        let pairs = g.register("pairs", FunctionSpec::default());
        let every_other = g.register("every_other", FunctionSpec::inference([0]));
        let bucketed = g.register(
            "bucketed",
            FunctionSpec::default().buckets(Buckets::new(1..=16).unwrap()),
        );
        let xs: Vec<graft::Buffer> = (1..=16).map(|n| input(&mut g, &vec![1.0; n])).collect();
        let ws: Vec<graft::Buffer> = (0..3).map(|_| input(&mut g, &[1.0; 4])).collect();
        let mut moved = Vec::new();
        for i in 0..48 {
            let turn = i % 3;
            g.call(keys, &[&xs[0]], &[turn as u64], affine(1.0, 0.0, &runs))
                .unwrap();
            g.call(sizes, &[&xs[turn % 2]], &[], affine(1.0, 0.0, &runs))
                .unwrap();
            g.call(statics, &[&ws[turn]], &[], affine(1.0, 0.0, &runs))
                .unwrap();
            moved.push(input(&mut g, &[1.0; 4]));
            let w = if i % 2 == 0 { &ws[0] } else { &moved[i] };
            g.call(every_other, &[w], &[], affine(1.0, 0.0, &runs))
                .unwrap();
            g.call(pairs, &[&xs[0]], &[i as u64 / 2], affine(1.0, 0.0, &runs))
                .unwrap();
            let b = i % 16;
            g.call(
                bucketed,
                &[&xs[b]],
                &[b as u64 + 1],
                affine(1.0, 0.0, &runs),
            )
            .unwrap();
        }
        assert!(g.stats().rerecords.static_address_changed >= 20);
        for f in [keys, sizes, statics, pairs, every_other, bucketed] {
            assert_eq!(g.churn(f), None, "{:?}", g.function_name(f));
        }
        assert!(g.stats().replays > 0);
    });
    assert_eq!(warnings, 0);
}
device_test!(
    alternating_signatures_are_not_churn,
    alternating_signatures_are_not_churn
);
