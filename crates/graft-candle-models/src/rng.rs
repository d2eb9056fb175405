//! A tiny seeded generator for the model's random weights (SplitMix64): the same seed gives
//! the same weights on every device and platform, with no dependency.

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Debug)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` values uniform in `[-scale, scale)`.
    pub(crate) fn uniform_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                // The top 24 bits: exactly representable in an f32.
                let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                (2.0 * unit - 1.0) * scale
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_values_in_range() {
        let a = SplitMix64::new(7).uniform_vec(1000, 0.5);
        let b = SplitMix64::new(7).uniform_vec(1000, 0.5);
        assert_eq!(a, b);
        assert!(a.iter().all(|x| (-0.5..0.5).contains(x)));
        assert_ne!(a, SplitMix64::new(8).uniform_vec(1000, 0.5));
    }
}
