//! Guards against host values baked into a recording: when a node's call is guarded
//! (the schedule, one state per node with one transition function), and what a guard that
//! found a difference reports ([`GuardFinding`]). The flow is `record/guard.rs`'s.

use std::fmt;

use crate::device::GraphDifference;
use crate::node_id::NodeId;

/// When graft guards a recording (see [`crate::Config::guards`]): the `first`-th call after
/// the recording captures the body again and compares the capture with the recording, then
/// the calls at twice that distance from the recording, and so on (with `first = 1`: calls 1,
/// 2, 4, 8, ...), never more than `max_interval` calls apart. A value the body passes to a
/// kernel that changes between two guards is wrong from its change until the next guard: at
/// most `max_interval - 1` calls, and at most as many calls as came before it since the
/// recording.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Guards {
    /// The first guarded call after a recording (1: the call right after it). At least 1.
    pub first: u64,
    /// The most calls between two guards. At least 1.
    pub max_interval: u64,
}

impl Default for Guards {
    /// Calls 1, 2, 4, ... after the recording, then every 1024 calls.
    fn default() -> Guards {
        Guards {
            first: 1,
            max_interval: 1024,
        }
    }
}

/// A node's guard state. Only [`transition`] changes it. (A guard that finds a difference
/// ends the node: its signature runs eagerly, see `EagerReason::HostValueBaked`.)
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Guard {
    /// The call that makes the node's replay count `next` is guarded.
    Scheduled { next: u64 },
    /// Not guarded (guards off, in a group, or the device cannot compare).
    Off,
}

/// What a guarded call found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Found {
    /// The capture equals the recording; `call` is the guarded call's number (replays + 1).
    Equal { call: u64 },
    /// The device cannot compare, or the capture failed.
    CannotCompare,
}

/// A guard state that cannot take this event (a node that is not guarded was guarded).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct GuardRefused {
    pub(crate) from: Guard,
    pub(crate) found: Found,
}

impl Guard {
    /// The state a new recording starts in.
    pub(crate) fn start(guards: Option<Guards>) -> Guard {
        match guards {
            Some(g) => Guard::Scheduled {
                next: g.first.max(1),
            },
            None => Guard::Off,
        }
    }

    /// Whether the call after `replays` replays is guarded: the fast path's one compare.
    #[inline]
    pub(crate) fn due(self, replays: u64) -> bool {
        match self {
            Guard::Scheduled { next } => replays + 1 >= next,
            Guard::Off => false,
        }
    }
}

/// Moves `state` on what a guard found; on error `state` is untouched.
pub(crate) fn transition(
    state: &mut Guard,
    found: Found,
    guards: Guards,
) -> Result<(), GuardRefused> {
    let to = match (*state, found) {
        (Guard::Off, _) => {
            return Err(GuardRefused {
                from: *state,
                found,
            });
        }
        (_, Found::CannotCompare) => Guard::Off,
        (Guard::Scheduled { .. }, Found::Equal { call }) => Guard::Scheduled {
            next: call + call.clamp(1, guards.max_interval.max(1)),
        },
    };
    *state = to;
    Ok(())
}

/// A difference a guard found between a recording and a new capture of its body: a value
/// the body computes on the host and passes to the device (a step counter, a learning rate,
/// a position) was baked into the recording. The call that found it ran the new capture, so
/// its result is right; from then on the signature runs eagerly
/// (`EagerReason::HostValueBaked`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct GuardFinding {
    /// The function called.
    pub function: String,
    /// The node whose recording differed.
    pub node: NodeId,
    /// The guarded call, counted from the recording (1: the call right after it).
    pub call: u64,
    /// The difference, as the device reported it.
    pub difference: GraphDifference,
}

impl fmt::Display for GuardFinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (function, call) = (&self.function, self.call);
        match &self.difference {
            GraphDifference::Argument { kernel, index, .. } => write!(
                f,
                "`{kernel}` argument {index} changed between the recording of `{function}` and its call {call} after it ({}): a host value is baked into the recording; hold it in a device tensor or declare it a key",
                self.difference
            ),
            other => write!(
                f,
                "the work of `{function}` changed between its recording and its call {call} after it ({other}): the recording is stale; declare what changes it a key"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(guards: Guards, calls: u64) -> Vec<u64> {
        let mut state = Guard::start(Some(guards));
        (0..calls)
            .filter(|&replays| {
                let due = state.due(replays);
                if due {
                    transition(&mut state, Found::Equal { call: replays + 1 }, guards).unwrap();
                }
                due
            })
            .map(|replays| replays + 1)
            .collect()
    }

    #[test]
    fn guards_double_then_stay_at_the_bound() {
        let g = Guards {
            first: 1,
            max_interval: 8,
        };
        assert_eq!(schedule(g, 40), [1, 2, 4, 8, 16, 24, 32, 40]);
        assert_eq!(
            schedule(Guards::default(), 5000)[..12],
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
        );
        assert_eq!(schedule(Guards::default(), 5000)[12..], [3072, 4096]);
    }

    #[test]
    fn no_gap_exceeds_the_bound_or_the_calls_before_it() {
        for first in 1..5 {
            for max_interval in 1..20 {
                let g = Guards {
                    first,
                    max_interval,
                };
                let calls = schedule(g, 300);
                assert_eq!(calls[0], first);
                for w in calls.windows(2) {
                    let gap = w[1] - w[0];
                    assert!(gap <= max_interval && gap <= w[0], "{g:?}: {w:?}");
                }
            }
        }
    }

    #[test]
    fn cannot_compare_turns_guards_off_for_good() {
        let g = Guards::default();
        let mut s = Guard::start(Some(g));
        transition(&mut s, Found::CannotCompare, g).unwrap();
        assert_eq!(s, Guard::Off);
        assert!(!s.due(0));
        let refused = transition(&mut s, Found::Equal { call: 1 }, g).unwrap_err();
        assert_eq!(refused.from, Guard::Off);
        assert_eq!(s, Guard::Off);
        assert_eq!(Guard::start(None), Guard::Off);
    }
}
