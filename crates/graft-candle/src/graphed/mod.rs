//! The parts of a graphed call that need no CUDA, compiled and unit-tested in every build and
//! used by the CUDA engine (`cuda/engine.rs`): where a call stands after a failed recording
//! ([`attempt`]), the tensors bound per step ([`bindings`]), the refusals remembered per
//! signature ([`refusals`]), candle errors read as capture refusals ([`classify`]), the
//! signature keys of a call's inputs ([`keys`]) and graft-core's results as graft-candle's
//! ([`outcome`]).

pub(crate) mod attempt;
pub(crate) mod bindings;
pub(crate) mod classify;
pub(crate) mod keys;
pub(crate) mod outcome;
pub(crate) mod refusals;
