//! graft-candle-train: training under graft-candle. Capturable optimizers ([`optim`]: AdamW,
//! SGD with momentum, gradient accumulation) whose changing values live on the device, and
//! [`Trainable`], graft-candle-models' decoder with its weights as candle `Var`s, trained by
//! a whole-sequence forward pass and an explicit backward program ([`Trainable::gradients`];
//! candle's autograd is the reference and the fallback). The random numbers of dropout come
//! from graft-candle's `random::DeviceRng`.

mod model;
pub mod optim;

pub use graft_candle_models::Dropout;
pub use model::{Backward, StepGradients, Trainable};
