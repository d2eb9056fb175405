//! Capturable optimizers: AdamW and SGD with momentum whose step count, bias corrections and
//! learning rate live on the device, so a recorded training step replays correctly.
//!
//! candle-nn's optimizers keep their step counter and learning rate on the host and bake the
//! values of the call being recorded into the graph's kernels as constants (AdamW's bias
//! corrections `1 - beta^t`, the rate of `set_learning_rate`): every replay then repeats the
//! recorded step's update. The optimizers here compute every value that changes between
//! steps from device tensors, which are statics of the step ([`AdamW::statics`]):
//!
//! - the step count `t` is a `[1]` f32 tensor the update advances on the device, and the bias
//!   corrections are `1 - exp(t ln beta)`, computed from it;
//! - the learning rate is a `[1]` f32 tensor: [`AdamW::set_learning_rate`] writes it between
//!   steps (an upload, never inside a step), so a schedule changes it without a new recording;
//! - a step whose gradients are not all finite is skipped on the device: every update is a
//!   `where` on a device flag, the step count does not advance, and a skip counter does
//!   ([`AdamW::skipped_steps`]).
//!
//! Gradients come from candle's `GradStore` (one backward) or from a [`GradAccumulator`]
//! (several micro-batches), through [`Gradients`].

mod accumulate;
mod adamw;
mod scalars;
mod sgd;

pub use accumulate::GradAccumulator;
pub use adamw::{AdamW, AdamWConfig};
pub use sgd::{Sgd, SgdConfig};

use candle_core::Tensor;
use candle_core::backprop::GradStore;

/// Where an optimizer step finds each parameter's gradient.
pub trait Gradients {
    /// The gradient of `param`, if it has one.
    fn gradient(&self, param: &Tensor) -> Option<&Tensor>;
}

impl Gradients for GradStore {
    fn gradient(&self, param: &Tensor) -> Option<&Tensor> {
        self.get(param)
    }
}
