//! The tokens-equal check of every port, shared by the CPU tests (tests/ports.rs, in CI) and
//! the GPU tests (tests/gpu.rs): random weights written in the checkpoint format (safetensors,
//! or GGUF for the quantized Llama), loaded both by candle-transformers' own model and by the
//! port, then greedy decoding from the same prompts, candle's model eagerly and the port
//! through graft-candle (graphed on a CUDA device). The generated tokens must be equal, and
//! in f32 the logits too, within a tolerance that no wrong rotation, mask or norm meets (random
//! weights leave greedy tokens insensitive to some such bugs: the logits are not).

use std::path::Path;

use candle_core::quantized::{GgmlDType, gguf_file};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as ct;
use graft_candle::{Buckets, CandleGraft, StepOutcome};
use graft_candle_models::{
    Decoder, DecoderSpec, checkpoint, llama, mistral, mixtral, quantized_llama, qwen2, qwen2_moe,
    qwen3, qwen3_moe,
};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A port and the small config it is checked at.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Port {
    Llama2,
    /// Llama 3 with its rope scaling, at wavelengths that exercise all three branches.
    Llama3,
    Mistral,
    /// Qwen2 with tied embeddings (its checkpoint has no `lm_head.weight`).
    Qwen2,
    Qwen3,
    Q4K,
    Q8_0,
    /// Mixtral: every block's MLP 4 experts, 2 per token.
    Mixtral,
    /// Qwen3-MoE: experts in every second block (6, 3 per token, not renormalized), the
    /// gated MLP in the others.
    Qwen3Moe,
    /// Qwen2-MoE: experts in every block (5, 2 per token, renormalized) beside the shared
    /// expert, which runs on a side stream on CUDA.
    Qwen2Moe,
}

/// Generated tokens compared per sequence.
pub(crate) const GENERATED: usize = 64;
const PROMPT: usize = 4;
const MAX_SEQ: usize = 96;

/// candle-transformers' own model, one eager step at a time: the logits `[batch, vocab]` f32.
type Eager = Box<dyn FnMut(&Tensor, usize) -> candle_core::Result<Tensor>>;

pub(crate) fn llama_config(llama3: bool) -> TestResult<ct::llama::Config> {
    let scaling = if llama3 {
        r#""rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_type": "llama3"},
           "tie_word_embeddings": true,"#
    } else {
        ""
    };
    let json = format!(
        r#"{{"hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, {scaling} "max_position_embeddings": 128}}"#
    );
    let cfg: ct::llama::LlamaConfig = serde_json::from_str(&json)?;
    Ok(cfg.into_config(false))
}

const QWEN: &str = r#""vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "sliding_window": 4096, "max_window_layers": 2,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": false,
    "hidden_act": "silu""#;

/// Writes `spec`'s random weights in `dtype` as a safetensors file in `dir` and maps it.
fn safetensors(
    spec: &DecoderSpec,
    dtype: DType,
    device: &Device,
    dir: &Path,
) -> TestResult<VarBuilder<'static>> {
    let weights = checkpoint::random_weights(spec, 7, dtype, &Device::Cpu)?;
    let path = dir.join("model.safetensors");
    checkpoint::write_safetensors(&weights, &path)?;
    mapped(dir, dtype, device)
}

/// The checkpoint [`safetensors`] wrote in `dir`, mapped again (for another device).
fn mapped(dir: &Path, dtype: DType, device: &Device) -> TestResult<VarBuilder<'static>> {
    let path = dir.join("model.safetensors");
    // SAFETY: the file is this test's own, written once and never modified while mapped.
    Ok(unsafe { VarBuilder::from_mmaped_safetensors(&[path], dtype, device)? })
}

/// The most sequences a test decodes at once.
const MAX_BATCH: usize = 8;

/// candle-transformers' model and the port, loaded from one checkpoint written in `dir`.
pub(crate) fn load(
    port: Port,
    dtype: DType,
    device: &Device,
    dir: &Path,
) -> TestResult<(Eager, Decoder)> {
    let argmax = |logits: Tensor| logits.flatten_from(1)?.to_dtype(DType::F32);
    Ok(match port {
        Port::Llama2 | Port::Llama3 => {
            let cfg = llama_config(matches!(port, Port::Llama3))?;
            let vb = safetensors(&llama::spec(&cfg), dtype, device, dir)?;
            let model = ct::llama::Llama::load(vb.clone(), &cfg)?;
            let mut cache = ct::llama::Cache::new(true, dtype, &cfg, device)?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos, &mut cache)?));
            (eager, llama::load(vb, &cfg)?)
        }
        Port::Mistral => {
            let cfg: ct::mistral::Config = serde_json::from_str(
                r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "sliding_window": 4096, "head_dim": 16}"#,
            )?;
            let vb = safetensors(&mistral::spec(&cfg), dtype, device, dir)?;
            let mut model = ct::mistral::Model::new(&cfg, vb.clone())?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, mistral::load(vb, &cfg)?)
        }
        Port::Qwen2 => {
            let cfg: ct::qwen2::Config =
                serde_json::from_str(&format!("{{{QWEN}, \"tie_word_embeddings\": true}}"))?;
            let vb = safetensors(&qwen2::spec(&cfg, true), dtype, device, dir)?;
            let mut model = ct::qwen2::ModelForCausalLM::new(&cfg, vb.clone())?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, qwen2::load(vb, &cfg)?)
        }
        Port::Qwen3 => {
            let cfg: ct::qwen3::Config = serde_json::from_str(&format!(
                "{{{QWEN}, \"tie_word_embeddings\": false, \"head_dim\": 32, \"attention_bias\": true}}"
            ))?;
            let vb = safetensors(&qwen3::spec(&cfg), dtype, device, dir)?;
            let mut model = ct::qwen3::ModelForCausalLM::new(&cfg, vb.clone())?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, qwen3::load(vb, &cfg)?)
        }
        Port::Mixtral => {
            let json = r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "sliding_window": 4096, "num_experts_per_tok": 2,
                "num_local_experts": 4, "use_flash_attn": false}"#;
            let theirs: ct::mixtral::Config = serde_json::from_str(json)?;
            let cfg: mixtral::Config = serde_json::from_str(json)?;
            let vb = safetensors(&mixtral::spec(&cfg), dtype, device, dir)?;
            let mut model = ct::mixtral::Model::new(&theirs, vb.clone())?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, mixtral::load(vb, &cfg)?)
        }
        Port::Qwen3Moe => {
            let cfg: ct::qwen3_moe::Config = serde_json::from_str(&format!(
                "{{{QWEN}, \"tie_word_embeddings\": false, \"head_dim\": 32, \"attention_bias\": false,
                   \"decoder_sparse_step\": 2, \"moe_intermediate_size\": 48,
                   \"num_experts_per_tok\": 3, \"num_experts\": 6, \"norm_topk_prob\": false}}"
            ))?;
            let vb = safetensors(&qwen3_moe::spec(&cfg), dtype, device, dir)?;
            let eager: Eager = if cfg!(feature = "cuda") {
                // Built for CUDA, candle's model runs its fused MoE kernel, which takes f16
                // and bf16 only (on any device): the oracle is then the port eagerly on the
                // CPU, which the CPU build checks against candle's model (tests/ports.rs).
                let port = qwen3_moe::load(mapped(dir, dtype, &Device::Cpu)?, &cfg)?;
                let cache = port.new_cache(MAX_BATCH, MAX_SEQ)?;
                Box::new(move |x, _| port.forward(&cache, &x.squeeze(1)?.to_device(&Device::Cpu)?))
            } else {
                let mut model = ct::qwen3_moe::ModelForCausalLM::new(&cfg, vb.clone())?;
                Box::new(move |x, pos| argmax(model.forward(x, pos)?))
            };
            (eager, qwen3_moe::load(vb, &cfg)?)
        }
        Port::Qwen2Moe => {
            let cfg: ct::qwen2_moe::Config = serde_json::from_str(&format!(
                "{{{QWEN}, \"tie_word_embeddings\": false, \"decoder_sparse_step\": 1,
                   \"moe_intermediate_size\": 40, \"shared_expert_intermediate_size\": 96,
                   \"num_experts_per_tok\": 2, \"num_experts\": 5, \"norm_topk_prob\": true}}"
            ))?;
            let vb = safetensors(&qwen2_moe::spec(&cfg), dtype, device, dir)?;
            let mut model = ct::qwen2_moe::Model::new(&cfg, vb.clone())?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, qwen2_moe::load(vb, &cfg)?)
        }
        Port::Q4K | Port::Q8_0 => {
            let quant = if matches!(port, Port::Q4K) {
                GgmlDType::Q4K
            } else {
                GgmlDType::Q8_0
            };
            // Row lengths must be multiples of the k-quants' 256-wide blocks.
            let cfg = ct::llama::Config {
                hidden_size: 256,
                intermediate_size: 512,
                ..llama_config(false)?
            };
            let spec = llama::spec(&cfg);
            let weights = checkpoint::random_weights(&spec, 7, DType::F32, &Device::Cpu)?;
            let path = dir.join("model.gguf");
            checkpoint::write_gguf(&spec, &weights, quant, &path)?;
            let mut file = std::fs::File::open(&path)?;
            let content = gguf_file::Content::read(&mut file)?;
            let mut model =
                ct::quantized_llama::ModelWeights::from_gguf(content, &mut file, device)?;
            let mut file = std::fs::File::open(&path)?;
            let content = gguf_file::Content::read(&mut file)?;
            let port = quantized_llama::load(&content, &mut file, device)?;
            let eager: Eager = Box::new(move |x, pos| argmax(model.forward(x, pos)?));
            (eager, port)
        }
    })
}

/// The prompt of sequence `row`.
fn prompt(row: usize, vocab: usize) -> Vec<u32> {
    (0..PROMPT)
        .map(|i| ((5 + 31 * row + 7 * i) % vocab) as u32)
        .collect()
}

/// What a tokens-equal run saw.
#[derive(Debug)]
pub(crate) struct Compared {
    /// Calls of the port's step that replayed a recorded graph.
    pub(crate) replays: usize,
    /// Calls of the port's step in all.
    pub(crate) calls: usize,
    /// The largest difference between the two models' logits over all steps.
    pub(crate) max_logit_diff: f32,
    /// Teacher-forced ports: tokens on which the two chose differently, each where candle's
    /// top two logits were within the tolerance.
    pub(crate) near_ties: usize,
    /// What graft's guards found (none expected: the ports keep no host value in a kernel).
    pub(crate) findings: Vec<String>,
}

/// The margin of a row's best logit over its second best.
fn top_two_gap(row: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > first {
            (first, second) = (x, first);
        } else if x > second {
            second = x;
        }
    }
    first - second
}

/// The greedy token of every row of `logits`, and the rows.
fn greedy(logits: &Tensor) -> TestResult<(Vec<u32>, Vec<Vec<f32>>)> {
    let rows = logits.to_vec2::<f32>()?;
    let best = rows
        .iter()
        .map(|r| {
            let top = r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
            top.map_or(0, |(i, _)| i as u32)
        })
        .collect();
    Ok((best, rows))
}

impl Port {
    /// Whether both models are fed candle's tokens (the quantized ports): candle's quantized
    /// matmul quantizes its activations to 8 bits, so the two models' logits differ by up to a
    /// few tenths, and a free-running greedy sequence parts at the first near tie. Fed the
    /// same tokens, every step still compares, and a different choice must be a near tie.
    fn teacher_forced(self) -> bool {
        matches!(self, Port::Q4K | Port::Q8_0)
    }

    /// How far the logits may differ in f32. The two models add in other orders (the port
    /// attends over the whole cache, masked), which moves logits by about 1e-6; candle's
    /// quantized matmul quantizes its activations to 8 bits, where such a difference can flip
    /// a rounding and grow to a few tenths, so the quantized ports are held to their tokens.
    fn logit_tolerance(self) -> f32 {
        match self {
            Port::Q4K | Port::Q8_0 => 1.0,
            _ => 1e-3,
        }
    }
}

/// Greedy decoding of `batch` sequences with `port` in `dtype` on `device`: candle's model
/// eagerly, the port through graft-candle. Fails unless every generated token is equal.
pub(crate) fn tokens_equal(
    port: Port,
    batch: usize,
    dtype: DType,
    device: &Device,
) -> TestResult<Compared> {
    let dir = tempfile::tempdir()?;
    let (mut eager, model) = load(port, dtype, device, dir.path())?;
    let vocab = model.spec().vocab;
    let cache = model.new_cache(batch, MAX_SEQ)?;
    let mut graft = CandleGraft::new(device)?;
    let step = graft.register_bucketed("decode", Buckets::new([batch])?);
    let prompts: Vec<Vec<u32>> = (0..batch).map(|r| prompt(r, vocab)).collect();
    let (mut theirs, mut ours) = (vec![Vec::new(); batch], vec![Vec::new(); batch]);
    let (mut their_next, mut our_next) = (Vec::new(), Vec::new());
    let mut compared = Compared {
        replays: 0,
        calls: 0,
        max_logit_diff: 0.0,
        near_ties: 0,
        findings: Vec::new(),
    };
    let forced = port.teacher_forced();
    for t in 0..PROMPT + GENERATED - 1 {
        // The prompt's token at `t`, then each model's own last token (candle's, for both,
        // when the port is teacher-forced).
        let feed = |next: &[u32]| -> Vec<u32> {
            let token = |(r, p): (usize, &Vec<u32>)| p.get(t).copied().unwrap_or_else(|| next[r]);
            prompts.iter().enumerate().map(token).collect()
        };
        let their_in = feed(&their_next);
        let our_in = if forced {
            their_in.clone()
        } else {
            feed(&our_next)
        };
        let same_input = their_in == our_in;
        let their_logits;
        (their_next, their_logits) =
            greedy(&eager(&Tensor::new(their_in, device)?.unsqueeze(1)?, t)?)?;
        let out = model.decode_logits(&mut graft, step, &cache, &Tensor::new(our_in, device)?)?;
        compared.calls += 1;
        compared.replays += usize::from(matches!(out.outcome, StepOutcome::Replayed(_)));
        let our_logits;
        (our_next, our_logits) = greedy(&out.outputs[0])?;
        // Logits are comparable only for the same input (free-running sequences part after
        // a different token).
        if same_input {
            for (a, b) in their_logits
                .iter()
                .flatten()
                .zip(our_logits.iter().flatten())
            {
                compared.max_logit_diff = compared.max_logit_diff.max((a - b).abs());
            }
        }
        if t + 1 < PROMPT {
            continue;
        }
        for r in 0..batch {
            if forced && their_next[r] != our_next[r] {
                // Allowed only where candle's own choice is within the noise of a tie.
                let gap = top_two_gap(&their_logits[r]);
                if gap >= port.logit_tolerance() {
                    return Err(format!(
                        "{port:?} ({dtype:?}, batch {batch}): sequence {r} at generated token {}: candle chose {} by a margin of {gap}, the port {}",
                        theirs[r].len(),
                        their_next[r],
                        our_next[r]
                    )
                    .into());
                }
                compared.near_ties += 1;
                ours[r].push(their_next[r]);
            } else {
                ours[r].push(our_next[r]);
            }
            theirs[r].push(their_next[r]);
        }
    }
    for r in 0..batch {
        let first = theirs[r].iter().zip(&ours[r]).position(|(a, b)| a != b);
        if let Some(at) = first {
            return Err(format!(
                "{port:?} ({dtype:?}, batch {batch}): sequence {r} differs from candle-transformers' model at generated token {at}:\n  candle: {:?}\n  port:   {:?}",
                theirs[r], ours[r]
            )
            .into());
        }
        assert_eq!(theirs[r].len(), GENERATED);
    }
    assert_eq!(
        cache.positions()[..batch],
        vec![(PROMPT + GENERATED - 1) as u32; batch]
    );
    if let Some(g) = graft.graft() {
        compared.findings = g.guard_findings().iter().map(|f| f.to_string()).collect();
    }
    if dtype == DType::F32 && compared.max_logit_diff > port.logit_tolerance() {
        return Err(format!(
            "{port:?} (batch {batch}): the logits differ from candle-transformers' model by up to {}",
            compared.max_logit_diff
        )
        .into());
    }
    Ok(compared)
}
