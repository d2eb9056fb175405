//! The bookkeeping's invariants, checked by graft's tests.

use std::collections::BTreeSet;

use super::*;

/// A broken invariant of the pool's bookkeeping: a bug in the pool.
#[derive(thiserror::Error, Clone, Copy, PartialEq, Eq, Debug)]
#[error("the pool's bookkeeping is broken at {at:#x}: {what}; this is a bug in graft")]
pub struct InvariantViolation {
    /// Which invariant.
    pub what: &'static str,
    /// The address where it was found (0 for the pool's counters).
    pub at: u64,
}

fn broken(what: &'static str, at: u64) -> InvariantViolation {
    InvariantViolation { what, at }
}

impl Pool {
    /// Checks every internal invariant of the bookkeeping; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let gran = GRANULARITY as u64;
        let mut free = BTreeSet::new();
        let mut allocated = 0;
        let mut live = 0;
        match self.reservation {
            None => {
                if !self.blocks.is_empty() || !self.mapped.is_empty() {
                    return Err(broken("blocks or mappings without a reservation", 0));
                }
            }
            Some(r) => {
                let mut cursor = r.base;
                let mut prev_free = false;
                for (&a, s) in &self.blocks {
                    if a != cursor {
                        return Err(broken("a block is not where the previous one ends", a));
                    }
                    if s.size == 0 || !s.size.is_multiple_of(GRANULARITY) || !a.is_multiple_of(gran)
                    {
                        return Err(broken("a block is not a multiple of 512 bytes", a));
                    }
                    match s.id {
                        Some(id) => {
                            if self.ids.get(&id) != Some(&a) {
                                return Err(broken(
                                    "an allocated block's id does not map to it",
                                    a,
                                ));
                            }
                            if id.0 >= self.next_id {
                                return Err(broken(
                                    "an allocated block's id is not below the id counter",
                                    a,
                                ));
                            }
                            if !covers(&self.mapped, a, end_of(a, s.size)) {
                                return Err(broken("an allocated block is not fully mapped", a));
                            }
                            allocated += s.size;
                            live += 1;
                            prev_free = false;
                        }
                        None => {
                            if prev_free {
                                return Err(broken("two free blocks are neighbours", a));
                            }
                            prev_free = true;
                            free.insert((s.size, a));
                        }
                    }
                    cursor = end_of(a, s.size);
                }
                if cursor != r.end() {
                    return Err(broken("the blocks do not cover the range", cursor));
                }
                for (&a, &b) in self.mapped.iter().chain(&self.pins) {
                    if a >= b
                        || a < r.base
                        || b > r.end()
                        || !(a - r.base).is_multiple_of(r.gran)
                        || !(b - r.base).is_multiple_of(r.gran)
                    {
                        return Err(broken(
                            "a mapped or pinned interval is not granule-aligned",
                            a,
                        ));
                    }
                }
                for set in [&self.mapped, &self.pins] {
                    let mut last: Option<u64> = None;
                    for (&a, &b) in set {
                        if last.is_some_and(|l| l >= a) {
                            return Err(broken("mapped or pinned intervals are not merged", a));
                        }
                        last = Some(b);
                    }
                }
            }
        }
        if live != self.ids.len() {
            return Err(broken("the id map and the allocated blocks differ", 0));
        }
        if free != self.free {
            return Err(broken("the free list differs from the layout", 0));
        }
        if allocated != self.allocated {
            return Err(broken("the allocated counter differs from the blocks", 0));
        }
        let mapped: u64 = self.mapped.iter().map(|(a, b)| b - a).sum();
        if mapped as usize != self.mapped_bytes {
            return Err(broken("the mapped counter differs from the intervals", 0));
        }
        if self.peak_allocated < self.allocated || self.peak_mapped < self.mapped_bytes {
            return Err(broken("a peak is below its current value", 0));
        }
        Ok(())
    }
}
