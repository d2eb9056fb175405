//! graft-candle-kernels: fused operations for candle models (candle 0.11), forward only.
//!
//! Each operation is a candle custom op (`CustomOp1/2/3`) with a CUDA kernel and a CPU
//! implementation beside it (so CI tests every op without a GPU). The CUDA kernels (feature
//! `cuda`) are compiled with NVRTC once per process, loaded into candle's device once per
//! device, and launched on the device's stream. Every launch configuration (grid, block,
//! shared memory) depends only on tensor shapes, never on tensor data, so one CUDA-graph
//! recording serves every decode position. Inputs may be f32, bf16 or f16; the kernels compute
//! in f32 and round once to the input dtype.
//!
//! - [`decode_attention`]: one decode step of grouped-query attention over a static KV cache,
//!   split over the cache ("flash-decoding"), reading keys and values only up to each
//!   sequence's position (and from its sliding window);
//! - [`add_rms_norm`]: the residual add and the RMS norm of a decoder layer in one launch;
//! - [`swiglu`]: `silu(gate) * up` in one launch.
//!
//! Errors are [`KernelError`]s inside `candle_core::Error::Wrapped`.

mod attention;
mod check;
mod error;
mod norm;
#[cfg(feature = "cuda")]
mod nvrtc;
mod swiglu;

pub use attention::{CHUNK, decode_attention, decode_attention_fits};
pub use error::KernelError;
pub use norm::add_rms_norm;
pub use swiglu::swiglu;
