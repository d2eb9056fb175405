//! Every port's tokens (and f32 logits) equal candle-transformers' own model on the GPU, with
//! the port's step graphed by graft-candle: it records once and replays every later step.

use candle_core::DType;

use super::ports::{ALL, tokens_equal};
use super::{TestResult, gpu, under_sanitizer};

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_port_matches_candle_transformers_and_replays() -> TestResult {
    let batches: &[usize] = if under_sanitizer() { &[2] } else { &[1, 8] };
    let mut failures = Vec::new();
    for port in ALL {
        for &batch in batches {
            match tokens_equal(port, batch, DType::F32, &gpu()) {
                // One warmup, one recording, then replays only.
                Ok(c) if c.replays + 2 == c.calls => println!(
                    "{port:?} batch {batch}: tokens equal, logits within {:.2e}, {} of {} steps replayed",
                    c.max_logit_diff, c.replays, c.calls
                ),
                Ok(c) => failures.push(format!(
                    "{port:?} batch {batch}: {} of {} steps replayed, want all but 2",
                    c.replays, c.calls
                )),
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}
