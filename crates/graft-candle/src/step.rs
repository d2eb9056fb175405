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

/// The tensors of one call: its inputs, statics and keys, and the caller's output tensors
/// (`call_into`) if it gave them.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) inputs: &'a [&'a Tensor],
    pub(crate) statics: &'a [&'a Tensor],
    pub(crate) keys: &'a [u64],
    pub(crate) into: Option<&'a [Tensor]>,
}

/// A registered step.
#[derive(Debug)]
pub(crate) struct StepInfo {
    pub(crate) name: Arc<str>,
    /// graft's function (`None` when calls run eagerly).
    pub(crate) function: Option<graft_core::FunctionId>,
}

/// What graft keeps per output of a recorded step: enough to allocate the caller's tensor
/// on a replay, without running the body. Cloned on every replay, so the shape is shared.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OutputMeta {
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape.
    pub shape: Arc<Shape>,
}

/// A tensor's dtype and shape (and whether it is not contiguous), or "missing": what
/// [`crate::Error::OutputMismatch`] says of an output and of the tensor given for it.
pub(crate) fn describe(t: Option<&Tensor>) -> String {
    t.map_or_else(
        || "missing".to_owned(),
        |t| {
            let layout = if t.is_contiguous() {
                ""
            } else {
                ", not contiguous"
            };
            format!("{:?} {:?}{layout}", t.dtype(), t.shape())
        },
    )
}
