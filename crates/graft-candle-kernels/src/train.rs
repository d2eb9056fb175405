//! Operations with a backward pass, for training: each a candle custom op whose `bwd` runs
//! fused kernels too, so `loss.backward()` uses them; a CUDA kernel and a CPU implementation
//! beside each, launch configurations from shapes only.

mod attention;
mod saved;

pub use attention::{causal_attention, causal_attention_fits};
