//! Shorter GPU test loops under compute-sanitizer: `scripts/gpu-run.sh --sanitize` sets
//! [`UNDER_SANITIZER`], long tests take their loop counts from [`steps`], and tests of
//! overlapping kernels ask [`under_sanitizer`].

/// The environment variable `scripts/gpu-run.sh` sets (to `1`) for the test executables it runs
/// under compute-sanitizer (memcheck, racecheck), which slow every launch down by orders of
/// magnitude.
pub const UNDER_SANITIZER: &str = "GRAFT_UNDER_SANITIZER";

/// Whether this process runs under compute-sanitizer: [`UNDER_SANITIZER`] is set to anything
/// but empty or `0`. The sanitizer runs one kernel at a time, so no programmatic dependent
/// overlaps the kernel before it there.
pub fn under_sanitizer() -> bool {
    std::env::var_os(UNDER_SANITIZER).is_some_and(|v| !v.is_empty() && v != "0")
}

/// How many times a long test loop runs: `full`, or under the sanitizer `few` (never more
/// than `full`), a handful the test picks as enough for what it checks (a warmup, a recording
/// and some replays, usually 4 to 8). Tests write their count-dependent assertions in terms
/// of the result, so with the variable unset they assert exactly what they did with `full`.
pub fn steps(full: usize, few: usize) -> usize {
    steps_for(full, few, under_sanitizer())
}

/// [`steps`], with whether the sanitizer runs given.
fn steps_for(full: usize, few: usize, sanitized: bool) -> usize {
    if sanitized { full.min(few) } else { full }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_count_without_the_sanitizer() {
        assert_eq!(steps_for(1000, 6, false), 1000);
        assert_eq!(steps_for(3, 6, false), 3);
    }

    #[test]
    fn a_few_steps_under_the_sanitizer() {
        assert_eq!(steps_for(1000, 6, true), 6);
        assert_eq!(steps_for(3, 6, true), 3, "never more than the full count");
    }
}
