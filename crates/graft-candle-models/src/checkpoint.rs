//! Random checkpoints in the formats candle's models load (safetensors in the Hugging Face
//! layout, GGUF), from a seed, for tests and benchmarks that compare a port with candle's
//! own model on the same weights without downloading any.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Result, Tensor};

use super::quantized_llama::gguf_name;
use super::spec::DecoderSpec;
use crate::rng::SplitMix64;

/// Random weights for every tensor of `spec`'s checkpoint, the same for a seed on every
/// device: norms in [0.5, 1.5), biases in [-0.1, 0.1), the embedding and output projection in
/// [-1, 1) (so greedy decoding has clear winners), query and key projections in
/// ±4/sqrt(columns) (so attention is sharp and depends on positions), other matrices in
/// ±1/sqrt(columns).
pub fn random_weights(
    spec: &DecoderSpec,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let mut rng = SplitMix64::new(seed);
    let mut all = HashMap::new();
    for (name, shape) in spec.checkpoint_tensors() {
        let n = shape.iter().product();
        let values = if name.ends_with("norm.weight") {
            rng.uniform_vec(n, 0.5)
                .into_iter()
                .map(|x| 1.0 + x)
                .collect()
        } else if name.ends_with(".bias") {
            rng.uniform_vec(n, 0.1)
        } else if name.starts_with("model.embed_tokens") || name.starts_with("lm_head") {
            rng.uniform_vec(n, 1.0)
        } else if name.contains("q_proj") || name.contains("k_proj") {
            rng.uniform_vec(n, 4.0 / (shape[1] as f32).sqrt())
        } else {
            rng.uniform_vec(n, 1.0 / (shape[1] as f32).sqrt())
        };
        let t = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        all.insert(name, t);
    }
    Ok(all)
}

/// Writes `weights` as a safetensors file, which candle's `VarBuilder::from_mmaped_safetensors`
/// loads.
pub fn write_safetensors(weights: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    candle_core::safetensors::save(weights, path)
}

/// Writes `weights` of a Llama `spec` (no biases, no per-head norms) as a GGUF file with the
/// metadata candle's `quantized_llama` reads: matrices quantized to `dtype` (on the CPU, one
/// thread per core), norms in f32. Every matrix's row length must be a multiple of `dtype`'s
/// block size (256 for the k-quants, 32 for Q8_0).
pub fn write_gguf(
    spec: &DecoderSpec,
    weights: &HashMap<String, Tensor>,
    dtype: GgmlDType,
    path: &Path,
) -> Result<()> {
    if spec.qkv_bias || spec.o_bias || spec.qk_norm {
        candle_core::bail!("write_gguf writes Llama checkpoints: no biases, no per-head norms");
    }
    let mut jobs = Vec::new();
    for (name, _) in spec.checkpoint_tensors() {
        let Some(gguf) = gguf_name(&name) else {
            candle_core::bail!("no gguf name for {name}");
        };
        let t = weights
            .get(&name)
            .ok_or_else(|| candle_core::Error::Msg(format!("the weights have no {name}")))?;
        let t = t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let target = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
        jobs.push((gguf, t, target));
    }
    let quantized = quantize_all(jobs)?;
    let u = |x: usize| gguf_file::Value::U32(x as u32);
    let metadata = [
        (
            "general.architecture",
            gguf_file::Value::String("llama".into()),
        ),
        ("llama.attention.head_count", u(spec.heads)),
        ("llama.attention.head_count_kv", u(spec.kv_heads)),
        ("llama.block_count", u(spec.layers)),
        ("llama.embedding_length", u(spec.hidden)),
        ("llama.feed_forward_length", u(spec.intermediate)),
        ("llama.rope.dimension_count", u(spec.head_dim)),
        ("llama.context_length", u(spec.rope.max_positions)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            gguf_file::Value::F32(spec.eps as f32),
        ),
        (
            "llama.rope.freq_base",
            gguf_file::Value::F32(spec.rope.theta as f32),
        ),
    ];
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = quantized.iter().map(|(n, q)| (n.as_str(), q)).collect();
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    gguf_file::write(&mut file, &metadata, &tensors)
}

/// Quantizes every job, spread over the machine's cores (candle quantizes on one thread).
fn quantize_all(jobs: Vec<(String, Tensor, GgmlDType)>) -> Result<Vec<(String, QTensor)>> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::with_capacity(jobs.len()));
    std::thread::scope(|scope| {
        for _ in 0..workers.min(jobs.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((name, t, dtype)) = jobs.get(i) else {
                        break;
                    };
                    let q = QTensor::quantize(t, *dtype);
                    done.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((i, name.clone(), q));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    done.sort_by_key(|(i, _, _)| *i);
    done.into_iter()
        .map(|(_, name, q)| Ok((name, q?)))
        .collect()
}
