//! How a decode step picks each row's next token ([`Sampling`]: greedy, or temperature and
//! top-k sampling), and the host reference of the pick ([`sample_row`]) that the simulator
//! runs and `kernels.cu`'s `gt_sample_step` mirrors.
//!
//! The rule, for one row of logits `v` and a uniform `u` in `[0, 1)` (see [`crate::philox`]):
//! - greedy (temperature 0): the first index of the maximum (NaNs never win, all-NaN gives 0);
//! - else, with `m` the maximum and `t` the temperature: the kept entries are every non-NaN
//!   entry, or with `top_k = k` (0 < k < columns) those at least as large as the k-th largest
//!   entry (ties at the k-th are all kept, so more than k may be); each kept entry weighs
//!   `exp((v - m) / t)`; the pick is the first index whose running sum of weights, in index
//!   order, exceeds `u` times their total (the maximum's index if rounding leaves none, and
//!   the greedy pick when `m` is infinite).
//!
//! The order of the entries is that of [`order_key`], a total order on f32 bits (NaN lowest),
//! so the top-k cut is the same integer computation on both backends; the weights' sums may
//! round differently on the GPU, so the backends agree on the pick except within rounding of
//! a boundary.

use crate::error::{Result, TensorError};

/// How a sampling step picks each row's next token (see the module docs for the exact rule).
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct Sampling {
    /// 0 for greedy decoding; else the logits are divided by it before the softmax (finite,
    /// positive).
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (ties at the last one kept too); 0 keeps all.
    pub top_k: u32,
}

impl Sampling {
    /// Greedy decoding: the argmax of each row.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
    };

    /// Temperature and top-k sampling, checked.
    ///
    /// # Errors
    /// [`TensorError::Temperature`] for a negative or non-finite temperature.
    pub fn new(temperature: f32, top_k: u32) -> Result<Sampling> {
        let s = Sampling { temperature, top_k };
        s.check()?;
        Ok(s)
    }

    /// Whether this is greedy decoding (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Refuses a negative or non-finite temperature.
    pub(crate) fn check(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(TensorError::Temperature {
                temperature: self.temperature,
            });
        }
        Ok(())
    }

    /// The signature keys of a graph that samples this way (the parameters are baked into
    /// its kernels): the temperature's bits and `top_k`; greedy is `[0, 0]` whatever `top_k`.
    pub fn keys(&self) -> [u64; 2] {
        if self.is_greedy() {
            return [0, 0];
        }
        [u64::from(self.temperature.to_bits()), u64::from(self.top_k)]
    }
}

/// A total order on f32 bits as a u32: larger numbers give larger keys, `-0.0` sorts below
/// `0.0`, and NaN (any payload) is 0, below everything.
pub fn order_key(v: f32) -> u32 {
    if v.is_nan() {
        return 0;
    }
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The first index of the largest entry (NaNs never win), `None` if all are NaN or there are
/// none.
pub(crate) fn argmax(row: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (j, &x) in row.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
            best = Some((j, x));
        }
    }
    best.map(|(j, _)| j)
}

/// The [`order_key`] of the `k`-th largest entry (`1 <= k <= row.len()`).
fn kth_largest_key(row: &[f32], k: usize) -> u32 {
    let mut keys: Vec<u32> = row.iter().map(|&v| order_key(v)).collect();
    let (_, kth, _) = keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    *kth
}

/// The token `s` picks from one row of logits (bias included) with uniform `u` in `[0, 1)`:
/// the host reference of the sampling kernels (see the module docs).
pub fn sample_row(row: &[f32], s: Sampling, u: f32) -> i32 {
    let Some(best) = argmax(row) else {
        return 0;
    };
    let m = row[best];
    if s.is_greedy() || !m.is_finite() {
        return best as i32;
    }
    let k = s.top_k as usize;
    let threshold = if k > 0 && k < row.len() {
        kth_largest_key(row, k)
    } else {
        1
    };
    let weight = |v: f32| {
        let key = order_key(v);
        if key != 0 && key >= threshold {
            ((v - m) / s.temperature).exp()
        } else {
            0.0
        }
    };
    let total: f32 = row.iter().map(|&v| weight(v)).sum();
    let target = u * total;
    let mut running = 0.0f32;
    for (j, &v) in row.iter().enumerate() {
        running += weight(v);
        if running > target {
            return j as i32;
        }
    }
    best as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_keys_sort_like_the_numbers() {
        let vs = [
            f32::NEG_INFINITY,
            -2.0,
            -0.0,
            0.0,
            1e-30,
            3.0,
            f32::INFINITY,
        ];
        for w in vs.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
        assert_eq!(order_key(f32::NAN), 0);
        assert!(order_key(f32::NEG_INFINITY) > 0);
    }

    #[test]
    fn greedy_and_degenerate_rows() {
        let row = [1.0, 5.0, f32::NAN, 5.0];
        assert_eq!(sample_row(&row, Sampling::GREEDY, 0.9), 1);
        assert_eq!(
            sample_row(&[f32::NAN; 3], Sampling::new(1.0, 0).unwrap(), 0.5),
            0
        );
        let inf = [0.0, f32::INFINITY, 1.0];
        assert_eq!(sample_row(&inf, Sampling::new(1.0, 0).unwrap(), 0.99), 1);
    }

    #[test]
    fn top_k_cuts_and_the_uniform_walks_the_distribution() {
        let row = [0.0, 3.0, 1.0, 2.0, f32::NAN];
        let top1 = Sampling::new(5.0, 1).unwrap();
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample_row(&row, top1, u), 1);
        }
        let top2 = Sampling::new(1.0, 2).unwrap();
        // Weights 1 (index 1) and e^-1 (index 3): index 1 up to u < 1 / (1 + e^-1).
        let split = 1.0 / (1.0 + (-1.0f32).exp());
        assert_eq!(sample_row(&row, top2, split - 0.01), 1);
        assert_eq!(sample_row(&row, top2, split + 0.01), 3);
        let all = Sampling::new(1.0, 0).unwrap();
        assert_eq!(
            sample_row(&row, all, 0.0),
            0,
            "u = 0 picks the first kept entry"
        );
        // Ties at the k-th largest are all kept.
        assert_eq!(
            sample_row(&[2.0, 1.0, 2.0], Sampling::new(1.0, 1).unwrap(), 0.9),
            2
        );
    }

    #[test]
    fn temperatures_are_checked() {
        for t in [-1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                Sampling::new(t, 0),
                Err(TensorError::Temperature { .. })
            ));
        }
        assert_eq!(Sampling::GREEDY.keys(), [0, 0]);
        assert_eq!(
            Sampling {
                temperature: 0.0,
                top_k: 9
            }
            .keys(),
            [0, 0]
        );
        assert_eq!(Sampling::new(1.0, 4).unwrap().keys(), [0x3f80_0000, 4]);
    }
}
