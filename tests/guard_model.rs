//! Guards against a model: any sequence of values of a host scalar the body passes to a
//! kernel (runs of repeats, changes at any call) under any schedule: each call replays or
//! not, and is right or stale, exactly as a model of the schedule written apart from graft's
//! says (a found value makes the signature eager for good: every later call is right).

mod common;

use common::*;
use graft::{Config, Guards, Outcome};
use proptest::prelude::*;

/// What graft should do with a scalar that takes `values` on successive calls, guarded on
/// `guards`' schedule: per call, whether it replays and whether its output is right. A
/// model of the schedule and the outcome, written apart from graft's.
fn model(values: &[u8], guards: Guards) -> Vec<(bool, bool)> {
    let mut out = vec![(false, true); values.len().min(2)];
    let (recorded, mut replays) = (values.get(1).copied(), 0u64);
    let (mut next, mut eager) = (guards.first, false);
    for &v in values.iter().skip(2) {
        if eager {
            // Found: every later call runs eagerly, and is right.
            out.push((false, true));
            continue;
        }
        let call = replays + 1;
        let due = call >= next;
        if due && recorded != Some(v) {
            // Found: this call runs the new capture (right), the signature eagerly after it.
            eager = true;
            out.push((false, true));
            continue;
        }
        if due {
            next = call + call.min(guards.max_interval);
        }
        replays += 1;
        out.push((true, recorded == Some(v)));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn guarded_calls_follow_the_model(
        runs in prop::collection::vec((1u8..4, 1usize..12), 1..12),
        first in 1u64..4,
        max_interval in 1u64..9,
    ) {
        let values: Vec<u8> = runs.iter().flat_map(|&(v, n)| std::iter::repeat_n(v, n)).collect();
        let guards = Guards { first, max_interval };
        let mut g = graft(sim(), Config { guards: Some(guards), ..Config::default() });
        let calls = run_scaled(&mut g, values.len() as u32, |i| f32::from(values[i as usize]), &Runs::default());
        let got: Vec<(bool, bool)> = calls
            .iter()
            .map(|(o, right)| (matches!(o, Outcome::Replayed(_)), *right))
            .collect();
        prop_assert_eq!(got, model(&values, guards), "{:?}", values);
    }
}
