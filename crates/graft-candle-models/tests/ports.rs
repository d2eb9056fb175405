//! Every port's greedy tokens equal candle-transformers' own model from the same checkpoint,
//! on the CPU (tests/gpu.rs runs the same check on the GPU, graphed).

#[path = "support/ports.rs"]
mod ports;

use candle_core::{DType, Device};
use ports::{Port, tokens_equal};

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
