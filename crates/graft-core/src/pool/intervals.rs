//! Sets of disjoint address intervals: the mapped granules and the pins.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent half-open intervals `start -> end`, merged on insert.
pub(super) type Intervals = BTreeMap<u64, u64>;

/// Adds `[s, e)` to `set`, merging with overlapping or adjacent intervals.
pub(super) fn insert_interval(set: &mut Intervals, mut s: u64, mut e: u64) {
    if s >= e {
        return;
    }
    if let Some((&ps, &pe)) = set.range(..=s).next_back()
        && pe >= s
    {
        s = ps;
        e = e.max(pe);
        set.remove(&ps);
    }
    while let Some((&ns, &ne)) = set.range(s..).next() {
        if ns > e {
            break;
        }
        e = e.max(ne);
        set.remove(&ns);
    }
    set.insert(s, e);
}

/// Removes `[s, e)` from `set`.
pub(super) fn remove_interval(set: &mut Intervals, s: u64, e: u64) {
    if s >= e {
        return;
    }
    let mut touched: Vec<(u64, u64)> = Vec::new();
    if let Some((&ps, &pe)) = set.range(..s).next_back()
        && pe > s
    {
        touched.push((ps, pe));
    }
    touched.extend(set.range(s..e).map(|(&a, &b)| (a, b)));
    for (a, b) in touched {
        set.remove(&a);
        if a < s {
            set.insert(a, s);
        }
        if b > e {
            set.insert(e, b);
        }
    }
}

/// The parts of `[s, e)` that `set` does not cover, in order.
pub(super) fn gaps(set: &Intervals, s: u64, e: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut cursor = s;
    for (a, b) in covered(set, s, e) {
        if a > cursor {
            out.push((cursor, a));
        }
        cursor = b;
    }
    if cursor < e {
        out.push((cursor, e));
    }
    out
}

/// The parts of `[s, e)` that `set` covers, in order.
pub(super) fn covered(set: &Intervals, s: u64, e: u64) -> Vec<(u64, u64)> {
    if s >= e {
        return Vec::new();
    }
    let first = set
        .range(..=s)
        .next_back()
        .filter(|&(_, &pe)| pe > s)
        .map(|(&a, &b)| (a, b));
    first
        .into_iter()
        .chain(set.range(s.saturating_add(1)..e).map(|(&a, &b)| (a, b)))
        .map(|(a, b)| (a.max(s), b.min(e)))
        .filter(|(a, b)| a < b)
        .collect()
}

/// Whether `set` covers all of `[s, e)`.
pub(super) fn covers(set: &Intervals, s: u64, e: u64) -> bool {
    s >= e || set.range(..=s).next_back().is_some_and(|(_, &pe)| pe >= e)
}
