//! Shapes at serving scale, on every backend: bucket selection and overflow, eager capture of
//! every bucket, the graph budget (admission by use, eviction with held outputs), in-place executable updates
//! (accepted and refused), copy-free inputs that follow a caller's buffer as it moves, and the
//! bound on signatures that never record.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use graft::{
    Bucket, Buckets, CallError, Config, Ctx, Decision, EagerReason, EvictReason, FunctionSpec,
    InputKind, Outcome, Output,
};

const KIB: usize = 1 << 10;

/// The outcome of the last call of `f` at bucket `b` with an input of `b` floats of `v`, and
/// checks out = 2x + 1.
fn call_bucket<D: TestDevice>(
    g: &mut G<D>,
    f: graft::FunctionId,
    b: usize,
    v: f32,
    runs: &Runs,
) -> Result<Outcome, CallError> {
    let x = input(g, &vec![v; b]);
    let mut out = Vec::new();
    let outcome = g.call_into(f, &[&x], &[b as u64], affine(2.0, 1.0, runs), &mut out)?;
    assert_eq!(read(g, &out[0].buffer), host_affine(&vec![v; b], 2.0, 1.0));
    Ok(outcome)
}

// A call names its bucket; sizes above the largest run eagerly with a typed reason; a size that
// is not a bucket, or a missing bucket key, is a clear error.
fn buckets_select_and_overflow<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let buckets = Buckets::new([1, 8, 32]).unwrap();
    let f = g.register("step", FunctionSpec::default().buckets(buckets));
    let plain = g.register("plain", FunctionSpec::default());
    assert_eq!(g.bucket(f, 5).unwrap(), Bucket::Padded(8));
    assert_eq!(
        g.bucket(f, 40).unwrap(),
        Bucket::Above {
            size: 40,
            largest: 32
        }
    );
    assert!(matches!(
        g.bucket(plain, 5),
        Err(CallError::NoBuckets { .. })
    ));
    let runs = Runs::default();
    let outcomes: Vec<Outcome> = (0..3)
        .map(|_| call_bucket(&mut g, f, 8, 1.5, &runs).unwrap())
        .collect();
    assert_eq!(outcomes[0], Outcome::Warmup);
    assert!(matches!(outcomes[1], Outcome::Recorded(_)));
    assert!(matches!(outcomes[2], Outcome::Replayed(_)));

    let nodes = g.stats().nodes;
    let warned = count_warnings("above the function's largest bucket", || {
        for size in [40, 40, 40, 48] {
            let outcome = call_bucket(&mut g, f, size, 2.0, &runs).unwrap();
            assert!(
                matches!(
                    outcome,
                    Outcome::Eager(EagerReason::AboveLargestBucket { size: s, .. }) if s == size as u64
                ),
                "{outcome:?}"
            );
        }
    });
    assert_eq!(warned, 1, "once per function, whatever the sizes");
    assert_eq!(g.stats().nodes, nodes, "an overflow records nothing");
    let last = g.explain().last().unwrap().clone();
    assert_eq!(
        last.decision,
        Decision::Eager(EagerReason::AboveLargestBucket {
            size: 48,
            largest: 32
        })
    );
    assert!(
        last.to_string().contains("above the largest bucket"),
        "{last}"
    );

    let x = input(&mut g, &[1.0; 5]);
    match g.call(f, &[&x], &[5], affine(2.0, 1.0, &runs)) {
        Err(CallError::NotABucket {
            size: 5, bucket: 8, ..
        }) => {}
        other => panic!("expected NotABucket, got {other:?}"),
    }
    assert!(matches!(
        g.call(f, &[&x], &[], affine(2.0, 1.0, &runs)),
        Err(CallError::MissingBucket { .. })
    ));
    // The failed calls left the runtime usable.
    assert!(matches!(
        call_bucket(&mut g, f, 8, 3.0, &runs).unwrap(),
        Outcome::Replayed(_)
    ));
}
device_test!(buckets_select_and_overflow, buckets_select_and_overflow);

/// out = 2x + 1, through `bucket * 64 KiB` of scratch (so the buckets' footprints differ).
fn scratchy<D: TestDevice>(
    bucket: usize,
) -> impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, graft::BodyError> {
    move |ctx| {
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let scratch = ctx.alloc(bucket * 64 * KIB)?;
        ctx.queue().axpb_f32(&scratch, &x, 2.0, 0.0, n)?;
        let out = ctx.alloc(x.len())?;
        ctx.queue().axpb_f32(&out, &scratch, 1.0, 1.0, n)?;
        Ok(vec![Output::new(out, 0)])
    }
}

// Capturing every bucket up front records each one at the root, largest first; they share the
// graph pool, so together they hold what the largest holds alone; afterwards every bucket
// replays.
fn capture_buckets_shares_one_pool<D: TestDevice>(dev: D) {
    let buckets = Buckets::new([1, 2, 4, 8, 16, 32]).unwrap();
    let largest_alone = {
        let mut g = graft(dev.clone(), Config::default());
        let f = g.register(
            "step",
            FunctionSpec::default().buckets(Buckets::new([32]).unwrap()),
        );
        let x = input(&mut g, &[1.0; 32]);
        let report = g
            .capture_buckets(f, |g, b| -> Result<Outcome, CallError> {
                g.call_into(f, &[&x], &[b as u64], scratchy(b), &mut Vec::new())
            })
            .unwrap();
        assert!(matches!(report.buckets[0].outcome, Outcome::Recorded(_)));
        g.stats().pool.peak_mapped
    };
    let mut g = graft(dev, Config::default());
    let f = g.register("step", FunctionSpec::default().buckets(buckets.clone()));
    let xs: Vec<graft::Buffer> = buckets
        .sizes()
        .iter()
        .map(|&b| input(&mut g, &vec![1.0; b]))
        .collect();
    let report = g
        .capture_buckets(f, |g, b| -> Result<Outcome, CallError> {
            let i = buckets.sizes().iter().position(|&s| s == b).unwrap();
            g.call_into(f, &[&xs[i]], &[b as u64], scratchy(b), &mut Vec::new())
        })
        .unwrap();
    let order: Vec<usize> = report.buckets.iter().map(|c| c.bucket).collect();
    assert_eq!(order, vec![32, 16, 8, 4, 2, 1], "largest first");
    for c in &report.buckets {
        assert!(matches!(c.outcome, Outcome::Recorded(_)), "{c:?}");
        assert_eq!(c.calls, 2, "one warmup, then the recording");
    }
    assert_eq!(g.stats().nodes, 6);
    let all = g.stats().pool.peak_mapped;
    assert!(
        all as f64 <= 1.05 * largest_alone as f64,
        "six buckets hold {all} B, the largest alone {largest_alone} B"
    );
    for (i, &b) in buckets.sizes().iter().enumerate() {
        let mut out = Vec::new();
        let o = g
            .call_into(f, &[&xs[i]], &[b as u64], scratchy(b), &mut out)
            .unwrap();
        assert!(matches!(o, Outcome::Replayed(_)), "bucket {b}: {o:?}");
        assert_eq!(read(&g, &out[0].buffer), vec![3.0; b]);
    }
}
device_test!(
    capture_buckets_shares_one_pool,
    capture_buckets_shares_one_pool
);

// With a budget of two graphs, a new signature records once it is used clearly more often
// than the least used graph, and evicts that one, not the least recently used. Outputs a
// caller holds from an evicted graph stay correct until graft reuses their memory, and reading
// them errors after that: never stale. Memory stays flat while the keys in use move on, each
// evicting the graph of an old one.
fn budget_evicts_least_used<D: TestDevice>(dev: D) {
    let config = Config {
        max_graphs: Some(2),
        budget_window: 16,
        ..Config::default()
    };
    let mut g = graft(dev, config);
    let f = g.register("step", FunctionSpec::default().warmups(0));
    let x = input(&mut g, &[1.0; 256]);
    let runs = Runs::default();
    let call = |g: &mut G<D>, k: u64| {
        let mut out = Vec::new();
        let o = g
            .call_into(f, &[&x], &[k], affine(k as f32, 0.0, &runs), &mut out)
            .unwrap();
        assert_eq!(read(g, &out[0].buffer), vec![k as f32; 256], "key {k}");
        (o, out.pop().unwrap().buffer)
    };
    let resident = |g: &G<D>| {
        let mut keys: Vec<u64> = g.nodes().iter().map(|n| n.keys[0]).collect();
        keys.sort_unstable();
        keys
    };
    for _ in 0..3 {
        call(&mut g, 1);
    }
    let (o2, held) = call(&mut g, 2);
    assert!(matches!(o2, Outcome::Recorded(_)));
    // Key 1 is the least recently used graph, key 2 the least used: key 3 needs more calls
    // than key 2 had, by two, and then evicts key 2.
    for _ in 0..2 {
        let (o, _) = call(&mut g, 3);
        assert!(
            matches!(o, Outcome::Eager(EagerReason::NotAdmitted { limit: 2, .. })),
            "{o:?}"
        );
    }
    let (o3, _) = call(&mut g, 3);
    assert!(matches!(o3, Outcome::Recorded(_)), "{o3:?}");
    assert_eq!(resident(&g), vec![1, 3]);
    let stats = g.stats();
    assert_eq!((stats.nodes, stats.evictions), (2, 1), "{stats:?}");
    assert!(
        g.explain().any(|d| matches!(
            d.decision,
            Decision::Evict {
                nodes: 1,
                why: EvictReason::Budget { limit: 2 }
            }
        )),
        "no eviction logged"
    );
    let check_held = |g: &G<D>| match g.read_f32(&held) {
        Ok(v) => assert_eq!(
            v,
            vec![2.0; 256],
            "a held output of an evicted graph is stale"
        ),
        Err(e) => assert!(
            e.to_string().contains("overwritten") || e.to_string().contains("reclaimed"),
            "{e}"
        ),
    };
    check_held(&g);
    // The keys in use move on: each round calls a new key, which takes the place of the
    // least used graph once it is used more (the old keys' counts halve every 16 calls).
    let mut mapped = Vec::new();
    for round in 0..30 {
        for _ in 0..12 {
            call(&mut g, 10 + round);
            check_held(&g);
        }
        g.mark_step_begin();
        mapped.push(g.stats().pool.mapped);
        assert!(g.stats().nodes <= 2, "round {round}: {}", g.dump_text());
        assert!(resident(&g).contains(&(10 + round)), "round {round}");
    }
    let s = g.stats();
    assert_eq!(s.evictions, 31, "{s:?}");
    assert_eq!(s.recordings, 33, "one per key: {s:?}");
    assert_eq!(mapped[5], mapped[29], "pool memory grew: {mapped:?}");
}
device_test!(budget_evicts_least_used, budget_evicts_least_used);

// A per-function budget, and a budget that only the current path fills: the call runs eagerly
// with a typed reason, and later calls still work.
fn budget_limits_and_path<D: TestDevice>(dev: D) {
    let config = Config {
        max_graphs: Some(1),
        ..Config::default()
    };
    let mut g = graft(dev, config);
    let a = g.register("a", FunctionSpec::default().warmups(0));
    let b = g.register("b", FunctionSpec::default().warmups(0));
    let x = input(&mut g, &[1.0; 16]);
    let runs = Runs::default();
    let mut out = Vec::new();
    let warned = count_warnings(
        "the graph budget is full with graphs of the current path",
        || {
            for step in 0..3 {
                let oa = g
                    .call_into(a, &[&x], &[], affine(2.0, 0.0, &runs), &mut out)
                    .unwrap();
                let y = out.pop().unwrap().buffer;
                let ob = g
                    .call_into(b, &[&y], &[], affine(1.0, 1.0, &runs), &mut out)
                    .unwrap();
                assert_eq!(read(&g, &out[0].buffer), vec![3.0; 16]);
                assert!(
                    matches!(ob, Outcome::Eager(_)),
                    "step {step}: b cannot record, a is on the path: {ob:?}"
                );
                assert!(!matches!(oa, Outcome::Eager(_)), "step {step}: {oa:?}");
                g.mark_step_begin();
            }
        },
    );
    assert_eq!(
        warned, 1,
        "b's eager calls are warned once, not on every step"
    );
    assert_eq!(g.stats().over_budget, 3, "{:?}", g.stats());
    assert!(
        g.explain()
            .any(|d| d.decision == Decision::Eager(EagerReason::GraphBudget { limit: 1 }))
    );

    // A per-function budget of one: each new key runs eagerly until it is used more than the
    // graph there, then takes its place.
    let mut g = graft(g.device().clone(), Config::default());
    let f = g.register("f", FunctionSpec::default().warmups(0).max_graphs(1));
    let mut refused = 0;
    for k in 0..4u64 {
        let mut calls = 0;
        loop {
            let o = g
                .call_into(f, &[&x], &[k], affine(k as f32, 1.0, &runs), &mut out)
                .unwrap();
            assert_eq!(read(&g, &out[0].buffer), vec![k as f32 + 1.0; 16]);
            assert_eq!(g.stats().nodes, 1);
            calls += 1;
            match o {
                Outcome::Recorded(_) => break,
                Outcome::Eager(EagerReason::NotAdmitted { limit: 1, .. }) => refused += 1,
                o => panic!("key {k}: {o:?}"),
            }
            assert!(calls < 20, "key {k} never recorded");
        }
        for _ in 0..2 {
            let o = g
                .call_into(f, &[&x], &[k], affine(k as f32, 1.0, &runs), &mut out)
                .unwrap();
            assert!(matches!(o, Outcome::Replayed(_)), "{o:?}");
        }
    }
    // Same sizes, same kernels: every recording reused the evicted executable.
    assert_eq!(g.stats().updates_in_place, 3, "{:?}", g.stats());
    assert_eq!(g.stats().over_budget, refused, "{:?}", g.stats());
    assert!(refused > 0);
}
device_test!(budget_limits_and_path, budget_limits_and_path);

/// out = w * x, with `extra` more kernels on later recordings (out += 0 each).
fn scaled<D: TestDevice>(recordings: &Arc<AtomicUsize>, grow: bool) -> Body<'static, D> {
    let recordings = recordings.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        let (w, x) = (ctx.input(0).clone(), ctx.input(1).clone());
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        ctx.queue().mul_f32(&out, &w, &x, n)?;
        let seen = recordings.fetch_add(1, Ordering::Relaxed);
        if grow {
            for _ in 0..seen {
                ctx.queue().axpb_f32(&out, &out, 1.0, 0.0, n)?;
            }
        }
        Ok(vec![Output::new(out, 0)])
    })
}

// With replace_moved_static, a moved static input replaces its node: the executable is updated
// in place when the new capture has the same topology, and instantiated (refusal logged) when
// it does not. Either way the results are the eager ones.
fn update_in_place<D: TestDevice>(dev: D) {
    for grow in [false, true] {
        let config = Config {
            replace_moved_static: true,
            ..unguarded()
        };
        let mut g = graft(dev.clone(), config);
        let f = g.register("f", FunctionSpec::inference([0]).warmups(0));
        let w1 = input(&mut g, &[2.0; 64]);
        let w2 = input(&mut g, &[3.0; 64]);
        let x = input(&mut g, &[1.5; 64]);
        let recordings = Arc::new(AtomicUsize::new(0));
        let mut out = Vec::new();
        let mut call = |g: &mut G<D>, w: &graft::Buffer, expect: f32| {
            let o = g
                .call_into(f, &[w, &x], &[], scaled(&recordings, grow), &mut out)
                .unwrap();
            assert_eq!(read(g, &out[0].buffer), vec![expect; 64]);
            o
        };
        assert!(matches!(call(&mut g, &w1, 3.0), Outcome::Recorded(_)));
        assert!(matches!(call(&mut g, &w1, 3.0), Outcome::Replayed(_)));
        assert!(matches!(call(&mut g, &w2, 4.5), Outcome::Recorded(_)));
        assert!(matches!(call(&mut g, &w2, 4.5), Outcome::Replayed(_)));
        assert!(matches!(call(&mut g, &w1, 3.0), Outcome::Recorded(_)));
        let s = g.stats();
        assert_eq!(s.nodes, 1, "the re-recording replaced the node");
        assert_eq!(s.evictions, 2);
        if grow {
            assert_eq!((s.updates_in_place, s.update_refusals), (0, 2), "{s:?}");
            assert!(g.explain().any(|d| d.decision
                == Decision::UpdateRefused {
                    reason: graft::UpdateRefusal::TopologyChanged
                }));
        } else {
            assert_eq!((s.updates_in_place, s.update_refusals), (2, 0), "{s:?}");
        }
    }
}
device_test!(update_in_place, update_in_place);

// A large copied input the graph only reads is patched instead of copied: the graph reads the
// caller's buffer, which moves every step; results stay the eager ones. A buffer inside the
// memory the graph writes (its own earlier output) makes the replay copy again.
fn patched_inputs_follow_the_caller<D: TestDevice>(dev: D) {
    const N: usize = 32 * KIB; // 128 KiB: above the 64 KiB default
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let runs = Runs::default();
    let mut out = Vec::new();
    let mut previous = None;
    for step in 0..8 {
        let v = step as f32;
        // A new buffer every step, allocated while the last one is held: it moves.
        let x = input(&mut g, &vec![v; N]);
        g.call_into(f, &[&x], &[], affine(2.0, 1.0, &runs), &mut out)
            .unwrap();
        assert_eq!(
            read(&g, &out[0].buffer),
            vec![2.0 * v + 1.0; N],
            "step {step}"
        );
        previous = Some(x);
    }
    drop(previous);
    let s = g.stats();
    assert_eq!(s.patched_inputs, 1, "{s:?}");
    assert_eq!(s.copied_inputs, 0, "a patched input is never copied: {s:?}");
    assert!(s.copy_sources_updated >= 5, "{s:?}");
    let node = g.nodes().pop().unwrap();
    assert_eq!(node.inputs, vec![InputKind::Patched]);
    assert_eq!(s.guard_differences, 0, "{:?}", g.guard_findings());
    assert!(s.guards > 0, "{s:?}");

    // Feed the output back: it lies in the graph's own footprint, so this replay copies.
    let mut y = out.pop().unwrap().buffer;
    let mut expect = 2.0 * 7.0 + 1.0;
    for _ in 0..3 {
        g.mark_step_begin();
        g.call_into(f, &[&y], &[], affine(2.0, 1.0, &runs), &mut out)
            .unwrap();
        expect = 2.0 * expect + 1.0;
        y = out.pop().unwrap().buffer;
        assert_eq!(read(&g, &y), vec![expect; N]);
    }
    assert!(g.stats().copied_inputs >= 1, "{:?}", g.stats());
}
device_test!(
    patched_inputs_follow_the_caller,
    patched_inputs_follow_the_caller
);

// A key that changes on every call (a position passed as a key) makes a new signature per call.
// Past `Config::max_unrecorded_signatures` the least recently used of those that never recorded
// are recycled: 10,000 calls hold at most 64 of them besides the one that recorded, which
// replays after them all. A recent signature kept its warmup; a recycled one warms up anew.
fn churning_key_keeps_signatures_bounded<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("decode", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let call = |g: &mut G<D>, key: u64| {
        let mut out = Vec::new();
        let o = g
            .call_into(f, &[&x], &[key], affine(key as f32, 0.0, &runs), &mut out)
            .unwrap();
        assert_eq!(read(g, &out[0].buffer), vec![key as f32; 4], "key {key}");
        o
    };
    assert_eq!(call(&mut g, 0), Outcome::Warmup);
    assert!(matches!(call(&mut g, 0), Outcome::Recorded(_)));
    let bound = Config::default().max_unrecorded_signatures;
    assert_eq!(bound, 64);
    for key in 1..=10_000 {
        assert_eq!(call(&mut g, key), Outcome::Warmup, "key {key}");
        assert!(g.signatures(f).unwrap() <= 1 + bound, "key {key}");
    }
    assert_eq!(g.signatures(f), Some(1 + bound));
    assert!(matches!(call(&mut g, 0), Outcome::Replayed(_)));
    assert!(matches!(call(&mut g, 10_000), Outcome::Recorded(_)));
    assert_eq!(call(&mut g, 1), Outcome::Warmup);
    assert_eq!(g.stats().nodes, 2);
}
device_test!(
    churning_key_keeps_signatures_bounded,
    churning_key_keeps_signatures_bounded
);

// A function with more buckets than `Config::max_unrecorded_signatures` keeps a signature per
// bucket: buckets warming up in turn are not recycled, so each records on its second call.
fn every_bucket_keeps_its_signature<D: TestDevice>(dev: D) {
    let config = Config {
        max_unrecorded_signatures: 8,
        ..Config::default()
    };
    let mut g = graft(dev, config);
    let buckets = Buckets::new(1..=20).unwrap();
    let f = g.register("step", FunctionSpec::default().buckets(buckets));
    let runs = Runs::default();
    for round in 0..3 {
        for b in 1..=20 {
            let outcome = call_bucket(&mut g, f, b, 1.0, &runs).unwrap();
            let expected = match round {
                0 => outcome == Outcome::Warmup,
                1 => matches!(outcome, Outcome::Recorded(_)),
                _ => matches!(outcome, Outcome::Replayed(_)),
            };
            assert!(expected, "round {round}, bucket {b}: {outcome:?}");
        }
    }
    assert_eq!(g.signatures(f), Some(20));
}
device_test!(
    every_bucket_keeps_its_signature,
    every_bucket_keeps_its_signature
);
