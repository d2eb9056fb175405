//! Operations for training: multi-tensor optimizer updates ([`adamw_update`], [`sgd_update`])
//! and ops with a backward pass (each a candle custom op whose `bwd` runs fused kernels too, so
//! `loss.backward()` uses them); a CUDA kernel and a CPU implementation beside each, launch
//! configurations from shapes only.

mod optim;
// The values a forward pass saves for its backward pass: for the ops with a backward pass,
// which come next.
#[allow(dead_code)]
mod saved;

pub use optim::{
    AdamWHyper, OPTIM_SCALARS, OptimSlot, SgdHyper, adamw_update, optim_scalars, sgd_update,
};
