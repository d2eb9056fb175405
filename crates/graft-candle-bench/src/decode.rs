//! What the two decode benchmarks share: the tokens they start from and how many steps are
//! checked.

use graft_candle::candle_core::{Device, Tensor};

use crate::common::BenchResult;

/// Steps whose tokens are compared before anything is timed.
pub const CHECK_STEPS: usize = 64;
/// The first tokens of `batch` sequences, the same in every variant.
pub fn first_tokens(batch: usize, vocab: usize, device: &Device) -> BenchResult<Tensor> {
    let tokens: Vec<u32> = (0..batch).map(|i| ((3 + 17 * i) % vocab) as u32).collect();
    Ok(Tensor::new(tokens.as_slice(), device)?)
}
