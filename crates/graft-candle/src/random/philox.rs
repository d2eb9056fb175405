//! Philox4x32-10 on the host (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy
//! as 1, 2, 3", SC 2011): the CPU path of [`super::DeviceRng`] and the reference the CUDA
//! kernel must match bit for bit.

/// The multipliers of the two 32-bit products of a round.
const MULTIPLIERS: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// What the key grows by between rounds (the golden ratio and sqrt(3) - 1, as 32-bit fractions).
const KEY_STEP: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
/// Rounds of Philox4x32-10.
const ROUNDS: usize = 10;

/// The high and low words of the 64-bit product `a * b`.
fn mul_hi_lo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// Philox4x32-10: the four words the bijection keyed by `key` maps `counter` to.
pub(crate) fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..ROUNDS {
        if round > 0 {
            k0 = k0.wrapping_add(KEY_STEP[0]);
            k1 = k1.wrapping_add(KEY_STEP[1]);
        }
        let (hi0, lo0) = mul_hi_lo(MULTIPLIERS[0], c0);
        let (hi1, lo1) = mul_hi_lo(MULTIPLIERS[1], c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// The counter of block `block`: its low and high words first, zero in the last two.
pub(crate) fn counter(block: u64) -> [u32; 4] {
    [block as u32, (block >> 32) as u32, 0, 0]
}

/// A word as an f32 uniform in `[0, 1)`: its top 24 bits times 2^-24, exact in f32, so the
/// host and the device give the same bits.
pub(crate) fn unit_f32(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// The 4-word blocks a draw of `n` elements consumes: `ceil(n / 4)`.
pub(crate) fn blocks(n: usize) -> u64 {
    n.div_ceil(4) as u64
}

/// Fills `out` with uniforms in `[0, 1)`: element `i` is lane `i % 4` of the block with
/// counter `offset + i / 4` (wrapping at 2^64) under `key`.
pub(crate) fn fill_uniform(key: [u32; 2], offset: u64, out: &mut [f32]) {
    for (block, chunk) in out.chunks_mut(4).enumerate() {
        let words = philox4x32_10(counter(offset.wrapping_add(block as u64)), key);
        for (value, word) in chunk.iter_mut().zip(words) {
            *value = unit_f32(word);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known answers for philox4x32 with 10 rounds (its `tests/kat_vectors`):
    /// counter, key, result.
    const KNOWN_ANSWERS: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        (
            [0; 4],
            [0; 2],
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
        ),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
        ),
    ];

    #[test]
    fn random123_known_answers() {
        for (counter, key, want) in KNOWN_ANSWERS {
            assert_eq!(
                philox4x32_10(counter, key),
                want,
                "counter {counter:08x?} key {key:08x?}"
            );
        }
    }

    #[test]
    fn uniforms_are_the_top_24_bits_and_stay_below_one() {
        assert_eq!(unit_f32(0), 0.0);
        assert_eq!(unit_f32(0xff), 0.0);
        assert_eq!(unit_f32(0x100), 2f32.powi(-24));
        assert_eq!(unit_f32(0x8000_0000), 0.5);
        assert_eq!(unit_f32(u32::MAX), 1.0 - 2f32.powi(-24));
    }

    #[test]
    fn blocks_round_up_and_the_counter_puts_the_block_in_words_0_and_1() {
        assert_eq!([0, 1, 4, 5, 8].map(blocks), [0, 1, 1, 2, 2]);
        assert_eq!(
            counter(0x1234_5678_9abc_def0),
            [0x9abc_def0, 0x1234_5678, 0, 0]
        );
    }

    /// Element `i` of a fill is lane `i % 4` of block `offset + i / 4`, across the wrap at
    /// 2^64; a partial last block takes its first lanes.
    #[test]
    fn fills_take_consecutive_blocks_lane_by_lane() {
        let key = [7, 9];
        let mut out = [0f32; 10];
        fill_uniform(key, u64::MAX - 1, &mut out);
        for (i, value) in out.iter().enumerate() {
            let words = philox4x32_10(counter((u64::MAX - 1).wrapping_add(i as u64 / 4)), key);
            assert_eq!(
                value.to_bits(),
                unit_f32(words[i % 4]).to_bits(),
                "element {i}"
            );
        }
        assert_ne!(out[0..4], out[4..8]);
    }
}
