//! The pool's address range and its physical memory: reserving, mapping, pinning, releasing.

use super::*;

#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
impl Pool {
    /// Reserves the range if the pool has none yet.
    pub(super) fn ensure_reserved(
        &mut self,
        backing: &dyn Backing,
    ) -> Result<Reservation, PoolError> {
        if let Some(r) = self.reservation {
            return Ok(r);
        }
        let gran = backing.granularity();
        let bad = |addr, bytes| PoolError::BadReservation {
            addr,
            bytes,
            granularity: gran,
        };
        if gran == 0 || !gran.is_multiple_of(GRANULARITY) {
            return Err(bad(DevicePtr(0), self.reservation_bytes));
        }
        let size = self
            .reservation_bytes
            .max(1)
            .checked_next_multiple_of(gran)
            .ok_or(PoolError::TooLarge {
                bytes: self.reservation_bytes,
            })?;
        let ptr = backing
            .reserve(CORE, size)
            .map_err(|source| PoolError::Reserve {
                bytes: size,
                source,
            })?;
        if !ptr.0.is_multiple_of(gran as u64) || ptr.0.checked_add(size as u64).is_none() {
            return Err(bad(ptr, size));
        }
        tracing::debug!(addr = %ptr, bytes = size, "pool address range reserved");
        let r = Reservation {
            base: ptr.0,
            size,
            gran: gran as u64,
            serial: self.next_serial,
        };
        self.next_serial += 1;
        self.reservation = Some(r);
        self.blocks.insert(r.base, Slot { size, id: None });
        self.free.insert((size, r.base));
        Ok(r)
    }

    /// Maps every unmapped part of the granule-aligned `[s, e)`; all or nothing.
    pub(super) fn map_range(
        &mut self,
        backing: &dyn Backing,
        s: u64,
        e: u64,
    ) -> Result<(), PoolError> {
        let todo = gaps(&self.mapped, s, e);
        for (i, &(a, b)) in todo.iter().enumerate() {
            let len = (b - a) as usize;
            if let Err(source) = backing.map(CORE, DevicePtr(a), len) {
                for &(ua, ub) in &todo[..i] {
                    if let Err(error) = backing.unmap(CORE, DevicePtr(ua), (ub - ua) as usize) {
                        tracing::debug!(%error, addr = %DevicePtr(ua), "undoing a pool map failed; the memory stays mapped");
                        self.add_mapped(ua, ub);
                    }
                }
                return Err(PoolError::Grow {
                    addr: DevicePtr(a),
                    bytes: len,
                    source,
                });
            }
        }
        for &(a, b) in &todo {
            tracing::debug!(addr = %DevicePtr(a), bytes = b - a, "pool memory mapped");
            self.add_mapped(a, b);
        }
        Ok(())
    }

    fn add_mapped(&mut self, a: u64, b: u64) {
        insert_interval(&mut self.mapped, a, b);
        self.mapped_bytes += (b - a) as usize;
        self.note_peaks();
    }

    /// Marks memory a recorded graph reads or writes (its footprint): the granules these ranges
    /// touch are never unmapped until [`Pool::release_all`]. Ranges outside the pool's range are
    /// ignored (a graph also touches memory of other pools and of the caller).
    pub fn pin(&mut self, ranges: &[(DevicePtr, usize)]) {
        let Some(r) = self.reservation else {
            return;
        };
        for &(addr, len) in ranges {
            let s = addr.0.max(r.base);
            let e = end_of(addr.0, len).min(r.end());
            if s < e {
                insert_interval(&mut self.pins, r.floor(s), r.ceil(e));
            }
        }
    }

    /// Replaces every pin with `ranges` (after recorded graphs were destroyed: what they alone
    /// pinned may be unmapped by [`Pool::release_unused`] from then on).
    pub fn repin(&mut self, ranges: &[(DevicePtr, usize)]) {
        self.pins = Intervals::new();
        self.pin(ranges);
    }

    /// Forgets every block and pin, unmaps every mapped range and releases the address range.
    /// Every range is attempted; the first error is returned after all of them. Afterwards the
    /// pool is empty (all counters zero but the peaks) whatever the backing returned, every id
    /// is stale, and the next allocation reserves a new range.
    pub fn release_all(&mut self, backing: &dyn Backing) -> Result<(), PoolError> {
        let mut first = None;
        for (&a, &b) in &self.mapped {
            let bytes = (b - a) as usize;
            tracing::debug!(addr = %DevicePtr(a), bytes, "pool memory unmapped");
            if let Err(source) = backing.unmap(CORE, DevicePtr(a), bytes) {
                first.get_or_insert(PoolError::Release {
                    addr: DevicePtr(a),
                    bytes,
                    source,
                });
            }
        }
        if let Some(r) = self.reservation.take() {
            tracing::debug!(addr = %DevicePtr(r.base), bytes = r.size, "pool address range released");
            if let Err(source) = backing.release_reservation(CORE, DevicePtr(r.base), r.size) {
                first.get_or_insert(PoolError::Release {
                    addr: DevicePtr(r.base),
                    bytes: r.size,
                    source,
                });
            }
        }
        self.blocks.clear();
        self.free.clear();
        self.held = None;
        self.ids = IdMap::default();
        self.mapped.clear();
        self.pins.clear();
        self.mapped_bytes = 0;
        self.allocated = 0;
        first.map_or(Ok(()), Err)
    }

    /// Unmaps every mapped granule that no allocated block and no pin touches, and returns the
    /// bytes released. Every such range is attempted; the first error is returned after all of
    /// them, and a range the backing failed to unmap stays counted as mapped.
    ///
    /// Must not run between a [`Pool::checkpoint`] and its rollback (the checkpoint's blocks may
    /// lie over what it unmaps; [`Pool::try_rollback`] then fails), nor during a capture
    /// ([`Backing::unmap`] is illegal there).
    pub fn release_unused(&mut self, backing: &dyn Backing) -> Result<usize, PoolError> {
        let Some(r) = self.reservation else {
            return Ok(0);
        };
        // Granules entirely inside a free block are touched by no allocated block.
        let mut idle = Intervals::new();
        for (&a, s) in &self.blocks {
            if s.id.is_none() {
                let (gs, ge) = (r.ceil(a), r.floor(end_of(a, s.size)));
                if gs < ge {
                    idle.insert(gs, ge);
                }
            }
        }
        for (&a, &b) in &self.pins {
            remove_interval(&mut idle, a, b);
        }
        let todo: Vec<(u64, u64)> = idle
            .iter()
            .flat_map(|(&a, &b)| covered(&self.mapped, a, b))
            .collect();
        let mut released = 0;
        let mut first = None;
        for (a, b) in todo {
            let bytes = (b - a) as usize;
            match backing.unmap(CORE, DevicePtr(a), bytes) {
                Ok(()) => {
                    tracing::debug!(addr = %DevicePtr(a), bytes, "unused pool memory unmapped");
                    remove_interval(&mut self.mapped, a, b);
                    self.mapped_bytes -= bytes;
                    released += bytes;
                }
                Err(source) => {
                    first.get_or_insert(PoolError::Release {
                        addr: DevicePtr(a),
                        bytes,
                        source,
                    });
                }
            }
        }
        first.map_or(Ok(released), Err)
    }
}
