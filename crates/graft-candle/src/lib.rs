//! graft-candle: CUDA graph trees for candle models (candle 0.11).
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
//!   device (see [`llama`]); a body that reads to the host or uploads uncached host data runs
//!   eagerly from then on, with the operation named ([`Uncapturable`]);
//! - the body drops every tensor it makes before returning (each output is copied, as the
//!   graph's last node for it, into a tensor allocated for the caller before the launch), so
//!   every recorded graph is self-contained: nothing it allocates outlives a launch;
//! - outputs are tensors the caller owns: hold them as long as you like;
//! - random numbers come from [`random::DeviceRng`], whose seed and offset live on the device
//!   (pass its state as a static): a host seed would be frozen into the recorded graph.
//!
//! Tensor parallelism (one process per GPU): [`cuda::TpComm`] makes a rank's NCCL
//! communicator on candle's stream and sums candle tensors over the ranks in place (captured
//! into the step's graph like any kernel); [`CandleGraft::join`] makes the runtime vote with
//! the other ranks on every recording. graft-candle-models' `Shard` splits a Llama this way.
//!
//! Two builds, chosen by the `cuda` feature, with one API: every public type and function
//! exists in both, and the feature only chooses the backend behind them (in this file, and for
//! the random-number kernels in [`random`]):
//!
//! - Default (the workspace build, CI): candle-core and candle-nn on the CPU only. No CUDA
//!   toolkit is needed; [`device`] returns [`Device::Cpu`], steps run eagerly, and the CUDA
//!   figures of [`cuda`] and `TpComm::init_rank` refuse with [`Error::NoCuda`] (so no
//!   `TpComm` exists in this build).
//! - `cuda`: candle's CUDA backend plus graft-cuda, both with cudarc's `dynamic-linking`
//!   (candle-core requires it). Built in its own invocation, never together with the workspace,
//!   because cargo unifies cudarc's features over one build and the rest of graft loads CUDA
//!   at run time (`dynamic-loading`); the two cannot be mixed. See "Building for candle on
//!   CUDA" in docs/design-notes.md:
//!
//!   ```sh
//!   source scripts/cuda-build-env.sh
//!   cargo build -p graft-candle --features cuda
//!   ```

mod bucket;
mod diagnostics;
mod error;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod graphed;
mod looping;
mod memory;
pub mod random;
mod refusal;
mod runtime;
mod step;

// The backend, chosen here (and, for the random-number kernels, in `random`): with the `cuda`
// feature, graft over candle's CUDA stream; without it, a stand-in with the same items whose
// engine never opens (every runtime runs eagerly) and whose CUDA figures refuse with
// `Error::NoCuda`. The parts of a graphed call that need no CUDA (`graphed`, above) are
// compiled and tested in both builds and used only by the CUDA engine, hence its `allow`.
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda.rs"]
pub mod cuda;
// Tensor parallelism's communicator without the `nccl` feature (which links libnccl): one that
// cannot be made, in the CPU build and in a CUDA build without it.
#[cfg(not(feature = "nccl"))]
mod no_nccl;

pub use bucket::pad;
pub use candle_core;
pub use diagnostics::Diagnostics;
pub use error::Error;
pub use graft_core::{Bucket, Buckets, Churn};
pub use looping::Loops;
pub use refusal::{EagerCause, Uncapturable};
pub use runtime::CandleGraft;
pub use step::{OutputMeta, Step, StepId, StepOutcome};

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
    cuda::device(ordinal)
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn cpu_build_gives_the_cpu_device() {
        assert!(matches!(device(0).unwrap(), Device::Cpu));
    }
}
