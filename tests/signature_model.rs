//! Signatures under random keys against a model: keys from a small domain (repeated, so they
//! record) and a large one (nearly always new, so they never record and are recycled). Every
//! output is the one of its own key; a key whose signature recorded replays whenever it is
//! called again (recycling never takes a signature a node refers to); and a function holds at
//! most its recorded signatures plus `Config::max_unrecorded_signatures` others (at least 2).

mod common;

use std::collections::HashSet;

use common::*;
use graft::{Config, FunctionSpec, Outcome};
use proptest::prelude::*;

fn run_keys<D: TestDevice>(
    dev: D,
    bound: usize,
    warmups: u32,
    keys: &[u64],
) -> Result<(), TestCaseError> {
    let config = Config {
        max_unrecorded_signatures: bound,
        warmups,
        ..Config::default()
    };
    let mut g = graft(dev, config);
    let f = g.register("step", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut recorded: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    for &key in keys {
        // out = key * x: the output says which key's graph or body produced it (keys stay
        // below 2^24, exact in f32).
        let outcome = g
            .call_into(f, &[&x], &[key], affine(key as f32, 0.0, &runs), &mut out)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(read(&g, &out[0].buffer), vec![key as f32; 4], "key {}", key);
        if recorded.contains(&key) {
            prop_assert!(
                matches!(outcome, Outcome::Replayed(_)),
                "key {} recorded before, but: {:?}",
                key,
                outcome
            );
        }
        if matches!(outcome, Outcome::Recorded(_)) {
            prop_assert!(recorded.insert(key), "key {} recorded twice", key);
        }
        let held = g.signatures(f).unwrap();
        prop_assert!(
            held <= recorded.len() + bound.max(2),
            "{} signatures: {} recorded, bound {}",
            held,
            recorded.len(),
            bound
        );
    }
    prop_assert_eq!(g.stats().nodes, recorded.len());
    Ok(())
}

fn key() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..4,
        2 => 1_000u64..(1 << 24),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn recycling_keeps_what_recorded_sim(
        bound in 0usize..6,
        warmups in 0u32..3,
        keys in prop::collection::vec(key(), 1..200),
    ) {
        run_keys(sim(), bound, warmups, &keys)?;
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn recycling_keeps_what_recorded_cuda(
        bound in 0usize..6,
        warmups in 0u32..3,
        keys in prop::collection::vec(key(), 1..200),
    ) {
        run_keys(cuda(), bound, warmups, &keys)?;
    }
}
