//! graft-tensor: a small tensor layer that embeds graft the way a framework would.
//!
//! - [`Tensor`]: a graft [`Buffer`](graft_core::Buffer) with a shape and a dtype ([`DType`]:
//!   f32 or i32), dense and row-major; [`Meta`] is what graft stores per output.
//! - [`Alloc`]: where ops get memory. Inside a registered function's body the
//!   [`Ctx`](graft_core::Ctx) (graft's pool, so the tree can reuse memory); eagerly a
//!   [`Graft`](graft_core::Graft) ([`Graft::alloc`](graft_core::Graft::alloc), its caching
//!   eager pool); [`Keep`] to hold on to everything a raw captured graph uses.
//! - [`Ops`]: the backend, the kernels of a decoder step on raw addresses, implemented for
//!   the simulator ([`graft_sim::SimDevice`]: host loops in recorded closures) and for CUDA
//!   ([`graft_cuda::CudaDevice`]: NVRTC kernels and cuBLAS, through graft-cuda's safe API).
//! - [`ops`]: the tensor operations (embedding, position add, add, layer norm, matmul with
//!   bias, GELU, masked softmax, single-token attention over a KV cache at a device-held
//!   position, KV write, argmax, position increment), shape-checked, on any backend.
//! - [`Decoder`]: the benchmark decoder, stepped through graft ([`Decoder::step_graft`]),
//!   eagerly ([`Decoder::step_eager`]) or as one raw graph ([`Decoder::capture_raw`]).
//!
//! On one backend, graft replay and eager execution run the same kernels on the same data, so
//! they produce identical tokens; the simulator and CUDA agree closely but not bitwise.
#![forbid(unsafe_code)]

mod backend;
mod cuda;
mod decoder;
mod error;
pub mod ops;
mod sim;
mod tensor;

pub use backend::{
    AddNormArgs, AttnDims, Backend, CacheDims, EmbedDims, EmbedNormArgs, GatherDims, LinearArgs,
    MatmulDims, NormDims, Ops, PositionDims, SoftmaxDims,
};
pub use cuda::{KERNEL_NAMES, KERNELS_CU};
pub use decoder::{BUCKETS, Decoder, DecoderConfig, KvState, RawGraph, bucket_for};
pub use error::{Result, TensorError};
pub use tensor::{Alloc, DType, EagerAlloc, Keep, Meta, Tensor, numel};

/// GELU with the tanh approximation on the host, as the kernels compute it (for references).
pub fn gelu_tanh(x: f32) -> f32 {
    sim::gelu_tanh(x)
}
