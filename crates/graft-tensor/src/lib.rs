//! graft-tensor: a small tensor layer that embeds graft the way a framework would.
//!
//! - [`Tensor`]: a graft [`Buffer`](graft_core::Buffer) with a shape and a dtype ([`DType`]:
//!   f32 or i32), dense and row-major; [`Meta`] is what graft stores per output.
//! - [`Alloc`]: where ops get memory. Inside a registered function's body the
//!   [`Ctx`](graft_core::Ctx) (graft's pool, so the tree can reuse memory); eagerly a
//!   [`Graft`](graft_core::Graft) ([`Graft::alloc`](graft_core::Graft::alloc), its caching
//!   eager pool); [`Keep`] to hold on to everything a raw captured graph uses.
//! - [`Ops`]: the kernels of a decoder step, held by a value bound to one device that the
//!   caller makes with [`Backend::load_ops`] and keeps (dropping it unloads them): [`SimOps`]
//!   on the simulator (host loops in recorded closures), [`CudaOps`] on CUDA (NVRTC kernels
//!   and cuBLAS, through graft-cuda's safe API).
//! - [`ops`]: the tensor operations the decoder uses (fused embedding + norm, linear with
//!   bias, GELU and residual, residual add + norm, single-token attention over a KV cache at
//!   a device-held position, argmax + position increment, sampling + position increment, a
//!   token loop's bookkeeping) and an elementwise add, shape-checked, on any backend.
//! - [`Decoder`]: the benchmark decoder, stepped through graft ([`Decoder::step_graft`]),
//!   eagerly ([`Decoder::step_eager`]) or as one raw graph ([`Decoder::capture_raw`], which
//!   takes graft-core's token: graft's tests and benchmarks only); on one
//!   device, or one rank of it split tensor-parallel ([`Decoder::new_sharded`]) with the
//!   all-reduces of a [`Collective`] (NCCL on CUDA, an in-process one on the simulator).
//! - Many tokens per launch: [`Decoder::generate_graft`] loops K steps on the device in one
//!   graft call ([`LoopSpec`]: K, end token, [`Sampling`]), [`Decoder::generate_per_step`] is
//!   the same with one call and one host read per token; tokens are picked greedily or
//!   sampled (temperature, top-k) with [`philox`] draws from a generator state on the device.
//!
//! On one backend, graft replay and eager execution run the same kernels on the same data, so
//! they produce identical tokens; the simulator and CUDA agree closely but not bitwise.
#![forbid(unsafe_code)]

mod backend;
mod collective;
mod cuda;
mod decoder;
mod dtype;
mod error;
pub mod ops;
pub mod philox;
pub mod sampling;
mod sim;
mod tensor;

pub use backend::{
    AddNormArgs, ArgmaxArgs, AttentionArgs, AttnDims, Backend, EmbedDims, EmbedNormArgs,
    LinearArgs, LoopArgs, LoopDims, MatmulDims, NormDims, Ops, SampleArgs,
};
pub use collective::Collective;
pub use cuda::{CudaOps, KERNEL_NAMES, KERNELS_CU};
pub use decoder::{
    Decoder, DecoderConfig, Generated, KvState, LoopSpec, RawGraph, default_buckets,
};
pub use dtype::DType;
pub use error::{Result, TensorError};
pub use ops::PAD;
pub use sampling::Sampling;
pub use sim::SimOps;
pub use tensor::{Alloc, EagerAlloc, Keep, Meta, Tensor, numel};

/// GELU with the tanh approximation on the host, as the kernels compute it (for references).
pub fn gelu_tanh(x: f32) -> f32 {
    sim::gelu_tanh(x)
}
