//! Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2,
//! 3", SC 2011; the generator of Random123), written once for graft: [`philox4x32_10`] on the
//! host and [`philox_cu!`] in CUDA C, which graft-tensor's and graft-candle's NVRTC programs
//! both include, so every backend draws the same bits from the same counter and key.
//!
//! A crate of its own, with no dependencies: graft-tensor and graft-candle both need it, in
//! builds with and without CUDA, and neither the runtime (graft-core) nor the CUDA backend
//! (graft-cuda, absent from graft-candle's CPU build) is the place for a random-number
//! generator. How a counter is laid out (which words hold the offset, a row, a block) is the
//! user's choice, documented where the generator is used.

#![forbid(unsafe_code)]

/// The multipliers of the two 32-bit products of a round.
const MULTIPLIERS: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// What the key grows by between rounds (the golden ratio and sqrt(3) - 1, as 32-bit
/// fractions).
const KEY_STEP: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
/// Rounds of Philox4x32-10.
const ROUNDS: usize = 10;

/// The high and low words of the 64-bit product `a * b`.
fn mul_hi_lo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// Philox4x32-10: the four words the bijection keyed by `key` maps `counter` to (Random123's
/// argument order: counter, then key).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
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

/// A word as an f32 uniform in `[0, 1)`: its top 24 bits times 2^-24, exact in f32, so the
/// host and the device (`graft_philox_unit` of [`philox_cu!`]) give the same bits.
pub fn unit_f32(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// The CUDA C source of the generator, as a string literal (so `concat!` can put it in front of
/// a kernel module's source): `graft_philox4x32_10(c, k0, k1)` maps the counter `c[0..4]` in
/// place to the four words of [`philox4x32_10`]`(c, [k0, k1])`, and `graft_philox_unit(w)` is
/// [`unit_f32`]`(w)`.
#[macro_export]
macro_rules! philox_cu {
    () => {
        r#"
// ---- Philox4x32-10 (graft-philox: the host's philox4x32_10 and unit_f32, bit for bit) ----

// The four words the bijection keyed by (k0, k1) maps the counter c[0..4] to, in place.
__device__ __forceinline__ void graft_philox4x32_10(unsigned int c[4], unsigned int k0,
                                                    unsigned int k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned int hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// A word as a uniform in [0, 1): its top 24 bits times 2^-24, exact in f32.
__device__ __forceinline__ float graft_philox_unit(unsigned int word) {
    return (float)(word >> 8) * 5.9604644775390625e-8f;
}
"#
    };
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
        assert!(unit_f32(u32::MAX) < 1.0);
    }

    /// The CUDA source defines the two functions its documentation names, with the host's
    /// constants.
    #[test]
    fn the_cuda_source_has_the_hosts_constants() {
        let source = philox_cu!();
        for needle in [
            "void graft_philox4x32_10(",
            "float graft_philox_unit(",
            "0xD2511F53u",
            "0xCD9E8D57u",
            "0x9E3779B9u",
            "0xBB67AE85u",
            "round < 10",
        ] {
            assert!(source.contains(needle), "{needle}");
        }
    }
}
