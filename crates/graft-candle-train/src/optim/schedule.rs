//! Learning-rate schedules evaluated on the device, from the optimizer's applied-step count,
//! at the start of every step: a recorded step replays with the rate of the step it runs,
//! with no host write between steps.

use candle_core::{Result, Tensor};

/// How the learning rate follows the step count t (the updates applied before this one:
/// skipped steps do not advance it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// GPT-style: a linear warmup to `peak` (step t gets `peak * (t + 1) / warmup` while that
    /// is below the decay's rate), then a cosine decay from `peak` at step `warmup` to `floor`
    /// at step `total`, and `floor` after it. `warmup` 0: no warmup.
    WarmupCosine {
        peak: f64,
        warmup: u64,
        total: u64,
        floor: f64,
    },
}

impl LrSchedule {
    /// (peak, warmup, total, floor).
    fn parts(&self) -> (f64, u64, u64, f64) {
        let LrSchedule::WarmupCosine {
            peak,
            warmup,
            total,
            floor,
        } = *self;
        (peak, warmup, total, floor)
    }

    /// The rate at step `t`, on the host in f64 (the device computes it in f32).
    pub fn rate_at(&self, t: u64) -> f64 {
        let (peak, warmup, total, floor) = self.parts();
        let t = t as f64;
        let (w, n) = (warmup as f64, total as f64);
        let progress = ((t - w) / (n - w)).clamp(0.0, 1.0);
        let decay = floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        if warmup == 0 {
            decay
        } else {
            decay.min(peak * (t + 1.0) / w)
        }
    }

    /// Refuses a schedule that cannot be followed.
    pub(crate) fn check(&self) -> Result<()> {
        let (peak, warmup, total, floor) = self.parts();
        if !(peak.is_finite() && floor.is_finite() && 0.0 <= floor && floor <= peak) {
            candle_core::bail!(
                "a warmup-cosine schedule needs finite rates with 0 <= floor <= peak, got peak {peak} and floor {floor}"
            );
        }
        if total <= warmup {
            candle_core::bail!(
                "a warmup-cosine schedule needs total ({total}) above warmup ({warmup}) steps"
            );
        }
        Ok(())
    }

    /// The rate at the step count `t` (`[1]` f32 on the device), as `[1]` f32: affine and
    /// unary ops only (a clamp or minimum against a host scalar would upload it, which a
    /// recording must not hold): max(x, 0) is relu, min(a, b) is (a + b - |a - b|) / 2.
    pub(crate) fn rate(&self, t: &Tensor) -> Result<Tensor> {
        let (peak, warmup, total, floor) = self.parts();
        let span = (total - warmup) as f64;
        let x = t.affine(1.0 / span, -(warmup as f64) / span)?;
        // clamp(x, 0, 1) = 1 - relu(1 - relu(x)).
        let progress = x.relu()?.affine(-1.0, 1.0)?.relu()?.affine(-1.0, 1.0)?;
        let half = 0.5 * (peak - floor);
        let decay = progress
            .affine(std::f64::consts::PI, 0.0)?
            .cos()?
            .affine(half, floor + half)?;
        if warmup == 0 {
            return Ok(decay);
        }
        let ramp = peak / warmup as f64;
        let warm = t.affine(ramp, ramp)?;
        ((&warm + &decay)? - (&warm - &decay)?.abs()?)?.affine(0.5, 0.0)
    }
}
