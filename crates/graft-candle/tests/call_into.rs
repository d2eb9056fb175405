//! `CandleGraft::call_into` on the CPU (candle eager): the same body as the GPU test in
//! tests/gpu.rs.

#[path = "support/call_into.rs"]
mod call_into;

#[test]
fn call_into_writes_the_given_tensors() -> Result<(), Box<dyn std::error::Error>> {
    call_into::call_into_writes_the_given_tensors(&candle_core::Device::Cpu)
}
