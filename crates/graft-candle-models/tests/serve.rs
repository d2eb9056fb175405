//! Serving on the CPU (in CI): a continuous batch, prefilled in padded chunks, gives each
//! request the tokens it gets alone; bad requests are refused without touching the others.
//! tests/gpu/serve.rs runs the same bodies graphed.

#[path = "support/serve.rs"]
mod serve;

use candle_core::Device;

#[test]
fn a_continuous_batch_gives_every_request_its_tokens_alone() -> serve::TestResult {
    for window in [None, Some(8)] {
        let dir = tempfile::tempdir()?;
        let model = serve::model(window, &Device::Cpu, dir.path())?;
        serve::batch_equals_alone(&model, |_| Ok(()))?;
    }
    Ok(())
}

#[test]
fn bad_requests_are_refused_and_the_others_are_served() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    serve::bad_requests_are_refused_and_nothing_else_changes(&model)
}
