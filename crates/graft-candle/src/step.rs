//! What a call of a step is and returns: the step's id, its outcome, its outputs, and what
//! graft keeps per output of a recorded step.

use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

use crate::refusal::EagerCause;

/// Identifies a registered step.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct StepId(pub(crate) usize);

/// What a call did.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum StepOutcome {
    /// Replayed this recorded node.
    Replayed(graft_core::NodeId),
    /// Recorded this new node (and launched it once).
    Recorded(graft_core::NodeId),
    /// Ran eagerly as a warmup (the recording comes after the warmups).
    Warmup,
    /// Ran eagerly, for this reason.
    Eager(EagerCause),
}

/// What a call returns: the step's outputs, each a candle tensor the caller owns (it stays
/// correct however long it is held), and what was done.
#[derive(Debug)]
pub struct Step {
    /// The outputs, in the order the body returned them.
    pub outputs: Vec<Tensor>,
    /// What the call did.
    pub outcome: StepOutcome,
}

/// A registered step.
#[derive(Debug)]
pub(crate) struct StepInfo {
    pub(crate) name: Arc<str>,
    /// graft's function (`None` when calls run eagerly).
    pub(crate) function: Option<graft_core::FunctionId>,
}

/// What graft keeps per output of a recorded step: enough to allocate the caller's tensor
/// on a replay, without running the body.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OutputMeta {
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape.
    pub shape: Shape,
}
