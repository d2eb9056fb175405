//! Guards against a model: any sequence of values of a host scalar the body passes to a
//! kernel (runs of repeats, changes at any call) under any schedule: each call replays or
//! not, and is right or stale, exactly as a model of the schedule written apart from graft's
//! says.

mod common;

use common::*;
use graft::{Config, Guards, Outcome};
use proptest::prelude::*;

/// What graft should do with a scalar that takes `values` on successive calls, guarded on
/// `guards`' schedule: per call, whether it replays and whether its output is right. A
/// model of the schedule and the outcome, written apart from graft's.
fn model(values: &[u8], guards: Guards) -> Vec<(bool, bool)> {
    let mut out = vec![(false, true); values.len().min(2)];
    let (mut recorded, mut replays) = (values.get(1).copied(), 0u64);
    let (mut next, mut always) = (Some(guards.first), false);
    for &v in values.iter().skip(2) {
        let call = replays + 1;
        let due = always || next.is_some_and(|n| call >= n);
        if due && recorded != Some(v) {
            // Replaced: a new recording, guarded on every call from now on.
            (recorded, replays, always) = (Some(v), 0, true);
            out.push((false, true));
            continue;
        }
        if due && !always {
            next = Some(call + call.min(guards.max_interval));
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
