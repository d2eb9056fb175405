//! Resetting the block layout: exact checkpoints and rollbacks, and the liveness restore.

use std::collections::BTreeMap;

use super::*;

/// An exact snapshot of a pool's block layout (allocated ids, addresses, sizes), taken with
/// [`Pool::checkpoint`] and applied with [`Pool::rollback`]. It holds no device memory.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Checkpoint {
    pool: u64,
    /// Serial of the reservation it was taken in (`None`: no reservation).
    reservation: Option<u64>,
    /// Allocated blocks, address order: (address, size, id).
    allocated: Vec<(u64, usize, BlockId)>,
}

impl Checkpoint {
    /// Allocated blocks in the snapshot, address order.
    #[cfg(feature = "test-support")]
    pub fn allocated(&self) -> impl Iterator<Item = Block> + '_ {
        self.allocated.iter().map(|&(addr, size, id)| Block {
            id,
            addr: DevicePtr(addr),
            size,
        })
    }
}

#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
impl Pool {
    /// An exact snapshot of the block layout: allocated ids, addresses and sizes. O(n) in the
    /// number of blocks, one allocation.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            pool: self.uid,
            reservation: self.reservation.map(|r| r.serial),
            allocated: self
                .blocks
                .iter()
                .filter_map(|(&a, s)| s.id.map(|id| (a, s.size, id)))
                .collect(),
        }
    }

    /// Puts back the exact layout of `cp`: afterwards the allocated blocks (ids, addresses,
    /// sizes) are the checkpoint's and every other byte of the range is free. The mapping is
    /// unchanged. Ids allocated since the checkpoint become stale.
    ///
    /// Rolling back across [`Pool::restore`] is exact too. Blocks over memory unmapped or
    /// released since the checkpoint (which [`Pool::release_unused`] must not do between a
    /// checkpoint and its rollback) are left out; a checkpoint of another pool changes nothing
    /// (it is logged as a warning). [`Pool::try_rollback`] reports both cases as errors instead.
    pub fn rollback(&mut self, cp: &Checkpoint) {
        if cp.pool != self.uid {
            tracing::warn!("pool rollback to a checkpoint of another pool ignored");
            return;
        }
        let same = cp.reservation.is_some() && cp.reservation == self.reservation.map(|r| r.serial);
        let keep: Vec<(u64, usize, BlockId)> = if same {
            cp.allocated
                .iter()
                .copied()
                .filter(|&(a, s, _)| covers(&self.mapped, a, end_of(a, s)))
                .collect()
        } else {
            Vec::new()
        };
        self.install(keep);
    }

    /// [`Pool::rollback`] that first checks `cp` is this pool's and that every allocated block
    /// it describes lies over memory that is still mapped; on error the pool is unchanged.
    #[cfg(feature = "test-support")]
    pub fn try_rollback(&mut self, cp: &Checkpoint) -> Result<(), PoolError> {
        if cp.pool != self.uid {
            return Err(PoolError::ForeignCheckpoint);
        }
        let same = cp.reservation == self.reservation.map(|r| r.serial);
        for &(a, s, _) in &cp.allocated {
            if !same || !covers(&self.mapped, a, end_of(a, s)) {
                return Err(PoolError::StaleCheckpoint {
                    addr: DevicePtr(a),
                    bytes: s,
                });
            }
        }
        self.rollback(cp);
        Ok(())
    }

    /// Replaces the block layout: exactly `allocated` (address order, disjoint, inside the
    /// range, mapped) are allocated, every gap between them is one free block.
    fn install(&mut self, allocated: Vec<(u64, usize, BlockId)>) {
        self.held = None;
        let mut ids = IdMap::with_capacity_and_hasher(allocated.len(), Default::default());
        let mut blocks = Vec::with_capacity(2 * allocated.len() + 1);
        let mut free = Vec::with_capacity(allocated.len() + 1);
        let mut total = 0;
        if let Some(r) = self.reservation {
            // Every byte between `from` and `to` is one free block.
            let mut gap = |from: u64, to: u64, blocks: &mut Vec<(u64, Slot)>| {
                if to > from {
                    let size = (to - from) as usize;
                    blocks.push((from, Slot { size, id: None }));
                    free.push((size, from));
                }
            };
            let mut cursor = r.base;
            for &(a, s, id) in &allocated {
                gap(cursor, a, &mut blocks);
                blocks.push((
                    a,
                    Slot {
                        size: s,
                        id: Some(id),
                    },
                ));
                ids.insert(id, a);
                total += s;
                self.next_id = self.next_id.max(id.0.saturating_add(1));
                cursor = end_of(a, s);
            }
            gap(cursor, r.end(), &mut blocks);
        }
        // Bulk construction from sorted runs: linear, no rebalancing.
        self.blocks = blocks.into_iter().collect();
        self.free = free.into_iter().collect();
        self.ids = ids;
        self.allocated = total;
        self.note_peaks();
    }

    /// Rebuilds the block layout so that exactly the given live ranges are allocated and every
    /// other byte of the range is free. The mapping is unchanged.
    ///
    /// Each range `(addr, len)` is widened to the granularity: its start rounded down and its end
    /// up to a multiple of 512 (a `len` of 0 counts as 1 byte, as in [`Pool::alloc`]). Returns,
    /// per input range in order, `Some(block)` if it was placed (it lies entirely inside the
    /// pool's mapped memory and does not overlap a range placed before it in the input), else
    /// `None`. New blocks get new ids in input order; every id issued before becomes stale.
    pub fn restore(&mut self, live: &[(DevicePtr, usize)]) -> Vec<Option<Block>> {
        let gran = GRANULARITY as u64;
        let mut out = vec![None; live.len()];
        // start -> (end, id)
        let mut placed: BTreeMap<u64, (u64, BlockId)> = BTreeMap::new();
        for (i, &(addr, len)) in live.iter().enumerate() {
            let start = addr.0 - addr.0 % gran;
            let Some(end) = addr
                .0
                .checked_add(len.max(1) as u64)
                .and_then(|e| e.checked_next_multiple_of(gran))
            else {
                continue;
            };
            if !covers(&self.mapped, start, end) {
                continue;
            }
            if let Some((_, &(prev_end, _))) = placed.range(..=start).next_back()
                && prev_end > start
            {
                continue;
            }
            if let Some((&next_start, _)) = placed.range(start..).next()
                && next_start < end
            {
                continue;
            }
            let id = self.issue_id();
            placed.insert(start, (end, id));
            out[i] = Some(Block {
                id,
                addr: DevicePtr(start),
                size: (end - start) as usize,
            });
        }
        self.install(
            placed
                .into_iter()
                .map(|(s, (e, id))| (s, (e - s) as usize, id))
                .collect(),
        );
        out
    }
}
