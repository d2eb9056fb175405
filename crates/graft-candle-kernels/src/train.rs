//! Operations for training: multi-tensor optimizer updates ([`adamw_update`], [`sgd_update`])
//! and ops with a backward pass (each a candle custom op whose `bwd` runs fused kernels too, so
//! `loss.backward()` uses them); a CUDA kernel and a CPU implementation beside each, launch
//! configurations from shapes only. Each backward pass is also a function of its own
//! (`rms_norm_backward`, `causal_attention_saved`, ...) for a hand-written backward pass that
//! runs without candle's autograd.

mod attention;
mod cross_entropy;
mod dense;
mod embedding;
mod optim;
mod rms_norm;
mod rotary;
mod saved;
mod weight_grad;

pub use attention::{
    SavedAttention, causal_attention, causal_attention_fits, causal_attention_saved,
};
pub use cross_entropy::{
    ClassifierGrads, classifier_with_grad, cross_entropy, cross_entropy_with_grad,
};
pub(crate) use dense::matmul_layouts;
pub use dense::{dense, dense_sum};
pub use embedding::{embedding, embedding_backward};
pub use optim::{
    AdamWHyper, OPTIM_SCALARS, OptimSlot, SgdHyper, adamw_update, adamw_update_mixed,
    optim_scalars, sgd_update,
};
pub use rms_norm::{rms_norm, rms_norm_backward};
pub use rotary::{rotary, rotary_backward};
pub use weight_grad::{dense_weight_grad, dense_weight_grad_add};
