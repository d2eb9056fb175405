//! The counter layout of [`super::DeviceRng`] over graft-philox's Philox4x32-10: the CPU path
//! of its draws, and the reference the CUDA kernel must match bit for bit.

use graft_philox::{philox4x32_10, unit_f32};

/// The counter of block `block`: its low and high words first, zero in the last two.
pub(crate) fn counter(block: u64) -> [u32; 4] {
    [block as u32, (block >> 32) as u32, 0, 0]
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
