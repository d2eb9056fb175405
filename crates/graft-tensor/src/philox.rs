//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
//! counter-based generator the sampling op draws from, on the host; `kernels.cu` has the same
//! function in CUDA C, so both backends draw the same numbers from the same state.
//!
//! A sampling step draws one uniform per row from key = the seed and counter =
//! (offset lo, offset hi, row, 0), then advances the offset by one on the device. The state
//! lives in a `[4]` u32 device tensor ([`rng_words`]: key lo, key hi, offset lo, offset hi),
//! so a replay, an eager run and an iteration of a device loop advance it alike.

/// Words of the generator's device state: key lo, key hi, offset lo, offset hi.
pub const RNG_WORDS: usize = 4;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds: the four words of block `counter` under `key`.
pub fn philox4x32_10(key: [u32; 2], counter: [u32; 4]) -> [u32; 4] {
    let (mut k, mut c) = (key, counter);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// A uniform in `[0, 1)` from the top 24 bits of `word` (exact in f32, on both backends).
pub fn uniform(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The uniform a sampling step at `offset` draws for `row` under `seed`.
pub fn draw(seed: u64, offset: u64, row: u32) -> f32 {
    let key = [seed as u32, (seed >> 32) as u32];
    let counter = [offset as u32, (offset >> 32) as u32, row, 0];
    uniform(philox4x32_10(key, counter)[0])
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

    /// Random123's known answers for Philox4x32-10 (kat_vectors).
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10([0, 0], [0, 0, 0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX, u32::MAX], [u32::MAX; 4]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0xa409_3822, 0x299f_31d0],
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn draws_are_uniforms_of_the_counter() {
        assert_eq!(draw(0, 0, 0), uniform(0x6627_e8d5));
        assert_eq!(uniform(0), 0.0);
        assert!(uniform(u32::MAX) < 1.0);
        assert_ne!(draw(1, 0, 0), draw(1, 1, 0), "the offset moves the draw");
        assert_ne!(draw(1, 0, 0), draw(1, 0, 1), "rows draw independently");
        let words = rng_words(0x1234_5678_9abc_def0, 7 << 32 | 3);
        assert_eq!(words, [0x9abc_def0, 0x1234_5678, 3, 7]);
        assert_eq!(rng_parts(words), (0x1234_5678_9abc_def0, 7 << 32 | 3));
    }
}
