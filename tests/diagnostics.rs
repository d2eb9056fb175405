//! Diagnostics: dumps, explain, verify mode, the captured-graph view, the memory report.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use graft::{
    CallError, Config, Ctx, Decision, FunctionSpec, InputKind, Outcome, Output, RecordReason,
    VerifyTarget,
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
