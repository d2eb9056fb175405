//! graft-candle-train on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine,
//! through `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): training steps graphed
//! against eager, and the guide's training example.
#![cfg(feature = "cuda")]

use graft_candle::candle_core::Device;

#[path = "support/training.rs"]
mod training;
#[path = "../examples/training.rs"]
mod training_example;
#[path = "gpu/training.rs"]
mod training_gpu;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Whether compute-sanitizer runs this test (`scripts/gpu-run.sh --sanitize` announces it
/// with `GRAFT_UNDER_SANITIZER=1`): the sanitizer slows every launch by orders of magnitude
/// (racecheck made 64 token steps of the bench model take over 560 s on an H100), so long
/// tests run a smaller case. graft_testkit's helper for this crate, which cannot depend on
/// graft-testkit (it links graft-cuda with dynamic-loading, this build with dynamic-linking).
fn under_sanitizer() -> bool {
    matches!(std::env::var_os("GRAFT_UNDER_SANITIZER"), Some(v) if !v.is_empty() && v != "0")
}

/// How many times a long loop runs: `full`, or `few` under compute-sanitizer.
fn steps(full: usize, few: usize) -> usize {
    if under_sanitizer() {
        full.min(few)
    } else {
        full
    }
}

fn gpu() -> Device {
    graft_candle::device(0).expect("a CUDA GPU (candle, dynamically linked libcuda)")
}

/// docs/guide.md's training example, on the GPU: one recording, every later step a replay.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_training_example_runs_on_the_gpu() -> TestResult {
    training_example::main()
}
