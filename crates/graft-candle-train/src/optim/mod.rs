//! Capturable optimizers: AdamW and SGD with momentum whose step count, bias corrections and
//! learning rate live on the device, so a recorded training step replays correctly.
//!
//! candle-nn's optimizers keep their step counter and learning rate on the host and bake the
//! values of the call being recorded into the graph's kernels as constants (AdamW's bias
//! corrections `1 - beta^t`, the rate of `set_learning_rate`): every replay then repeats the
//! recorded step's update. The optimizers here compute every value that changes between
//! steps from device tensors, which are statics of the step ([`AdamW::statics`]):
//!
//! - the step count `t` is an f32 on the device that the update advances, and the bias
//!   corrections are `1 - exp(t ln beta)`, computed from it;
//! - the learning rate is an f32 on the device: [`AdamW::set_learning_rate`] writes it between
//!   steps (an upload, never inside a step), so a host-side schedule changes it without a new
//!   recording; or [`AdamW::set_schedule`] makes each step compute it on the device from the
//!   step count ([`LrSchedule`]: warmup and cosine decay), with no host write at all;
//! - a step whose gradients are not all finite is skipped on the device: no parameter or
//!   state changes, the step count does not advance, and a skip counter does
//!   ([`AdamW::skipped_steps`]).
//!
//! The learning rate and both counts are one `[4]` f32 device tensor (graft-candle-kernels'
//! optimizer scalars), a static of the step beside the parameters and their state.
//!
//! By default ([`Update::MultiTensor`]) a step runs graft-candle-kernels' multi-tensor update,
//! which updates every parameter in a few launches (an all-finite check of the gradients, the
//! update, a count; more only past 64 parameters on CUDA). [`Update::Elementwise`] is the
//! reference and the fallback: the same update from about twenty elementwise candle ops per
//! parameter, every update a `where` on the device flag.
//!
//! Gradients come from candle's `GradStore` (one backward) or from a [`GradAccumulator`]
//! (several micro-batches), through [`Gradients`]; [`clip_grad_norm`] scales them to a global
//! norm on the device, inside the step.

mod accumulate;
mod adamw;
mod clip;
mod scalars;
mod schedule;
mod sgd;

pub use accumulate::GradAccumulator;
pub use adamw::{AdamW, AdamWConfig};
pub use clip::{ClippedGradients, clip_grad_norm};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

/// How an optimizer step updates the parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Update {
    /// graft-candle-kernels' multi-tensor update: every parameter in a few launches (the
    /// default).
    #[default]
    MultiTensor,
    /// The reference (and fallback): elementwise candle ops per parameter, gated by a device
    /// `where`. The same arithmetic; in bf16 or f16 it rounds after every op where the
    /// multi-tensor update computes in f32 and rounds once.
    Elementwise,
}

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
