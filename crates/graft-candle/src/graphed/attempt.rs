//! [`Attempt`]: where one call of a graphed step stands once a recording of its body failed,
//! and [`transition`], the one function that moves it.
//!
//! graft-core may run the body twice in one call: a recording, then, when the capture fails,
//! an eager run. Whether that second run may happen depends on what the failed capture left:
//! a body that freed, inside the capture, a tensor made outside it replaced state it keeps with
//! tensors whose work never ran, and running it again would read them.

use crate::refusal::Uncapturable;

/// Where one call stands. Starts [`Attempt::Clean`] and is moved only by [`transition`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum Attempt {
    /// No recording of this call has failed: the body runs.
    Clean,
    /// A recording failed on `op`; what the failed capture left (cudarc's deferred error) is
    /// not checked yet.
    Refused {
        /// The operation the capture refused.
        op: Uncapturable,
    },
    /// A recording failed on `op` and its leftovers were checked: the body's state is intact
    /// and the body may run again.
    Checked {
        /// The operation the capture refused.
        op: Uncapturable,
    },
    /// A recording failed on `cause` and left the body's state invalid: the body does not run
    /// again in this call.
    StateLost {
        /// The operation the capture refused.
        cause: Uncapturable,
    },
}

impl Attempt {
    /// The operation a failed recording of this call was refused, if one was.
    pub(crate) fn refusal(&self) -> Option<&Uncapturable> {
        match self {
            Attempt::Clean => None,
            Attempt::Refused { op } | Attempt::Checked { op } => Some(op),
            Attempt::StateLost { cause } => Some(cause),
        }
    }
}

/// What happens to a call.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum Event {
    /// A recording's body did this operation, which the capture refused.
    Refused(Uncapturable),
    /// The failed capture's leftovers were checked; `freed_outside` when the refusal or
    /// cudarc's deferred error says the body freed a tensor made outside the step.
    Checked {
        /// Whether the body freed a tensor made outside the step.
        freed_outside: bool,
    },
}

/// A move the lifecycle does not have (a bug in graft-candle's engine, not the caller's).
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
#[error(
    "graft-candle's call lifecycle has no move from {from:?} on {event:?}; this is a bug in graft-candle, please report it with the step's body"
)]
pub(crate) struct AttemptError {
    /// Where the call stood (unchanged).
    pub(crate) from: Attempt,
    /// The event refused.
    pub(crate) event: Event,
}

/// Moves `attempt` on `event`, leaving it untouched when the lifecycle has no such move:
///
/// - a refusal comes to a call with no unchecked refusal and an intact state (`Clean` or
///   `Checked`) and makes it `Refused`;
/// - a check comes to a `Refused` call: `StateLost` when the body freed a tensor made outside
///   the step, `Checked` otherwise.
pub(crate) fn transition(attempt: &mut Attempt, event: Event) -> Result<(), AttemptError> {
    let next = match (&*attempt, &event) {
        (Attempt::Clean | Attempt::Checked { .. }, Event::Refused(op)) => {
            Attempt::Refused { op: op.clone() }
        }
        (Attempt::Refused { op }, Event::Checked { freed_outside }) => {
            if *freed_outside {
                Attempt::StateLost { cause: op.clone() }
            } else {
                Attempt::Checked { op: op.clone() }
            }
        }
        _ => {
            return Err(AttemptError {
                from: attempt.clone(),
                event,
            });
        }
    };
    *attempt = next;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read() -> Uncapturable {
        Uncapturable::HostRead {
            call: "clone_dtoh".into(),
        }
    }

    #[test]
    fn a_refusal_then_a_clean_check_lets_the_body_run_again() {
        let mut attempt = Attempt::Clean;
        assert_eq!(attempt.refusal(), None);
        transition(&mut attempt, Event::Refused(read())).unwrap();
        assert_eq!(attempt, Attempt::Refused { op: read() });
        transition(
            &mut attempt,
            Event::Checked {
                freed_outside: false,
            },
        )
        .unwrap();
        assert_eq!(attempt, Attempt::Checked { op: read() });
        assert_eq!(attempt.refusal(), Some(&read()));
        // A later recording in the same call may be refused again.
        transition(&mut attempt, Event::Refused(read())).unwrap();
        assert!(matches!(attempt, Attempt::Refused { .. }));
    }

    #[test]
    fn a_free_outside_the_step_loses_the_state_with_the_refusal_as_cause() {
        let mut attempt = Attempt::Refused { op: read() };
        transition(
            &mut attempt,
            Event::Checked {
                freed_outside: true,
            },
        )
        .unwrap();
        assert_eq!(attempt, Attempt::StateLost { cause: read() });
        assert_eq!(attempt.refusal(), Some(&read()));
    }

    #[test]
    fn refused_moves_leave_the_attempt_untouched() {
        let checked = Event::Checked {
            freed_outside: false,
        };
        let cases = [
            (Attempt::Clean, checked.clone()),
            (Attempt::Checked { op: read() }, checked.clone()),
            (Attempt::StateLost { cause: read() }, checked),
            (Attempt::Refused { op: read() }, Event::Refused(read())),
            (Attempt::StateLost { cause: read() }, Event::Refused(read())),
        ];
        for (from, event) in cases {
            let mut attempt = from.clone();
            let error = transition(&mut attempt, event.clone()).unwrap_err();
            assert_eq!(attempt, from);
            assert_eq!(error, AttemptError { from, event });
            assert!(error.to_string().contains("bug in graft-candle"), "{error}");
        }
    }
}
