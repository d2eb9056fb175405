//! How the sampling op draws from Philox4x32-10 (the generator of graft-philox, whose CUDA C
//! `KERNELS_CU` includes, so both backends draw the same numbers from the same state).
//!
//! A sampling step draws one uniform per row from key = the seed and counter =
//! (offset lo, offset hi, row, 0), then advances the offset by one on the device. The state
//! lives in a `[4]` u32 device tensor ([`rng_words`]: key lo, key hi, offset lo, offset hi),
//! so a replay, an eager run and an iteration of a device loop advance it alike.

use graft_philox::{philox4x32_10, unit_f32};

/// Words of the generator's device state: key lo, key hi, offset lo, offset hi.
pub const RNG_WORDS: usize = 4;

/// The uniform a sampling step at `offset` draws for `row` under `seed`.
pub fn draw(seed: u64, offset: u64, row: u32) -> f32 {
    let key = [seed as u32, (seed >> 32) as u32];
    let counter = [offset as u32, (offset >> 32) as u32, row, 0];
    unit_f32(philox4x32_10(counter, key)[0])
}

/// The device state of a generator seeded with `seed` whose next step is at `offset`.
pub fn rng_words(seed: u64, offset: u64) -> [u32; RNG_WORDS] {
    [
        seed as u32,
        (seed >> 32) as u32,
        offset as u32,
        (offset >> 32) as u32,
    ]
}

/// The seed and offset held in device state `words` (the inverse of [`rng_words`]).
pub fn rng_parts(words: [u32; RNG_WORDS]) -> (u64, u64) {
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    (join(words[0], words[1]), join(words[2], words[3]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_uniforms_of_the_counter() {
        assert_eq!(draw(0, 0, 0), unit_f32(0x6627_e8d5));
        assert_eq!(unit_f32(0), 0.0);
        assert!(unit_f32(u32::MAX) < 1.0);
        assert_ne!(draw(1, 0, 0), draw(1, 1, 0), "the offset moves the draw");
        assert_ne!(draw(1, 0, 0), draw(1, 0, 1), "rows draw independently");
        let words = rng_words(0x1234_5678_9abc_def0, 7 << 32 | 3);
        assert_eq!(words, [0x9abc_def0, 0x1234_5678, 3, 7]);
        assert_eq!(rng_parts(words), (0x1234_5678_9abc_def0, 7 << 32 | 3));
    }
}
