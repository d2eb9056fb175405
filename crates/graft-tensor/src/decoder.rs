//! The benchmark decoder: a pre-LayerNorm transformer decoder (learned positions, GELU-tanh
//! MLP, fp32) with random weights from a fixed seed, decoding one token per sequence per step
//! against a static KV cache.
//!
//! One step: tokens `[bucket]` (i32) and the position (an i32 device scalar) in, the greedy
//! next tokens `[bucket]` out; the step also writes the new keys and values at the position
//! and increments it on the device, so step N's output tokens are step N+1's input and the
//! host never reads anything. Shapes never change with the position (attention covers cache
//! rows `0..=pos` by reading `pos` on the device), so one recorded graph serves every step.
//!
//! Batches are padded to a bucket (graft's [`Buckets`], by default [`default_buckets`]);
//! each bucket has its own [`KvState`] (several may share one cache arena,
//! [`Decoder::cache_for`]) and is its own signature key, hence its own branch of graft's
//! tree. The same step runs three ways: [`Decoder::step_graft`] (one registered function per
//! step, body = the whole step), [`Decoder::step_eager`] (the same ops, no graft), and
//! [`Decoder::capture_raw`] (the same step captured once as a plain graph with the device's
//! sealed capture calls, no tree; only for holders of graft-core's test token, graft's tests
//! and benchmarks). Sampled steps and many tokens per launch (a device-side loop,
//! [`Decoder::generate_graft`]) are in `generate.rs`.
//!
//! The files: `config.rs` (sizes), `weights.rs` (the parameters' layout, init and
//! tensor-parallel split), `model.rs` (the [`Decoder`], its states and tokens, a step through
//! graft or eagerly), `forward.rs` (the forward pass and token pick), `state.rs` ([`KvState`]),
//! `raw.rs` (the raw-graph baseline, [`RawGraph`]), `generate.rs` (token loops).

mod config;
mod forward;
mod generate;
mod model;
mod raw;
mod state;
mod weights;

pub use config::{DecoderConfig, default_buckets};
pub use generate::{Generated, LoopSpec};
pub use model::Decoder;
pub use raw::RawGraph;
pub use state::KvState;
