//! Per-step timing: wall time of one step including a device synchronize, and medians.

use std::time::{Duration, Instant};

use graft_core::Device;

/// Runs `step`, synchronizes the device, and returns the step's result with its wall time.
pub(crate) fn timed<D: Device, T, E: From<graft_core::DeviceError>>(
    device: &D,
    step: impl FnOnce() -> Result<T, E>,
) -> Result<(T, Duration), E> {
    let start = Instant::now();
    let value = step()?;
    device.synchronize()?;
    Ok((value, start.elapsed()))
}

/// The median of `times` in microseconds (the mean of the middle two for an even count);
/// 0 for none.
pub(crate) fn median_us(times: &[Duration]) -> f64 {
    median(times.iter().map(|t| t.as_secs_f64() * 1e6).collect())
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
pub(crate) fn median(mut us: Vec<f64>) -> f64 {
    if us.is_empty() {
        return 0.0;
    }
    us.sort_by(f64::total_cmp);
    let n = us.len();
    if n % 2 == 1 {
        us[n / 2]
    } else {
        (us[n / 2 - 1] + us[n / 2]) / 2.0
    }
}

/// Formats microseconds for the tables: "12.3 us" or "1.234 ms".
pub(crate) fn fmt_us(us: f64) -> String {
    if us >= 1000.0 {
        format!("{:.3} ms", us / 1000.0)
    } else {
        format!("{us:.1} us")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        let d = |us: u64| Duration::from_micros(us);
        assert_eq!(median_us(&[d(3), d(1), d(2)]), 2.0);
        assert_eq!(median_us(&[d(4), d(1), d(2), d(3)]), 2.5);
        assert_eq!(median_us(&[]), 0.0);
        assert_eq!(fmt_us(12.34), "12.3 us");
        assert_eq!(fmt_us(1234.0), "1.234 ms");
    }
}
