//! Guards against a model: any sequence of values of a host scalar the body passes to a
//! kernel (runs of repeats, changes at any call) under any schedule: each call replays or
//! not, and is right or stale, exactly as a model of the schedule written apart from graft's
//! says. A found value makes the node guarded on every call (each call captured, or run
//! eagerly where that took less time: the one choice graft makes by timing, which the model
//! takes from graft's outcome and checks is allowed) until two captures in a row equal it;
//! then it replays on the schedule again.

mod common;

use common::*;
use graft::{Config, EagerReason, Guards, Outcome};
use proptest::prelude::*;

/// What a call did, as the model sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Did {
    /// Replayed the recording (right when its value is the recorded one).
    Replay { right: bool },
    /// Ran a capture of the body: the capture's value is right.
    Capture,
    /// Ran eagerly: right.
    Eager,
}

/// The model's guard state.
enum State {
    Scheduled {
        next: u64,
    },
    Changing {
        equal: u32,
        eager_calls: u32,
        probe: u32,
    },
}

/// What graft should do with a scalar that takes `values` on successive calls, guarded on
/// `guards`' schedule. `eager(i)` says whether graft ran call `i` eagerly (its timing choice);
/// the model checks that the choice was open to it.
fn model(values: &[u8], guards: Guards, eager: impl Fn(usize) -> bool) -> Vec<Did> {
    let mut out = vec![Did::Capture; values.len().min(2)];
    let Some(&first) = values.get(1) else {
        return out;
    };
    let (mut recorded, mut replays) = (first, 0u64);
    let mut state = State::Scheduled { next: guards.first };
    for (i, &v) in values.iter().enumerate().skip(2) {
        let call = replays + 1;
        match &mut state {
            State::Scheduled { next } if call < *next => {
                replays += 1;
                out.push(Did::Replay {
                    right: recorded == v,
                });
            }
            State::Scheduled { next } if recorded == v => {
                *next = call + call.min(guards.max_interval);
                replays += 1;
                out.push(Did::Replay { right: true });
            }
            State::Scheduled { .. } => {
                // Found: the capture takes the recording's place (a new node: no replays yet).
                (recorded, replays) = (v, 0);
                state = State::Changing {
                    equal: 0,
                    eager_calls: 0,
                    probe: 8,
                };
                out.push(Did::Capture);
            }
            State::Changing {
                equal,
                eager_calls,
                probe,
            } => {
                if eager(i) {
                    assert!(
                        *equal == 0 && *eager_calls < *probe,
                        "call {i} ran eagerly where a capture was due"
                    );
                    *eager_calls += 1;
                    out.push(Did::Eager);
                } else if recorded == v {
                    *eager_calls = 0;
                    *equal += 1;
                    replays += 1;
                    out.push(Did::Replay { right: true });
                    if *equal >= 2 {
                        state = State::Scheduled { next: call + 1 };
                    }
                } else {
                    if *eager_calls > 0 {
                        *probe = (*probe * 2).min(1024);
                    }
                    (*equal, *eager_calls) = (0, 0);
                    (recorded, replays) = (v, 0);
                    out.push(Did::Capture);
                }
            }
        }
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
        let got: Vec<Did> = calls
            .iter()
            .map(|(o, right)| match o {
                Outcome::Replayed(_) => Did::Replay { right: *right },
                Outcome::Eager(EagerReason::HostValueChanging) if *right => Did::Eager,
                Outcome::Warmup | Outcome::Recorded(_) if *right => Did::Capture,
                other => panic!("{other:?}, right: {right}"),
            })
            .collect();
        let eager = |i: usize| got[i] == Did::Eager;
        prop_assert_eq!(&got, &model(&values, guards, eager), "{:?}", values);
        prop_assert_eq!(g.stats().fallbacks, 0);
    }
}
