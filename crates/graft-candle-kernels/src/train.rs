//! Operations for training: multi-tensor optimizer updates ([`adamw_update`], [`sgd_update`])
//! and ops with a backward pass (each a candle custom op whose `bwd` runs fused kernels too, so
//! `loss.backward()` uses them); a CUDA kernel and a CPU implementation beside each, launch
//! configurations from shapes only.

mod attention;
mod cross_entropy;
mod dense;
mod embedding;
mod optim;
mod rms_norm;
mod rotary;
mod saved;

pub use attention::{causal_attention, causal_attention_fits};
pub use cross_entropy::cross_entropy;
pub use dense::dense;
pub(crate) use dense::matmul_layouts;
pub use embedding::embedding;
pub use optim::{
    AdamWHyper, OPTIM_SCALARS, OptimSlot, SgdHyper, adamw_update, optim_scalars, sgd_update,
};
pub use rms_norm::rms_norm;
pub use rotary::rotary;
