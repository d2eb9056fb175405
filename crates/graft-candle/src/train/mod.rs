//! Training under graft-candle: a trainable Llama-style model ([`Llama`]) for the training
//! example, tests and benchmark. The optimizers are in [`crate::optim`], the random numbers
//! of dropout in [`crate::random`].

mod model;

pub use model::{Dropout, Llama};
