//! graft-candle-train on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine,
//! through `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): training steps graphed
//! against eager, and the guide's training example.
#![cfg(feature = "cuda")]

#[path = "support/guards.rs"]
mod guards;
#[path = "gpu/guards.rs"]
mod guards_gpu;
#[path = "support/training.rs"]
mod training;
#[path = "../examples/training.rs"]
mod training_example;
#[path = "gpu/training.rs"]
mod training_gpu;

#[path = "../../graft-candle/tests/support/gpu.rs"]
mod common;
use common::*;

/// docs/guide.md's training example, on the GPU: one recording, every later step a replay.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_training_example_runs_on_the_gpu() -> TestResult {
    training_example::main()
}
