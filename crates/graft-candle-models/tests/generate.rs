//! Generation on the CPU (in CI, both paths eager: the loop runs on the host): K tokens per
//! launch draw the tokens of one launch per token. tests/gpu/generate.rs runs the same check
//! with the loop as a CUDA conditional node.

#[path = "support/generate.rs"]
mod generate;

use candle_core::Device;

#[test]
fn a_device_loop_draws_the_tokens_of_one_launch_per_token() -> generate::TestResult {
    let dir = tempfile::tempdir()?;
    let model = generate::model(&Device::Cpu, dir.path())?;
    generate::loop_equals_per_step(&model, &[8], 3)?;
    Ok(())
}
