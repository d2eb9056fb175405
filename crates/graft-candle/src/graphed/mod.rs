//! The parts of a graphed call that need no CUDA, compiled and unit-tested in every build and
//! used by the CUDA engine (`cuda/engine.rs`): where a call stands after a failed recording
//! ([`attempt`]), the static tensors bound per step ([`statics`]), the refusals remembered per
//! signature ([`refusals`]), candle errors read as capture refusals ([`classify`]), the
//! signature keys of a call's inputs ([`keys`]) and graft-core's results as graft-candle's
//! ([`outcome`]).

pub(crate) mod attempt;
pub(crate) mod classify;
pub(crate) mod keys;
pub(crate) mod outcome;
pub(crate) mod refusals;
pub(crate) mod statics;
