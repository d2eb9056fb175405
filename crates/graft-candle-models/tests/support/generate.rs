//! The generation checks shared by the CPU tests (tests/generate.rs, in CI) and the GPU tests
//! (tests/gpu/generate.rs): K tokens per launch in a device loop draw exactly the tokens of
//! one launch per token, greedy and sampled from the same seed, and stop at the end token.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as ct;
use graft_candle::random::DeviceRng;
use graft_candle::{CandleGraft, StepOutcome};
use graft_candle_models::{Decoder, GenerateSpec, Generation, Sampling, checkpoint, llama};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A small Llama with random weights written to and loaded from `dir`.
pub(crate) fn model(device: &Device, dir: &Path) -> TestResult<Decoder> {
    let cfg: ct::llama::LlamaConfig = serde_json::from_str(
        r#"{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5}"#,
    )?;
    let cfg = cfg.into_config(false);
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 7, DType::F32, &Device::Cpu)?;
    let path = dir.join("model.safetensors");
    checkpoint::write_safetensors(&weights, &path)?;
    // SAFETY: the file is this test's own, written above and never modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, device)? };
    Ok(llama::load(vb, &cfg)?)
}

/// What one path of a run produced: every launch's tokens, and the loop's outcomes.
struct Run {
    tokens: Vec<Vec<u32>>,
    outcomes: Vec<StepOutcome>,
}

/// `launches` launches of up to `spec.max_tokens` tokens for `batch` sequences, in a device
/// loop (`looped`) or one launch per token, each launch starting from the last tokens.
fn run(
    model: &Decoder,
    batch: usize,
    spec: GenerateSpec,
    launches: usize,
    looped: bool,
) -> TestResult<Run> {
    let device = model.device().clone();
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register(if looped { "generate" } else { "generate_step" });
    let cache = model.new_cache(batch, spec.max_tokens * launches + 1)?;
    let g = Generation::new(&device, batch, spec)?;
    let rng = DeviceRng::new(&device, 1234)?;
    let rng = matches!(spec.sampling, Sampling::Sample { .. }).then_some(&rng);
    let mut last: Vec<u32> = (0..batch as u32).map(|b| 3 + 17 * b).collect();
    let mut out = Run {
        tokens: Vec::new(),
        outcomes: Vec::new(),
    };
    for _ in 0..launches {
        let tokens = Tensor::new(last.as_slice(), &device)?;
        let produced = if looped {
            let (produced, step) = model.generate(&mut graft, step, &cache, &g, rng, &tokens)?;
            out.outcomes.push(step.outcome);
            produced
        } else {
            model.generate_per_step(&mut graft, step, &cache, &g, rng, &tokens)?
        };
        last = produced.last().cloned().unwrap_or(last);
        out.tokens.extend(produced);
    }
    Ok(out)
}

/// The loop draws the per-step tokens for K in `ks` and batches 1 and `batch`, greedy and
/// sampled; with an end token that a sequence reaches early, it repeats it from then on.
/// Returns the loop's outcomes, for the GPU test to check that it replays.
pub(crate) fn loop_equals_per_step(
    model: &Decoder,
    ks: &[usize],
    batch: usize,
) -> TestResult<Vec<StepOutcome>> {
    let mut outcomes = Vec::new();
    for &k in ks {
        for b in [1, batch] {
            for sampling in [
                Sampling::Greedy,
                Sampling::Sample {
                    temperature: 0.9,
                    top_k: 8,
                },
            ] {
                let open = GenerateSpec {
                    max_tokens: k,
                    eos: None,
                    sampling,
                };
                let stepped = run(model, b, open, 3, false)?;
                let looped = run(model, b, open, 3, true)?;
                assert_eq!(
                    looped.tokens, stepped.tokens,
                    "K={k} batch={b} {sampling:?}"
                );
                assert_eq!(looped.tokens.len(), 3 * k);
                outcomes.extend(looped.outcomes);
                // An end token the first sequence reaches at its third token.
                let eos = stepped.tokens[2][0];
                let closed = GenerateSpec {
                    eos: Some(eos),
                    ..open
                };
                let stepped = run(model, b, closed, 1, false)?;
                let looped = run(model, b, closed, 1, true)?;
                assert_eq!(looped.tokens, stepped.tokens, "K={k} batch={b} eos {eos}");
                let first = looped.tokens.iter().position(|t| t[0] == eos);
                let first = first.ok_or("the first sequence never reached its end token")?;
                assert!(first <= 2);
                assert!(looped.tokens[first..].iter().all(|t| t[0] == eos));
                if b == 1 {
                    assert_eq!(
                        looped.tokens.len(),
                        first + 1,
                        "the loop ends when all stop"
                    );
                }
            }
        }
    }
    Ok(outcomes)
}
