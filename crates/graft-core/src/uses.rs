//! How often a graph or a signature was used recently: a count that ages (see `admit.rs`).

/// How often a graph or a signature was used recently: the calls counted since the last
/// aging at full weight, and those before halved once per window since. The raw count it ages
/// lives with its owner and only grows.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct Uses {
    /// The aged count as of the last aging.
    aged: u64,
    /// The raw count at the last aging.
    seen: u64,
}

impl Uses {
    /// The aged count now, given the raw count `raw`.
    pub(crate) fn estimate(self, raw: u64) -> u64 {
        self.aged + (raw - self.seen)
    }

    /// Ages the count by `windows` (at least one) windows that passed since the last aging.
    /// The calls counted since then are taken as spread evenly over those windows (replays
    /// between two calls that do not replay are not told apart in time): each window's share
    /// is halved once for every window that ended after it, so a graph replayed steadily
    /// through a long stretch without other calls keeps the estimate of its rate.
    pub(crate) fn age(&mut self, raw: u64, windows: u64) {
        let halvings = windows.min(63) as u32;
        let share = (raw - self.seen) / windows;
        self.aged = (self.aged >> halvings) + share - (share >> halvings);
        self.seen = raw;
    }

    /// What [`Uses::estimate`] will say after aging by `windows` windows (none: now), given
    /// the raw count `raw` at that aging.
    pub(crate) fn estimate_aged(self, raw: u64, windows: u64) -> u64 {
        let mut aged = self;
        if windows > 0 {
            aged.age(raw, windows);
        }
        aged.estimate(raw)
    }

    /// Adds aged calls: those an evicted graph served, handed back to its signature.
    pub(crate) fn add(&mut self, calls: u64) {
        self.aged += calls;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_halve_once_per_window() {
        let mut u = Uses::default();
        assert_eq!(u.estimate(10), 10);
        u.age(10, 1);
        assert_eq!(u.estimate(10), 5);
        assert_eq!(u.estimate(16), 11, "new calls count in full");
        u.age(16, 1);
        assert_eq!(u.estimate(16), 5, "(5 + 6) / 2");
        u.age(16, 3);
        assert_eq!(u.estimate(16), 0);
        u.add(7);
        assert_eq!(u.estimate(16), 7);
    }

    #[test]
    fn a_steady_rate_keeps_its_estimate_however_late_the_aging() {
        // 100 calls per window, aged every window or after 8 windows at once.
        let (mut each, mut late) = (Uses::default(), Uses::default());
        for w in 1..=32u64 {
            each.age(100 * w, 1);
            if w % 8 == 0 {
                late.age(100 * w, 8);
            }
        }
        assert_eq!(each.estimate(3200), 99);
        assert!((95..=100).contains(&late.estimate(3200)), "{late:?}");
    }
}
