//! The tokens the commands decode from, and the check that two runs decoded the same.

use crate::error::CliError;

/// The first tokens of row `i` of a batch.
pub(crate) fn first_tokens(batch: usize, vocab: usize) -> Vec<i32> {
    (0..batch).map(|i| ((i * 37 + 1) % vocab) as i32).collect()
}

/// Checks two runs produced the same tokens, naming the first difference.
pub(crate) fn compare(
    batch: usize,
    (first, a): (&'static str, &[Vec<i32>]),
    (second, b): (&'static str, &[Vec<i32>]),
) -> Result<(), CliError> {
    for (step, (ra, rb)) in a.iter().zip(b).enumerate() {
        for (row, (&x, &y)) in ra.iter().zip(rb).enumerate() {
            if x != y {
                return Err(CliError::TokensDiffer {
                    batch,
                    step,
                    row,
                    first,
                    a: x,
                    second,
                    b: y,
                });
            }
        }
    }
    Ok(())
}
