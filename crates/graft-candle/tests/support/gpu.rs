//! What the candle crates' GPU tests share (each crate's tests/gpu.rs includes this file):
//! the device, the sanitizer rule for long loops, and graft's diagnostics for assertion
//! messages. graft-testkit has the same sanitizer rule, but these builds cannot link it (it
//! takes graft-cuda with dynamic-loading, candle's CUDA build dynamic-linking).
#![allow(dead_code)]

use graft_candle::CandleGraft;
use graft_candle::candle_core::Device;

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Whether compute-sanitizer runs this test (`scripts/gpu-run.sh --sanitize` announces it
/// with `GRAFT_UNDER_SANITIZER=1`): the sanitizer slows every launch by orders of magnitude
/// (racecheck made 64 token steps of the bench model take over 560 s on an H100), so long
/// tests run a smaller case.
pub(crate) fn under_sanitizer() -> bool {
    matches!(std::env::var_os("GRAFT_UNDER_SANITIZER"), Some(v) if !v.is_empty() && v != "0")
}

/// How many times a long loop runs: `full`, or `few` under compute-sanitizer.
pub(crate) fn steps(full: usize, few: usize) -> usize {
    if under_sanitizer() {
        full.min(few)
    } else {
        full
    }
}

pub(crate) fn gpu() -> Device {
    graft_candle::device(0).expect("a CUDA GPU (candle, dynamically linked libcuda)")
}

/// graft's decision log and tree, for assertion messages.
pub(crate) fn diagnostics(graft: &CandleGraft) -> String {
    match graft.graft() {
        Some(g) => {
            let log: Vec<String> = g.explain().map(|d| d.to_string()).collect();
            format!("decisions:\n{}\ntree:\n{}", log.join("\n"), g.dump_text())
        }
        None => "not graphed".to_string(),
    }
}
