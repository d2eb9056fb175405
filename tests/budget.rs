//! The graph budget admits by use: against a model (any call sequence keeps the tree within
//! the budget, every output is its own key's, and a key used clearly more often than the
//! others ends resident), on a skewed trace (the most used keys end resident after few
//! recordings, where evicting the least recently used re-records on most calls), and on two
//! keys used equally (they do not evict each other in turn).

mod common;

use std::collections::BTreeSet;

use common::*;
use graft::{Config, Decision, EagerReason, FunctionId, FunctionSpec, Outcome};
use proptest::prelude::*;

/// Calls `f` with key `key` (out = key * x), checks the output and returns what graft did.
fn call<D: TestDevice>(g: &mut G<D>, f: FunctionId, x: &graft::Buffer, key: u64) -> Outcome {
    let runs = Runs::default();
    let mut out = Vec::new();
    let o = g
        .call_into(f, &[x], &[key], affine(key as f32, 0.0, &runs), &mut out)
        .unwrap();
    assert_eq!(read(g, &out[0].buffer), vec![key as f32; 4], "key {key}");
    o
}

/// The keys of the recorded graphs.
fn resident<D: TestDevice>(g: &G<D>) -> BTreeSet<u64> {
    g.nodes().iter().map(|n| n.keys[0]).collect()
}

fn budget(graphs: usize, window: u64) -> Config {
    Config {
        max_graphs: Some(graphs),
        budget_window: window,
        ..Config::default()
    }
}

/// A generator of the test traces (xorshift64*: the same on every platform).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Key `i` of `keys` with probability proportional to `ratio^i`.
    fn geometric(&mut self, keys: u64, ratio: f64) -> u64 {
        let total: f64 = (0..keys).map(|i| ratio.powi(i as i32)).sum();
        let mut u = self.next() * total;
        for i in 0..keys {
            u -= ratio.powi(i as i32);
            if u < 0.0 {
                return i;
            }
        }
        keys - 1
    }
}

// 10,000 calls over 35 keys, key i drawn with probability proportional to 0.7^i, under a
// budget of 8: the 8 most used keys end resident, after at most 8 + 4 recordings. Evicting
// the least recently used graph instead would re-record on most calls of the rarer keys.
fn skewed_trace_keeps_the_most_used<D: TestDevice>(dev: D) {
    let k = 8;
    let mut g = graft(dev, budget(k, 1024));
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut counts = [0u64; 35];
    for _ in 0..10_000 {
        let key = rng.geometric(35, 0.7);
        counts[key as usize] += 1;
        call(&mut g, f, &x, key);
        assert!(g.stats().nodes <= k);
    }
    let mut by_use: Vec<u64> = (0..35).collect();
    by_use.sort_by_key(|&key| std::cmp::Reverse(counts[key as usize]));
    let most: BTreeSet<u64> = by_use[..k].iter().copied().collect();
    assert_eq!(resident(&g), most, "counts {counts:?}");
    let s = g.stats();
    assert!(s.recordings <= k as u64 + 4, "{s:?}");
    assert!(s.replays > 9_000, "{s:?}");
}
device_test!(
    skewed_trace_keeps_the_most_used,
    skewed_trace_keeps_the_most_used
);

// Two new keys called in turn, as often as each other, beside a key used twice as often: the
// first of the two to beat the cold graph takes its place and the other never evicts it;
// with a budget of one, the key recorded first stays. Each refused call runs eagerly with its
// typed reason.
fn equal_keys_do_not_thrash<D: TestDevice>(dev: D) {
    let mut g = graft(dev.clone(), budget(2, 1024));
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    for _ in 0..20 {
        call(&mut g, f, &x, 1);
    }
    call(&mut g, f, &x, 2);
    call(&mut g, f, &x, 2);
    assert_eq!(resident(&g), BTreeSet::from([1, 2]));
    for _ in 0..500 {
        for key in [1, 3, 1, 4] {
            call(&mut g, f, &x, key);
        }
    }
    let s = g.stats();
    assert_eq!((s.recordings, s.evictions), (3, 1), "{s:?}");
    let now = resident(&g);
    assert!(
        now.contains(&1) && now.len() == 2 && !now.contains(&2),
        "{now:?}"
    );
    let refused = g.explain().any(|d| {
        matches!(
            d.decision,
            Decision::Eager(EagerReason::NotAdmitted { limit: 2, .. })
        )
    });
    assert!(refused, "no refusal logged");

    let mut g = graft(dev, budget(1, 1024));
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    for _ in 0..500 {
        call(&mut g, f, &x, 1);
        call(&mut g, f, &x, 2);
    }
    let s = g.stats();
    assert_eq!((s.recordings, s.evictions), (1, 0), "{s:?}");
    assert_eq!(resident(&g), BTreeSet::from([1]));
}
device_test!(equal_keys_do_not_thrash, equal_keys_do_not_thrash);

/// Runs `prefix`, then `rounds` rounds in each of which `hot` is called twice and every other
/// key of `0..keys` once, under a budget of `graphs` graphs and a window of 64 calls.
fn run_model<D: TestDevice>(
    dev: D,
    graphs: usize,
    keys: u64,
    prefix: &[u64],
    hot: u64,
) -> Result<(), TestCaseError> {
    let mut g = graft(dev, budget(graphs, 64));
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let mut calls = prefix.to_vec();
    for _ in 0..64 {
        calls.push(hot);
        calls.extend(0..keys);
    }
    for key in calls {
        let runs = Runs::default();
        let mut out = Vec::new();
        g.call_into(f, &[&x], &[key], affine(key as f32, 0.0, &runs), &mut out)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(read(&g, &out[0].buffer), vec![key as f32; 4], "key {}", key);
        prop_assert!(g.stats().nodes <= graphs, "{} graphs", g.stats().nodes);
    }
    // Over the rounds `hot` was used twice as often as any other key: it ends resident,
    // and replays.
    prop_assert!(resident(&g).contains(&hot), "{:?}", resident(&g));
    prop_assert!(matches!(call(&mut g, f, &x, hot), Outcome::Replayed(_)));
    Ok(())
}

/// A budget of 1 to 4 graphs, 2 to 7 keys in the rounds, a prefix of up to 300 calls of keys
/// below 8 (some used only there), and the hot key.
fn case() -> impl Strategy<Value = (usize, u64, Vec<u64>, u64)> {
    (1usize..5, 2u64..8).prop_flat_map(|(graphs, keys)| {
        let prefix = prop::collection::vec(0u64..8, 0..300);
        (Just(graphs), Just(keys), prefix, 0..keys)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn budget_model_sim((graphs, keys, prefix, hot) in case()) {
        run_model(sim(), graphs, keys, &prefix, hot)?;
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn budget_model_cuda((graphs, keys, prefix, hot) in case()) {
        run_model(cuda(), graphs, keys, &prefix, hot)?;
    }
}
