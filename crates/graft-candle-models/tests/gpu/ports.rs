//! Every port's tokens (and f32 logits) equal candle-transformers' own model on the GPU, with
//! the port's step graphed by graft-candle: it records once and replays every later step.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use graft_candle::{Buckets, CandleGraft, StepOutcome};
use graft_candle_models::{checkpoint, llama};
use graft_core::InputKind;

use super::ports::{Port, llama_config, tokens_equal};
use super::{TestResult, gpu, under_sanitizer};

/// Every port (tests/ports.rs checks each on the CPU).
const ALL: [Port; 10] = [
    Port::Llama2,
    Port::Llama3,
    Port::Mistral,
    Port::Qwen2,
    Port::Qwen3,
    Port::Q4K,
    Port::Q8_0,
    Port::Mixtral,
    Port::Qwen3Moe,
    Port::Qwen2Moe,
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_port_matches_candle_transformers_and_replays() -> TestResult {
    // compute-sanitizer slows every launch by orders of magnitude: one batch of three ports
    // (rotary scaling, per-head norms, quantized matmuls) then.
    let (ports, batches): (&[Port], &[usize]) = if under_sanitizer() {
        (
            &[
                Port::Llama3,
                Port::Qwen3,
                Port::Q4K,
                Port::Mixtral,
                Port::Qwen2Moe,
            ],
            &[2],
        )
    } else {
        (&ALL, &[1, 8])
    };
    let mut failures = Vec::new();
    for &port in ports {
        for &batch in batches {
            match tokens_equal(port, batch, DType::F32, &gpu()) {
                // One warmup, one recording, then replays only.
                Ok(c) if c.replays + 2 == c.calls && c.findings.is_empty() => println!(
                    "{port:?} batch {batch}: tokens equal ({} near ties), logits within {:.2e}, {} of {} steps replayed",
                    c.near_ties, c.max_logit_diff, c.replays, c.calls
                ),
                Ok(c) => failures.push(format!(
                    "{port:?} batch {batch}: {} of {} steps replayed, want all but 2; guards found {:?}",
                    c.replays, c.calls, c.findings
                )),
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// In bf16 (cuBLAS's library kernels in the graph), a port's step still follows its token
/// tensor to every new address: tokens uploaded afresh each step replay, never re-record.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bf16_step_follows_its_tokens_to_every_address() -> TestResult {
    // graft-cuda says why at debug level if a graph cannot be patched.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("graft_cuda=debug")
        .with_test_writer()
        .try_init();
    let device = gpu();
    let cfg = llama_config(true)?;
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 5, DType::BF16, &device)?;
    let model = llama::load(
        VarBuilder::from_tensors(weights, DType::BF16, &device),
        &cfg,
    )?;
    let cache = model.new_cache(4, 64)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register_bucketed("decode", Buckets::new([4])?);
    let mut held = Vec::new();
    for i in 0..24u32 {
        // A fresh upload each step, and the last ones held, so addresses keep changing.
        let tokens = Tensor::new(&[i, i + 1, i + 2, i + 3], &device)?;
        let out = model.decode(&mut graft, step, &cache, &tokens)?;
        match (i, &out.outcome) {
            (0, StepOutcome::Warmup)
            | (1, StepOutcome::Recorded(_))
            | (2.., StepOutcome::Replayed(_)) => {}
            (_, other) => return Err(format!("step {i}: {other:?}").into()),
        }
        held.push(tokens);
    }
    let nodes = graft.graft().map(|g| g.nodes()).unwrap_or_default();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].inputs[0], InputKind::InPlace { follows: true });
    Ok(())
}
