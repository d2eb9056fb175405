//! Operations with a backward pass, for training: each a candle custom op whose `bwd` runs
//! fused kernels too, so `loss.backward()` uses them; a CUDA kernel and a CPU implementation
//! beside each, launch configurations from shapes only.

mod attention;
mod cross_entropy;
mod dense;
mod rms_norm;
mod rotary;
mod saved;

pub use attention::{causal_attention, causal_attention_fits};
pub use cross_entropy::cross_entropy;
pub use dense::dense;
pub use rms_norm::rms_norm;
pub use rotary::rotary;
