//! graft-candle: CUDA graph trees for candle models (candle 0.11). This crate is the adapter
//! only: a candle step function under graft, the candle device set up for capture, and the
//! device-side generator. The graph-ready model ports and the serving engine are in
//! graft-candle-models, training in graft-candle-train, the benchmarks in graft-candle-bench.
//!
//! A candle user registers a step function (a decode step) and calls it through
//! [`CandleGraft`]: candle tensors go in, candle tensors come out, and the body is ordinary
//! candle code. On a CUDA device graft warms the step up, records it as a CUDA graph per
//! signature (bucket, input shapes, the addresses of the static tensors it uses) and replays
//! it, with graft's tree, diagnostics and eager fallback; on any other device the step runs
//! eagerly with a typed reason ([`EagerCause::NotCuda`]). candle's tensors reach graft-core
//! as memory it does not own (`graft_core::Buffer::external`): no slot cache, no copies
//! outside the graph.
//!
//! The contract, in short (docs/guide.md has a complete example):
//! - make the device with [`device`] (its own stream, candle's event tracking off);
//! - pass the tensors that change every call (tokens) as `inputs`: the body uses them in
//!   place and a replay follows them to their new addresses; pass the tensors the body
//!   captures and uses in place (weights, KV caches, a device-side position) as `statics`:
//!   their addresses are part of the signature;
//! - no host reads and no changing host values inside the body: keep positions on the
//!   device (graft-candle-models' decoder does); a body that reads to the host or uploads uncached host data runs
//!   eagerly from then on, with the operation named ([`Uncapturable`]);
//! - the body drops every tensor it makes before returning (each output is copied, as the
//!   graph's last node for it, into a tensor allocated for the caller before the launch), so
//!   every recorded graph is self-contained: nothing it allocates outlives a launch;
//! - outputs are tensors the caller owns: hold them as long as you like;
//! - random numbers come from [`random::DeviceRng`], whose seed and offset live on the device
//!   (pass its state as a static): a host seed would be frozen into the recorded graph.
//!
//! Two builds, chosen by the `cuda` feature:
//!
//! - Default (the workspace build, CI): candle-core and candle-nn on the CPU only. No CUDA
//!   toolkit is needed; [`device`] returns [`Device::Cpu`] and steps run eagerly.
//! - `cuda`: candle's CUDA backend plus graft-cuda, both with cudarc's `dynamic-linking`
//!   (candle-core requires it). Built in its own invocation, never together with the workspace,
//!   because cargo unifies cudarc's features over one build and the rest of graft loads CUDA
//!   at run time (`dynamic-loading`); the two cannot be mixed. See "Building for candle on
//!   CUDA" in docs/architecture.md:
//!
//!   ```sh
//!   source scripts/cuda-build-env.sh
//!   cargo build -p graft-candle --features cuda
//!   ```

mod bucket;
mod error;
mod looping;
pub mod random;
mod refusal;
mod runtime;
mod step;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use bucket::pad;
pub use candle_core;
#[cfg(feature = "cuda")]
pub use cuda::OutputMeta;
pub use error::Error;
pub use graft_core::{Bucket, Buckets, Churn};
pub use looping::Loops;
pub use refusal::{EagerCause, Uncapturable};
pub use runtime::CandleGraft;
pub use step::{Step, StepId, StepOutcome};

use candle_core::{Device, Result};

/// The candle device graft-candle runs a model on: GPU `ordinal`.
///
/// With the `cuda` feature: a CUDA device on a stream of its own (candle's plain
/// `Device::new_cuda` uses the per-thread default stream, which cannot be captured), with
/// candle's cross-stream event tracking turned off, since all of the device's work stays on
/// that one stream and a capture must not record events. Fails if there is no such GPU.
///
/// Without it: [`Device::Cpu`], whatever the ordinal.
pub fn device(ordinal: usize) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        let device = Device::new_cuda_with_stream(ordinal)?;
        cuda::prepare(device.as_cuda_device()?);
        Ok(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Ok(Device::Cpu)
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn cpu_build_gives_the_cpu_device() {
        assert!(matches!(device(0).unwrap(), Device::Cpu));
    }
}
