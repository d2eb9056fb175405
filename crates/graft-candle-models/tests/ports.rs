//! Every port's greedy tokens equal candle-transformers' own model from the same checkpoint,
//! on the CPU (tests/gpu.rs runs the same check on the GPU, graphed).

#[path = "support/ports.rs"]
mod ports;

use candle_core::{DType, Device, Tensor};
use ports::{Port, TestResult, tokens_equal};

fn check(port: Port) {
    for batch in [1, 3] {
        if let Err(e) = tokens_equal(port, batch, DType::F32, &Device::Cpu) {
            panic!("{e}");
        }
    }
}

#[test]
fn llama2() {
    check(Port::Llama2);
}

#[test]
fn llama3_with_rope_scaling() {
    check(Port::Llama3);
}

#[test]
fn mistral() {
    check(Port::Mistral);
}

#[test]
fn qwen2() {
    check(Port::Qwen2);
}

#[test]
fn qwen3() {
    check(Port::Qwen3);
}

#[test]
fn quantized_llama_q4k() {
    check(Port::Q4K);
}

#[test]
fn quantized_llama_q8_0() {
    check(Port::Q8_0);
}

#[test]
fn mixtral() {
    check(Port::Mixtral);
}

#[test]
fn qwen3_moe() {
    check(Port::Qwen3Moe);
}

#[test]
fn qwen2_moe_with_its_shared_expert() {
    check(Port::Qwen2Moe);
}

/// The explicit backward program (`Decoder::sequence_gradients`) refuses every port it does
/// not know, with an error naming each reason it gives: Mistral's sliding window, Qwen2's
/// biases, Qwen3's per-head norms, the quantized Llama's quantized weights and the MoE ports'
/// experts; the Llamas' one reason is their test head dim of 16, which the fused attention
/// does not take (graft-candle-train's tests run the program on them at head dim 64, against
/// candle's autograd).
#[test]
fn the_explicit_backward_says_why_it_does_not_take_a_decoder() {
    let expected = [
        (Port::Llama2, ""),
        (Port::Llama3, ""),
        (Port::Mistral, "sliding window"),
        (Port::Qwen2, "biased"),
        (Port::Qwen3, "per-head"),
        (Port::Q4K, "quantized"),
        (Port::Mixtral, "mixture of experts"),
        (Port::Qwen3Moe, "mixture of experts"),
        (Port::Qwen2Moe, "mixture of experts"),
    ];
    for (port, reason) in expected {
        let why = explicit_backward_refusal(port).unwrap_or_else(|e| panic!("{e}"));
        if reason.is_empty() {
            assert_eq!(why.len(), 1, "{port:?}: {why:?}");
            assert!(why[0].contains("head dim 64 or 128"), "{port:?}: {why:?}");
        } else {
            assert!(why.iter().any(|w| w.contains(reason)), "{port:?}: {why:?}");
        }
    }
}

/// Why the explicit backward program (`Decoder::sequence_gradients`) does not take `port`'s
/// decoder (f32, on the CPU): its reasons, after checking that running it fails with an error
/// that names each. Fails if it has none, or runs.
fn explicit_backward_refusal(port: Port) -> TestResult<Vec<String>> {
    let dir = tempfile::tempdir()?;
    let (_, model) = ports::load(port, DType::F32, &Device::Cpu, dir.path())?;
    let why = model.sequence_gradients_unsupported();
    let vocab = model.spec().vocab as u32;
    let ids: Vec<u32> = (0..2 * 9).map(|i| (i * 37 + 5) % vocab).collect();
    let all = Tensor::from_vec(ids, (2, 9), &Device::Cpu)?;
    let (tokens, targets) = (
        all.narrow(1, 0, 8)?.contiguous()?,
        all.narrow(1, 1, 8)?.contiguous()?,
    );
    let Err(e) = model.sequence_gradients(&tokens, &targets) else {
        return Err(format!("{port:?}: the explicit program ran (reasons {why:?})").into());
    };
    if why.is_empty() || !why.iter().all(|w| e.to_string().contains(w.as_str())) {
        return Err(format!("{port:?}: the error {e} does not say {why:?}").into());
    }
    Ok(why)
}
