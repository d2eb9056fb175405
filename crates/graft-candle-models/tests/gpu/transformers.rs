//! candle-transformers' own Llama under graft-candle, put there the ways a new user would:
//! what they get is a typed, named cause and correct tokens, never a bare driver error or a
//! wrong one.

use std::collections::HashMap;

use candle_core::{D, DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama, LlamaConfig};
use graft_candle::{CandleGraft, Churn, EagerCause, Error, StepOutcome, Uncapturable};
use graft_candle_models::{checkpoint, llama};

use super::{TestResult, gpu};

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

/// candle-transformers' model, its config, and its weights by name.
type Loaded = (Llama, Config, HashMap<String, Tensor>);

/// candle-transformers' Llama with random weights (4 layers at d = 512, as the report had
/// it), and the weight tensors.
fn model(device: &Device) -> Fallible<Loaded> {
    let cfg: LlamaConfig = serde_json::from_str(
        r#"{"hidden_size": 512, "intermediate_size": 1536, "vocab_size": 8192,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 512}"#,
    )?;
    let cfg = cfg.into_config(false);
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 3, DType::F32, device)?;
    let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, device);
    Ok((Llama::load(vb, &cfg)?, cfg, weights))
}

/// candle-transformers' greedy tokens, eagerly, from token 1 at position 0.
fn eager_tokens(m: &Llama, cfg: &Config, device: &Device, steps: usize) -> Fallible<Vec<u32>> {
    let mut cache = Cache::new(true, DType::F32, cfg, device)?;
    let mut token = 1u32;
    let mut out = Vec::new();
    for pos in 0..steps {
        let x = Tensor::new(&[[token]], device)?;
        token = m
            .forward(&x, pos, &mut cache)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?[0];
        out.push(token);
    }
    Ok(out)
}

/// The natural way: the closure keeps the model, `&mut Cache` and the position. The
/// recording fails because llama.rs replaces the cache's tensors inside the step: the error
/// names that, the call is not re-run on the broken cache, and after `discard` a fresh cache
/// runs eagerly (the step is eager for good) with candle's own tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cache_replaced_inside_the_step_is_named_and_never_read_after_the_failed_recording()
-> TestResult {
    let device = gpu();
    let (m, cfg, _) = model(&device)?;
    let want = eager_tokens(&m, &cfg, &device, 8)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register("candle-transformers llama");
    let mut cache = Cache::new(true, DType::F32, &cfg, &device)?;
    let mut token = Tensor::new(&[1u32], &device)?;
    let call = |graft: &mut CandleGraft, cache: &mut Cache, token: &Tensor, pos: usize| {
        graft.call(step, &[token], &[], &[], |inputs| {
            let x = inputs[0].unsqueeze(0)?;
            Ok(vec![m.forward(&x, pos, cache)?.argmax(D::Minus1)?])
        })
    };
    let first = call(&mut graft, &mut cache, &token, 0)?;
    assert_eq!(first.outcome, StepOutcome::Warmup);
    token = first.outputs[0].clone();
    let e = match call(&mut graft, &mut cache, &token, 1) {
        Err(e) => e,
        Ok(out) => return Err(format!("the recording succeeded: {:?}", out.outcome).into()),
    };
    let message = e.to_string();
    assert!(
        matches!(
            &e,
            Error::StateLost {
                cause: Uncapturable::FreedOutside { .. },
                ..
            }
        ),
        "{e:?}"
    );
    for words in ["Tensor::cat", "rebuild that state", "eagerly from now on"] {
        assert!(message.contains(words), "{message}");
    }
    println!("the natural way: {message}");
    graft.discard(cache);
    // A fresh cache, from the start: eager (the signature is), and candle's own tokens.
    let mut cache = Cache::new(true, DType::F32, &cfg, &device)?;
    let mut token = Tensor::new(&[1u32], &device)?;
    let mut got = Vec::new();
    for pos in 0..want.len() {
        let out = call(&mut graft, &mut cache, &token, pos)?;
        assert_eq!(
            out.outcome,
            StepOutcome::Eager(EagerCause::Uncapturable(Uncapturable::FreedOutside {
                error: "CUDA_ERROR_INVALID_VALUE".into()
            })),
            "step {pos}"
        );
        token = out.outputs[0].clone();
        got.push(token.to_vec1::<u32>()?[0]);
    }
    assert_eq!(got, want);
    Ok(())
}

/// With no warmup the first call records, and candle's kernel-parameter upload misses its
/// cache: that is reported as an upload, not as a host read, and the call runs eagerly with
/// candle's tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_uncached_parameter_upload_is_an_upload() -> TestResult {
    let device = gpu();
    let (m, cfg, weights) = model(&device)?;
    let want = eager_tokens(&m, &cfg, &device, 1)?;
    let config = graft_core::Config {
        warmups: 0,
        ..graft_core::Config::default()
    };
    let mut graft = CandleGraft::with_config(&device, config)?;
    let step = graft.register("candle-transformers llama");
    let statics: Vec<&Tensor> = weights.values().collect();
    let mut cache = Cache::new(true, DType::F32, &cfg, &device)?;
    let token = Tensor::new(&[1u32], &device)?;
    let out = graft.call(step, &[&token], &statics, &[0], |inputs| {
        Ok(vec![
            m.forward(&inputs[0].unsqueeze(0)?, 0, &mut cache)?
                .argmax(D::Minus1)?,
        ])
    })?;
    match &out.outcome {
        StepOutcome::Eager(EagerCause::Uncapturable(op @ Uncapturable::Upload { .. })) => {
            assert!(!op.to_string().contains("device-to-host"), "{op}");
        }
        other => return Err(format!("want an upload refusal, got {other:?}").into()),
    }
    assert_eq!(out.outputs[0].to_vec1::<u32>()?, want);
    Ok(())
}

/// The documented way of the report: the weights as statics and the position as a key. Every
/// call is a new signature, so nothing records; graft names `keys[0]` as the cause (not the
/// shapes), keeps its signatures bounded, and the tokens are candle's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_position_passed_as_a_key_is_named_as_the_cause() -> TestResult {
    let device = gpu();
    let (m, cfg, weights) = model(&device)?;
    let steps = 12;
    let want = eager_tokens(&m, &cfg, &device, steps)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register("candle-transformers llama");
    let statics: Vec<&Tensor> = weights.values().collect();
    let mut cache = Cache::new(true, DType::F32, &cfg, &device)?;
    let mut token = Tensor::new(&[1u32], &device)?;
    let mut got = Vec::new();
    for pos in 0..steps {
        let out = graft.call(step, &[&token], &statics, &[pos as u64], |inputs| {
            Ok(vec![
                m.forward(&inputs[0].unsqueeze(0)?, pos, &mut cache)?
                    .argmax(D::Minus1)?,
            ])
        })?;
        assert_eq!(out.outcome, StepOutcome::Warmup, "step {pos}");
        token = out.outputs[0].clone();
        got.push(token.to_vec1::<u32>()?[0]);
    }
    assert_eq!(got, want);
    match graft.churn(step) {
        Some(Churn::Key { index: 0, calls }) => assert!(calls >= 8, "{calls}"),
        other => return Err(format!("want keys[0] named, got {other:?}").into()),
    }
    let shown = graft.churn(step).map(|c| c.to_string()).unwrap_or_default();
    assert!(shown.contains("keep it on the device"), "{shown}");
    Ok(())
}
