//! Guards against host values baked into a recording: when a node's call is guarded
//! (the schedule, one state per node with one transition function), and what a guard that
//! found a difference reports ([`GuardFinding`]). The flow is `record/guard.rs`'s.

use std::fmt;
use std::time::Instant;

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

impl Guards {
    /// Every call guarded: no value is ever stale, at the cost of a capture per call. For
    /// tests that must catch every baked host value.
    pub fn every_call() -> Guards {
        Guards {
            first: 1,
            max_interval: 1,
        }
    }
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

/// A node's guard state. Only [`transition`] changes it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Guard {
    /// The call that makes the node's replay count `next` is guarded.
    Scheduled { next: u64 },
    /// A guard found a host value changed, and the capture took the node's place: every call
    /// is guarded from then on (captured, compared, and the capture takes the place again if
    /// it differs) or runs eagerly, whichever way took less time per call; never a blind
    /// replay. Back to [`Guard::Scheduled`] after [`SETTLE`] equal captures in a row.
    Changing(Changing),
    /// Not guarded (guards off, in a group, or the device cannot compare).
    Off,
}

/// Equal captures in a row after which a changing node replays on the schedule again.
pub(crate) const SETTLE: u32 = 2;

/// Eager calls of a changing node between two captures that look whether its values settled:
/// the first gap, doubled after each capture that finds them changed again, up to
/// [`PROBE_MAX`].
const PROBE_FIRST: u32 = 8;
const PROBE_MAX: u32 = 1024;

/// How a changing node's call ran.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Way {
    Capture,
    Eager,
}

/// How a changing node's calls run (see [`Guard::Changing`]). Each way is timed by what it
/// costs the caller's loop: from the start of a call that ran that way to the start of the
/// node's next call. A capture's GPU work starts only when its capture ends, where eager
/// work overlaps the host's; with a loop that waits for its results (reads a loss), the
/// interval holds the GPU's time too, which a call's own host time would not.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Changing {
    /// Captures in a row that equalled the recording.
    equal: u32,
    /// The last measured interval after a capture and after an eager call, in nanoseconds;
    /// 0 before the first.
    capture_ns: u64,
    eager_ns: u64,
    /// Eager calls since the last capture, and how many run before the next one.
    eager_calls: u32,
    probe: u32,
    /// When the node's last call began, and how it ran.
    last: (Instant, Way),
}

impl Changing {
    /// Whether the next call runs eagerly instead of capturing: its values changed at the
    /// last capture, eager calls cost less than captures (or were never timed), and the next
    /// look at whether the values settled is not due.
    pub(crate) fn runs_eagerly(&self) -> bool {
        self.equal == 0
            && (self.eager_ns == 0 || self.eager_ns < self.capture_ns)
            && self.eager_calls < self.probe
    }

    /// The state after a call that began `at` and ran `way`: the interval since the last call
    /// is what the last call's way cost.
    fn called(self, at: Instant, way: Way) -> Changing {
        let (since, last_way) = self.last;
        let ns = u64::try_from(at.saturating_duration_since(since).as_nanos()).unwrap_or(u64::MAX);
        let (capture_ns, eager_ns) = match last_way {
            Way::Capture => (ns, self.eager_ns),
            Way::Eager => (self.capture_ns, ns),
        };
        Changing {
            capture_ns,
            eager_ns,
            last: (at, way),
            ..self
        }
    }
}

/// What a guarded call found; `at` is when the call began.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Found {
    /// The capture equals the recording; `call` is the guarded call's number (replays + 1).
    Equal { call: u64, at: Instant },
    /// A value the device can patch (a kernel argument, a copy or memset parameter) changed:
    /// the capture took the node's place.
    Changed { at: Instant },
    /// A changing node's call ran eagerly.
    RanEagerly { at: Instant },
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
            Guard::Changing(_) => true,
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
    let refused = GuardRefused {
        from: *state,
        found,
    };
    let to = match (*state, found) {
        (Guard::Off, _) => return Err(refused),
        (_, Found::CannotCompare) => Guard::Off,
        (Guard::Scheduled { .. }, Found::Equal { call, .. }) => Guard::Scheduled {
            next: call + call.clamp(1, guards.max_interval.max(1)),
        },
        (Guard::Scheduled { .. }, Found::Changed { at }) => Guard::Changing(Changing {
            equal: 0,
            capture_ns: 0,
            eager_ns: 0,
            eager_calls: 0,
            probe: PROBE_FIRST,
            last: (at, Way::Capture),
        }),
        (Guard::Scheduled { .. }, Found::RanEagerly { .. }) => return Err(refused),
        (Guard::Changing(c), Found::Equal { call, .. }) if c.equal + 1 >= SETTLE => {
            Guard::Scheduled { next: call + 1 }
        }
        (Guard::Changing(c), Found::Equal { at, .. }) => Guard::Changing(Changing {
            equal: c.equal + 1,
            eager_calls: 0,
            ..c.called(at, Way::Capture)
        }),
        (Guard::Changing(c), Found::Changed { at }) => Guard::Changing(Changing {
            equal: 0,
            // A capture after eager calls found the values changed again: look less often.
            probe: if c.eager_calls > 0 {
                (c.probe * 2).min(PROBE_MAX)
            } else {
                c.probe
            },
            eager_calls: 0,
            ..c.called(at, Way::Capture)
        }),
        (Guard::Changing(c), Found::RanEagerly { at }) => Guard::Changing(Changing {
            eager_calls: c.eager_calls + 1,
            ..c.called(at, Way::Eager)
        }),
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
                    let found = Found::Equal {
                        call: replays + 1,
                        at: Instant::now(),
                    };
                    transition(&mut state, found, guards).unwrap();
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
        let found = Found::Equal {
            call: 1,
            at: Instant::now(),
        };
        let refused = transition(&mut s, found, g).unwrap_err();
        assert_eq!(refused.from, Guard::Off);
        assert_eq!(s, Guard::Off);
        assert_eq!(Guard::start(None), Guard::Off);
    }

    /// Instants `ms` milliseconds after a fixed start.
    fn at(ms: u64) -> Instant {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *START.get_or_init(Instant::now) + std::time::Duration::from_millis(ms)
    }

    #[test]
    fn a_changed_value_guards_every_call_until_it_settles() {
        let g = Guards::default();
        let mut s = Guard::start(Some(g));
        transition(&mut s, Found::Changed { at: at(0) }, g).unwrap();
        assert!(s.due(5) && s.due(6), "every call is guarded");
        // Eager is not timed yet: the next calls run eagerly until it is.
        let Guard::Changing(c) = s else { panic!() };
        assert!(c.runs_eagerly());
        // The capture's call cost 10 ms (to the next call); the first eager call, 30.
        transition(&mut s, Found::RanEagerly { at: at(10) }, g).unwrap();
        let Guard::Changing(c) = s else { panic!() };
        assert!(c.runs_eagerly(), "eager is not timed yet");
        transition(&mut s, Found::RanEagerly { at: at(40) }, g).unwrap();
        let Guard::Changing(c) = s else { panic!() };
        assert!(!c.runs_eagerly(), "eager took longer than a capture");
        // SETTLE equal captures in a row: back on the schedule.
        transition(
            &mut s,
            Found::Equal {
                call: 3,
                at: at(50),
            },
            g,
        )
        .unwrap();
        assert!(matches!(s, Guard::Changing(_)));
        transition(
            &mut s,
            Found::Equal {
                call: 4,
                at: at(60),
            },
            g,
        )
        .unwrap();
        assert_eq!(s, Guard::Scheduled { next: 5 });
        // Only a changing node runs eagerly.
        assert_eq!(
            transition(&mut s, Found::RanEagerly { at: at(70) }, g).map_err(|r| r.from),
            Err(s)
        );
    }

    #[test]
    fn a_value_that_keeps_changing_runs_eagerly_and_looks_less_often() {
        let g = Guards::default();
        let mut s = Guard::start(Some(g));
        transition(&mut s, Found::Changed { at: at(0) }, g).unwrap();
        // A capture's call costs 3 ms, an eager one 1 ms (the first capture began at 0).
        let (mut now, mut captures) = (3, Vec::new());
        for call in 0..6000u32 {
            let Guard::Changing(c) = s else { panic!() };
            let (found, cost) = if c.runs_eagerly() {
                (Found::RanEagerly { at: at(now) }, 1)
            } else {
                captures.push(call);
                (Found::Changed { at: at(now) }, 3)
            };
            transition(&mut s, found, g).unwrap();
            now += cost;
        }
        // Eager calls between two captures: 8, then 16, 32, ... up to 1024.
        assert_eq!(captures[0], 8);
        let gaps: Vec<u32> = captures.windows(2).map(|w| w[1] - w[0] - 1).collect();
        assert_eq!(gaps[..6], [16, 32, 64, 128, 256, 512]);
        assert!(gaps[6..].iter().all(|&gap| gap == 1024), "{gaps:?}");
    }

    #[test]
    fn captures_win_where_they_cost_less_per_call() {
        let g = Guards::default();
        let mut s = Guard::start(Some(g));
        transition(&mut s, Found::Changed { at: at(0) }, g).unwrap();
        // A capture's call costs 2 ms, an eager one 5 ms: after timing both, it captures.
        let (mut now, mut eager) = (2, 0);
        for _ in 0..50 {
            let Guard::Changing(c) = s else { panic!() };
            let (found, cost) = if c.runs_eagerly() {
                eager += 1;
                (Found::RanEagerly { at: at(now) }, 5)
            } else {
                (Found::Changed { at: at(now) }, 2)
            };
            transition(&mut s, found, g).unwrap();
            now += cost;
        }
        assert_eq!(eager, 2, "two eager calls, to time them");
    }
}
