//! graft-candle-bench: graft-candle's benchmarks (the binaries in `src/bin`: decode, ports,
//! training, generation, serving) and what they share: the common flags and figures, the
//! decode benchmarks' tokens, and the hand-made single CUDA graph they compare against.

pub mod common;
pub mod decode;
#[cfg(feature = "cuda")]
mod handmade;
#[cfg(feature = "cuda")]
pub mod profiler;

#[cfg(feature = "cuda")]
pub use handmade::HandmadeGraph;
