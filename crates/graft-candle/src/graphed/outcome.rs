//! graft-core's results of a graphed call as graft-candle's: its errors as [`Error`], its
//! outcomes as [`StepOutcome`].

use std::sync::Arc;

use graft_core::{BodyError, CallError, DeviceOp, EagerReason, Outcome};

use crate::error::Error;
use crate::refusal::EagerCause;
use crate::step::StepOutcome;

/// graft-core's error of a call of `step` as graft-candle's: the body's own candle error as
/// [`Error::Body`], an output tensor candle could not allocate as [`Error::Candle`], a graph
/// launch the device refused as [`Error::Launch`] (with what a body that keeps a tensor
/// causes), anything else as [`Error::Call`].
pub(crate) fn call_error(step: &Arc<str>, error: CallError<candle_core::Error>) -> Error {
    match error {
        CallError::Body {
            source: BodyError::Framework(source),
            ..
        } => Error::Body {
            step: step.clone(),
            source,
        },
        CallError::Destination { error, .. } => Error::Candle {
            step: step.clone(),
            what: "allocating an output tensor",
            source: error,
        },
        CallError::Device { source, .. } if source.op() == DeviceOp::GraphLaunch => Error::Launch {
            step: step.clone(),
            source,
        },
        other => Error::Call(Box::new(other)),
    }
}

/// graft-core's outcome as graft-candle's; `eager` gives the cause of an eager run.
pub(crate) fn step_outcome(
    outcome: Outcome,
    eager: impl FnOnce(EagerReason) -> EagerCause,
) -> StepOutcome {
    match outcome {
        Outcome::Replayed(node) => StepOutcome::Replayed(node),
        Outcome::Recorded(node) => StepOutcome::Recorded(node),
        Outcome::Warmup => StepOutcome::Warmup,
        Outcome::Eager(reason) => StepOutcome::Eager(eager(reason)),
    }
}

#[cfg(test)]
mod tests {
    use graft_core::DeviceError;

    use super::*;

    fn step() -> Arc<str> {
        Arc::from("decode")
    }

    #[test]
    fn body_and_allocation_errors_keep_candles_error_and_name_the_step() {
        let body = CallError::Body {
            function: step(),
            source: BodyError::Framework(candle_core::Error::Msg("shape mismatch".into())),
        };
        let e = call_error(&step(), body);
        assert!(
            matches!(&e, Error::Body { step, .. } if &**step == "decode"),
            "{e}"
        );
        assert!(e.to_string().contains("shape mismatch"), "{e}");
        let alloc = CallError::Destination {
            function: step(),
            index: 2,
            error: candle_core::Error::Msg("out of memory".into()),
        };
        let e = call_error(&step(), alloc);
        assert!(matches!(e, Error::Candle { what, .. } if what.contains("output")));
    }

    #[test]
    fn a_refused_launch_says_what_a_kept_tensor_does_and_the_rest_is_graft_s() {
        let device = |op| CallError::Device {
            function: step(),
            source: DeviceError::Injected { op },
        };
        let e = call_error(&step(), device(DeviceOp::GraphLaunch));
        assert!(matches!(e, Error::Launch { .. }), "{e}");
        assert!(e.to_string().contains("drop everything it makes"), "{e}");
        let e = call_error(&step(), device(DeviceOp::Copy));
        assert!(matches!(e, Error::Call(_)), "{e}");
        let device_body = CallError::Body {
            function: step(),
            source: BodyError::Device(DeviceError::Injected { op: DeviceOp::Read }),
        };
        assert!(matches!(call_error(&step(), device_body), Error::Call(_)));
    }

    #[test]
    fn eager_outcomes_get_their_cause() {
        let cause = |_| EagerCause::Graft(EagerReason::Registered);
        assert_eq!(step_outcome(Outcome::Warmup, cause), StepOutcome::Warmup);
        assert_eq!(
            step_outcome(Outcome::Eager(EagerReason::Registered), cause),
            StepOutcome::Eager(EagerCause::Graft(EagerReason::Registered))
        );
    }
}
