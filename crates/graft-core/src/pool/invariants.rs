//! The bookkeeping's invariants, checked by graft's tests.

use std::collections::BTreeSet;

use super::*;

impl Pool {
    /// Checks every internal invariant of the bookkeeping; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let gran = GRANULARITY as u64;
        let mut free = BTreeSet::new();
        let mut allocated = 0;
        let mut live = 0;
        match self.reservation {
            None => {
                if !self.blocks.is_empty() || !self.mapped.is_empty() {
                    return Err("blocks or mappings without a reservation".to_owned());
                }
            }
            Some(r) => {
                let mut cursor = r.base;
                let mut prev_free = false;
                for (&a, s) in &self.blocks {
                    if a != cursor {
                        return Err(format!("block {a:#x} {s:?} misplaced at {cursor:#x}"));
                    }
                    if s.size == 0 || !s.size.is_multiple_of(GRANULARITY) || !a.is_multiple_of(gran)
                    {
                        return Err(format!("block {a:#x} {s:?} not granular"));
                    }
                    match s.id {
                        Some(id) => {
                            if self.ids.get(&id) != Some(&a) {
                                return Err(format!("id {id} not mapped to {a:#x}"));
                            }
                            if id.0 >= self.next_id {
                                return Err(format!("id {id} not below the counter"));
                            }
                            if !covers(&self.mapped, a, end_of(a, s.size)) {
                                return Err(format!("allocated block {a:#x} {s:?} not mapped"));
                            }
                            allocated += s.size;
                            live += 1;
                            prev_free = false;
                        }
                        None => {
                            if prev_free {
                                return Err(format!("free block {a:#x} not coalesced"));
                            }
                            prev_free = true;
                            free.insert((s.size, a));
                        }
                    }
                    cursor = end_of(a, s.size);
                }
                if cursor != r.end() {
                    return Err(format!("range not covered from {cursor:#x}"));
                }
                for (&a, &b) in self.mapped.iter().chain(&self.pins) {
                    if a >= b
                        || a < r.base
                        || b > r.end()
                        || !(a - r.base).is_multiple_of(r.gran)
                        || !(b - r.base).is_multiple_of(r.gran)
                    {
                        return Err(format!("interval {a:#x}..{b:#x} not granular"));
                    }
                }
                for set in [&self.mapped, &self.pins] {
                    let mut last: Option<u64> = None;
                    for (&a, &b) in set {
                        if last.is_some_and(|l| l >= a) {
                            return Err(format!("interval {a:#x}..{b:#x} not merged"));
                        }
                        last = Some(b);
                    }
                }
            }
        }
        if live != self.ids.len() {
            return Err(format!(
                "{} ids mapped, {live} blocks allocated",
                self.ids.len()
            ));
        }
        if free != self.free {
            return Err("free list differs from the layout".to_owned());
        }
        if allocated != self.allocated {
            return Err(format!("allocated {} != {allocated}", self.allocated));
        }
        let mapped: u64 = self.mapped.iter().map(|(a, b)| b - a).sum();
        if mapped as usize != self.mapped_bytes {
            return Err(format!("mapped {} != {mapped}", self.mapped_bytes));
        }
        if self.peak_allocated < self.allocated || self.peak_reserved < self.mapped_bytes {
            return Err("peak below the current value".to_owned());
        }
        Ok(())
    }
}
