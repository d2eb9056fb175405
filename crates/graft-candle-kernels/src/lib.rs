//! graft-candle-kernels: fused operations for candle models (candle 0.11): for decoding and
//! (with a fused backward pass) training, and multi-tensor optimizer updates.
//!
//! Each operation is a candle custom op (`CustomOp1/2/3`; `InplaceOp1` for the optimizer
//! updates) with a CUDA kernel and a CPU implementation beside it; the training ops' backward
//! passes are custom ops too, deterministic (no atomics), checked in CI against candle's
//! autograd of the unfused composition (so CI tests every op without
//! a GPU). The CUDA kernels (feature `cuda`) are compiled with NVRTC once per process, loaded
//! into candle's device once per device, and launched on the device's stream. Every launch
//! configuration (grid, block, shared memory) depends only on tensor shapes, never on tensor
//! data, so one CUDA-graph recording serves every decode position (and every training step).
//! Inputs may be f32, bf16 or f16; the kernels compute in f32 and round once to the input
//! dtype.
//!
//! - [`decode_attention`]: one decode step of grouped-query attention over a static KV cache,
//!   split over the cache ("flash-decoding"), reading keys and values only up to each
//!   sequence's position (and from its sliding window);
//! - [`rope_store`]: the rotary embedding of a decode step's queries and keys at each
//!   sequence's device position (after Qwen3's per-head norms), with the keys and values
//!   written into the cache, in one launch;
//! - [`add_rms_norm`]: the residual add and the RMS norm of a decoder layer in one launch;
//! - [`swiglu`]: `silu(gate) * up` in one launch;
//! - [`decode_step`]: a dense decoder's whole decode step for a few rows as one chain of
//!   kernels without a tensor made between two of them, each launched as a programmatic
//!   dependent of the one before (compute capability 9.0+), the norms fused into the
//!   projections after them and the residual adds into the projections before them;
//! - [`argmax_last`]: a greedy step's token choice (the first largest of each row) in one
//!   launch;
//! - [`sample_rows`]: each row's token drawn with its own temperature, top-k, top-p, seed and
//!   draw index ([`SampleParams`], read from a device tensor, so a batch of requests with
//!   different parameters shares one recorded step), greedy rows at `argmax_last`'s cost, in
//!   one launch;
//! - [`linear`], [`linear_cat`] and [`linear_swiglu`]: a decode step's few rows through one
//!   weight, through up to three side by side (query, key and value), or through a gate and an
//!   up weight with SwiGLU, each in one matrix-vector kernel that reads the weights in place
//!   once, the biases or SwiGLU in the same launch; [`dense`] (one GEMM) for more rows;
//! - [`route`] and [`Experts`]: a mixture-of-experts MLP with its routing on the device: each
//!   token's top-k experts and weights in one launch, then its chosen SiLU-gated experts,
//!   found through a device table of their weights' addresses, in two (three expert-major);
//! - [`SharedExpert`]: Qwen2-MoE's shared expert with its sigmoid gate in three launches,
//!   which [`SharedExpert::beside`] runs on a [`SideStream`] while the routed experts run on
//!   the device's stream (a fork and a join inside a CUDA-graph capture);
//! - [`dense`], [`embedding`], [`rms_norm`], [`rotary`], [`cross_entropy`]: the rest of a
//!   decoder's training forward pass, each with a fused backward pass (one GEMM forward and
//!   two backward for `dense`; one kernel forward and one or two backward for the others;
//!   [`swiglu`] has its backward too);
//! - [`causal_attention`]: causal self-attention of whole sequences (training, prefill) with
//!   its backward pass, both fused flash-attention style (an online softmax over key tiles,
//!   the row log-sum-exps kept for the backward pass, nothing of size seq × seq stored),
//!   deterministic, with grouped-query heads; `loss.backward()` runs the fused gradient
//!   kernels.
//! - [`adamw_update`] and [`sgd_update`]: an optimizer step over every parameter of a model in
//!   a few launches (an all-finite check of the gradients, the update, a count), in place,
//!   the learning rate and step counts read from a device tensor ([`optim_scalars`]), a step
//!   with a non-finite gradient skipped on the device; [`adamw_update_mixed`] for f32 masters
//!   of 16-bit working copies, which it rewrites in the same pass.
//!
//! Errors are [`KernelError`]s inside `candle_core::Error::Wrapped`.

mod argmax;
mod attention;
mod check;
mod cpu;
mod error;
mod linear;
mod moe;
mod norm;
#[cfg(feature = "cuda")]
mod nvrtc;
mod pages;
mod rope;
mod sample;
mod shared;
mod side;
mod step;
mod swiglu;
mod train;

pub use argmax::argmax_last;
pub use attention::{
    CHUNK, decode_attention, decode_attention_fits, decode_attention_paged, prefill_attention,
    prefill_attention_paged,
};
pub use error::KernelError;
pub use linear::{MATVEC_ROWS, MAX_PARTS, TENSOR_ROWS, linear, linear_cat, linear_swiglu};
pub use moe::{Experts, MAX_EXPERTS, Routing, route};
pub use norm::add_rms_norm;
#[cfg(feature = "cuda")]
pub use nvrtc::{Args, Kernels, set_programmatic};
pub use rope::{QkNorm, RopeStyle, rope_store, rope_store_paged};
pub use sample::{SAMPLE_INVALID, SAMPLE_WORDS, SampleParams, sample_rows};
pub use shared::SharedExpert;
pub use side::SideStream;
pub use step::{
    StepLayer, StepModel, StepReduce, StepShard, decode_step, decode_step_fits, decode_step_paged,
};
pub use swiglu::{swiglu, swiglu_backward};
pub use train::{
    AdamWHyper, ClassifierGrads, OPTIM_SCALARS, OptimSlot, SavedAttention, SgdHyper, adamw_update,
    adamw_update_mixed, causal_attention, causal_attention_fits, causal_attention_saved,
    classifier_with_grad, cross_entropy, cross_entropy_with_grad, dense, dense_sum,
    dense_weight_grad, dense_weight_grad_add, embedding, embedding_backward, optim_scalars,
    rms_norm, rms_norm_backward, rotary, rotary_backward, sgd_update,
};
