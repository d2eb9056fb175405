//! graft-candle-models: graph-ready ports of the models candle users run, stepped under
//! graft-candle, with their static KV cache, generation on the device and a serving engine.
//! The ports load candle-transformers' own configs and checkpoints: [`llama`] (Llama 2 and
//! 3), [`mistral`], [`qwen2`], [`qwen3`], [`quantized_llama`] (GGUF), and the mixtures of
//! experts [`mixtral`], [`qwen2_moe`] and [`qwen3_moe`] (routed on the device); [`serve`] is a
//! continuous-batching engine over any of them. A Llama also splits over several GPUs,
//! one process each ([`Shard`], [`llama::load_sharded`]: tensor parallelism).
//!
//! candle-transformers' models keep their KV cache as tensors that grow with `Tensor::cat`
//! and are replaced every step, and take the position as a host `usize` that cuts the rotary
//! tables with `narrow`: a recorded graph of such a step would replay the first step's
//! position and free memory it does not own. Every port here instead builds one [`Decoder`]
//! over the shared [`KvCache`]: keys and values preallocated and written in place at a
//! position held on the device, rotary rows and the mask picked at that position on the
//! device, and the position advanced on the device. A step records once per bucket and
//! replays at every position. The weights load from the same files, by the same names, as
//! candle's model.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use graft_candle::{Buckets, CandleGraft};
//! use graft_candle_models::llama;
//!
//! let device = graft_candle::device(0)?;
//! # let (cfg, files): (llama::Config, Vec<std::path::PathBuf>) = unimplemented!();
//! let vb = unsafe {
//!     candle_nn::VarBuilder::from_mmaped_safetensors(&files, candle_core::DType::BF16, &device)?
//! };
//! let model = llama::load(vb, &cfg)?;
//! let cache = model.new_cache(8, 2048)?;
//! let mut graft = CandleGraft::new(&device)?;
//! let decode = graft.register_bucketed("decode", Buckets::new([1, 8])?);
//! let tokens = candle_core::Tensor::new(&[1u32, 1, 1, 1, 1, 1, 1, 1], &device)?;
//! let next = model.decode(&mut graft, decode, &cache, &tokens)?.outputs.remove(0);
//! # let _ = next; Ok(()) }
//! ```

mod cache;
pub mod checkpoint;
mod decoder;
mod generate;
pub mod llama;
pub mod mistral;
pub mod mixtral;
mod moe;
pub mod paged;
mod prefill;
mod proj;
pub mod quantized_llama;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;
mod rng;
mod rope;
mod sampled;
mod sequence;
pub mod serve;
mod shard;
mod spec;
pub mod speculate;

pub use cache::KvCache;
pub use decoder::Decoder;
pub use generate::{GenerateSpec, Generation, Sampling};
pub use prefill::{PREFILL_SEGMENTS, PrefillSegment};
pub use sequence::{Dropout, SequenceGradients, SequenceKernels};
pub use shard::{Collective, Shard};
pub use spec::{Arch, DecoderSpec, Llama3Scaling, MoeNames, MoeSpec, RopeSpec, RopeStyle};
