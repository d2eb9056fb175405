//! The caching allocator ("the pool"): segments from the device, carved into blocks, with checkpoints.
//!
//! The pool is pure bookkeeping. It never talks to a device: [`Pool::alloc`] is handed a closure
//! that reserves a new segment, and [`Pool::release_all`] / [`Pool::release_unused`] a closure
//! that gives one back. See [`Pool`] for the allocation policy and the two ways of resetting it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{DeviceError, DevicePtr};

/// Every block address and size is a multiple of this many bytes.
pub const GRANULARITY: usize = 512;
/// Requests of at most this many bytes (after rounding) are small; larger ones are large.
pub const SMALL_MAX: usize = 1 << 20;
/// Size of a segment of the small class.
pub const SMALL_SEGMENT: usize = 2 << 20;
/// Size of a segment of the large class for requests below [`LARGE_DEDICATED_MIN`].
pub const LARGE_SEGMENT: usize = 20 << 20;
/// Large requests of at least this many bytes get a segment of their own size, rounded up to a
/// multiple of [`LARGE_SEGMENT_ROUND`].
pub const LARGE_DEDICATED_MIN: usize = 10 << 20;
/// Rounding of dedicated large segments.
pub const LARGE_SEGMENT_ROUND: usize = 2 << 20;

/// Identifies an allocated block. Issued from a per-pool counter and never reused, so an id that
/// was freed, or made stale by [`Pool::restore`], [`Pool::rollback`] or a release, is detected.
///
/// The raw value is public so that handles can pack it into an atomic. The pool checks every id
/// it is given against its allocated set, so an id made up from a raw value is either an
/// allocated block's or [`PoolError::UnknownBlock`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u64);

impl BlockId {
    /// The id [`Pool::blocks`] reports for free blocks. The pool never issues it.
    pub const FREE: BlockId = BlockId(u64::MAX);

    /// The raw counter value, for logs and dumps.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == BlockId::FREE {
            f.write_str("block#free")
        } else {
            write!(f, "block#{}", self.0)
        }
    }
}

/// A block of a segment. For an allocated block, `size` is what the pool reserved for it: the
/// request rounded up, or more when the remainder was too small to split off.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Block {
    /// The block's id ([`BlockId::FREE`] for a free block in [`Pool::blocks`]).
    pub id: BlockId,
    /// First address.
    pub addr: DevicePtr,
    /// Bytes reserved for the block.
    pub size: usize,
}

/// Counters of a pool. `peak_*` are high-water marks since the pool was created.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PoolStats {
    /// Bytes of all segments held.
    pub reserved: usize,
    /// Bytes of all allocated blocks.
    pub allocated: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
    /// Allocated blocks.
    pub live_blocks: usize,
    /// Segments held.
    pub segments: usize,
}

/// Why a pool operation failed.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum PoolError {
    /// The device could not provide a new segment. The pool is unchanged.
    #[error("growing the pool by a {bytes}-byte segment failed: {source}")]
    Grow {
        /// Size of the segment asked for.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The id is not an allocated block of this pool.
    #[error(
        "{id} is not allocated in this pool: it was already freed, made stale by a restore, rollback or release, or comes from another pool; free each block once, with an id this pool issued"
    )]
    UnknownBlock {
        /// The id given.
        id: BlockId,
    },
    /// The device failed to take a segment back. The pool has forgotten the segment anyway.
    #[error(
        "returning the pool segment at {addr} ({bytes} bytes) to the device failed: {source}; the pool no longer uses it"
    )]
    Release {
        /// The segment's address.
        addr: DevicePtr,
        /// The segment's size.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The request cannot be rounded to the pool's granularity or segment size without overflow.
    #[error(
        "an allocation of {bytes} bytes is larger than the pool can address; request less memory"
    )]
    TooLarge {
        /// Bytes requested.
        bytes: usize,
    },
    /// The segment the device returned is misaligned, wraps around the address space or overlaps
    /// a segment the pool holds. The pool did not take it: the caller still owns it.
    #[error(
        "the device returned segment {addr}+{bytes} bytes, which is not 512-byte aligned or overlaps a segment the pool already holds; the pool did not take it, so free it; this is a bug in the device backend"
    )]
    BadSegment {
        /// Address returned by the device.
        addr: DevicePtr,
        /// Size asked for.
        bytes: usize,
    },
    /// The checkpoint was taken from another pool.
    #[error(
        "the checkpoint was taken from another pool; roll a pool back only to its own checkpoints"
    )]
    ForeignCheckpoint,
    /// A segment the checkpoint describes has been released since it was taken.
    #[error(
        "the checkpoint describes segment {segment}, which the pool has released since; take a new checkpoint after releasing memory"
    )]
    StaleCheckpoint {
        /// The released segment.
        segment: DevicePtr,
    },
}

/// Source of pool identities, so a checkpoint of another pool is recognised.
static NEXT_POOL_UID: AtomicU64 = AtomicU64::new(1);

/// A segment held by the pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Seg {
    size: usize,
    large: bool,
    /// Per-pool serial, so a released segment whose address comes back is not confused with it.
    serial: u64,
}

/// A block in the address map.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Slot {
    size: usize,
    /// Address of the segment holding the block.
    segment: u64,
    large: bool,
    /// `None` when free.
    id: Option<BlockId>,
}

/// A free list entry: (size, address, segment address). Ordered by size then address: best fit,
/// lowest address among equals.
type FreeKey = (usize, u64, u64);

/// A checkpoint's record of one segment.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct SegRec {
    addr: u64,
    seg: Seg,
}

/// An exact snapshot of a pool's bookkeeping (segment list, block layout, allocated ids), taken
/// with [`Pool::checkpoint`] and applied with [`Pool::rollback`]. It holds no device memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pool: u64,
    segments: Vec<SegRec>,
    /// Every block, address order.
    blocks: Vec<(u64, Slot)>,
}

impl Checkpoint {
    /// Allocated blocks in the snapshot, address order.
    pub fn allocated(&self) -> impl Iterator<Item = Block> + '_ {
        self.blocks.iter().filter_map(|(addr, slot)| {
            slot.id.map(|id| Block {
                id,
                addr: DevicePtr(*addr),
                size: slot.size,
            })
        })
    }
}

/// Multiply-rotate hasher for block ids (sequential integers): much cheaper than SipHash, and
/// the ids are not attacker-controlled.
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap = HashMap<BlockId, u64, BuildHasherDefault<IdHasher>>;

/// The caching allocator: the memory every recording and warm-up allocates from.
///
/// # Classes and rounding
///
/// Every request is rounded up to a multiple of [`GRANULARITY`] (512 bytes); a request of 0
/// bytes is treated as 512, so every block has a distinct address. Rounded requests of at most
/// [`SMALL_MAX`] (1 MiB) are *small* and are served from small segments of [`SMALL_SEGMENT`]
/// (2 MiB); larger ones are *large* and are served from large segments: [`LARGE_SEGMENT`]
/// (20 MiB) for requests under [`LARGE_DEDICATED_MIN`] (10 MiB), otherwise a segment of the
/// request rounded up to a multiple of [`LARGE_SEGMENT_ROUND`] (2 MiB). A segment, and every
/// block in it, belongs to one class for its whole life; the classes never share blocks.
///
/// # Allocation and free
///
/// [`Pool::alloc`] takes the best fit among the free blocks of the request's class (the smallest
/// that fits, the lowest address among equals). It splits the block when the remainder is at
/// least 512 bytes (small) or more than 1 MiB (large); otherwise it hands out the whole block,
/// and [`Block::size`] says so. When nothing fits it asks `grow` for one new segment. Both
/// `alloc` and [`Pool::free`] are O(log n) in the number of blocks; `free` coalesces the block
/// with free neighbours of the same segment, so free space is always the maximal gaps between
/// allocated blocks.
///
/// # Two ways back
///
/// * [`Pool::rollback`] is the *exact* restore: it puts back the block layout of a
///   [`Checkpoint`] of this pool, with the same ids, addresses and sizes allocated. Segments
///   reserved since the checkpoint stay reserved, entirely free. It undoes a failed recording.
/// * [`Pool::restore`] is the *liveness* restore: given the address ranges that are still in use
///   (the buffers callers still hold), it rebuilds the layout so exactly those ranges are
///   allocated, as new blocks with new ids, and every other byte of every segment is free. It is
///   how the pool is brought back from "what the last recording allocated" to "what is live"
///   before warming up or recording after replays.
///
/// Both leave [`PoolStats`] consistent (`allocated` is the sum of allocated block sizes) and make
/// every previously issued id that is not allocated afterwards stale.
#[derive(Debug)]
pub struct Pool {
    uid: u64,
    next_id: u64,
    next_serial: u64,
    segments: BTreeMap<u64, Seg>,
    blocks: BTreeMap<u64, Slot>,
    free_small: BTreeSet<FreeKey>,
    free_large: BTreeSet<FreeKey>,
    ids: IdMap,
    reserved: usize,
    allocated: usize,
    peak_allocated: usize,
    peak_reserved: usize,
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new()
    }
}

/// Rounds a request to the granularity (0 counts as 1 byte, so it becomes 512).
fn round_request(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(GRANULARITY)
}

/// The segment size for a rounded request.
fn segment_size(size: usize) -> Option<usize> {
    if size <= SMALL_MAX {
        Some(SMALL_SEGMENT)
    } else if size < LARGE_DEDICATED_MIN {
        Some(LARGE_SEGMENT)
    } else {
        size.checked_next_multiple_of(LARGE_SEGMENT_ROUND)
    }
}

/// End address of `len` bytes at `addr`.
fn end_of(addr: u64, len: usize) -> u64 {
    addr.saturating_add(len as u64)
}

impl Pool {
    /// An empty pool: no segments, no blocks.
    pub fn new() -> Pool {
        Pool {
            uid: NEXT_POOL_UID.fetch_add(1, Ordering::Relaxed),
            next_id: 0,
            next_serial: 0,
            segments: BTreeMap::new(),
            blocks: BTreeMap::new(),
            free_small: BTreeSet::new(),
            free_large: BTreeSet::new(),
            ids: IdMap::default(),
            reserved: 0,
            allocated: 0,
            peak_allocated: 0,
            peak_reserved: 0,
        }
    }

    fn free_set(&mut self, large: bool) -> &mut BTreeSet<FreeKey> {
        if large {
            &mut self.free_large
        } else {
            &mut self.free_small
        }
    }

    fn issue_id(&mut self) -> BlockId {
        let id = BlockId(self.next_id);
        self.next_id += 1;
        id
    }

    fn note_peaks(&mut self) {
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.peak_reserved = self.peak_reserved.max(self.reserved);
    }

    /// Allocates a block of at least `bytes` (rounded up to 512; 0 counts as 512).
    ///
    /// Takes the best-fitting free block of the request's class, splitting it; when none fits,
    /// calls `grow(segment_bytes)` once for a new segment and carves the block from it. If `grow`
    /// fails the pool is unchanged and [`PoolError::Grow`] is returned.
    pub fn alloc(
        &mut self,
        bytes: usize,
        grow: &mut dyn FnMut(usize) -> Result<DevicePtr, DeviceError>,
    ) -> Result<Block, PoolError> {
        let size = round_request(bytes).ok_or(PoolError::TooLarge { bytes })?;
        let large = size > SMALL_MAX;
        let set = if large {
            &mut self.free_large
        } else {
            &mut self.free_small
        };
        let (free_size, addr, segment) = match set.range((size, 0, 0)..).next().copied() {
            Some(key) => {
                set.remove(&key);
                key
            }
            None => {
                let seg_bytes = segment_size(size).ok_or(PoolError::TooLarge { bytes })?;
                let ptr = grow(seg_bytes).map_err(|source| PoolError::Grow {
                    bytes: seg_bytes,
                    source,
                })?;
                self.add_segment(ptr, seg_bytes, large)?;
                (seg_bytes, ptr.0, ptr.0)
            }
        };
        let remainder = free_size - size;
        let split = if large {
            remainder > SMALL_MAX
        } else {
            remainder >= GRANULARITY
        };
        let block_size = if split { size } else { free_size };
        if split {
            let rest = addr + size as u64;
            self.blocks.insert(
                rest,
                Slot {
                    size: remainder,
                    segment,
                    large,
                    id: None,
                },
            );
            self.free_set(large).insert((remainder, rest, segment));
        }
        let id = self.issue_id();
        self.blocks.insert(
            addr,
            Slot {
                size: block_size,
                segment,
                large,
                id: Some(id),
            },
        );
        self.ids.insert(id, addr);
        self.allocated += block_size;
        self.note_peaks();
        Ok(Block {
            id,
            addr: DevicePtr(addr),
            size: block_size,
        })
    }

    /// Takes a new segment into the bookkeeping as one free block that is *not* on a free list
    /// (the caller carves it at once).
    fn add_segment(&mut self, ptr: DevicePtr, bytes: usize, large: bool) -> Result<(), PoolError> {
        let addr = ptr.0;
        let bad = PoolError::BadSegment { addr: ptr, bytes };
        let Some(end) = addr.checked_add(bytes as u64) else {
            return Err(bad);
        };
        if !addr.is_multiple_of(GRANULARITY as u64) {
            return Err(bad);
        }
        if let Some((&prev, seg)) = self.segments.range(..=addr).next_back()
            && end_of(prev, seg.size) > addr
        {
            return Err(bad);
        }
        if let Some((&next, _)) = self.segments.range(addr..).next()
            && next < end
        {
            return Err(bad);
        }
        let serial = self.next_serial;
        self.next_serial += 1;
        self.segments.insert(
            addr,
            Seg {
                size: bytes,
                large,
                serial,
            },
        );
        self.blocks.insert(
            addr,
            Slot {
                size: bytes,
                segment: addr,
                large,
                id: None,
            },
        );
        self.reserved += bytes;
        Ok(())
    }

    /// Frees an allocated block, coalescing it with free neighbours in its segment, and returns
    /// its size. An id that is not allocated (freed, stale, or of another pool) is
    /// [`PoolError::UnknownBlock`] and changes nothing.
    pub fn free(&mut self, id: BlockId) -> Result<usize, PoolError> {
        let Some(&addr) = self.ids.get(&id) else {
            return Err(PoolError::UnknownBlock { id });
        };
        let Some(slot) = self.blocks.get(&addr).copied() else {
            return Err(PoolError::UnknownBlock { id });
        };
        self.ids.remove(&id);
        let size = slot.size;
        self.allocated = self.allocated.saturating_sub(size);
        let (mut start, mut len) = (addr, size);
        if let Some((&prev, p)) = self.blocks.range(..addr).next_back()
            && p.id.is_none()
            && p.segment == slot.segment
        {
            let key = (p.size, prev, p.segment);
            len += p.size;
            start = prev;
            self.free_set(slot.large).remove(&key);
            self.blocks.remove(&addr);
        }
        let next = addr + size as u64;
        if let Some(n) = self.blocks.get(&next).copied()
            && n.id.is_none()
            && n.segment == slot.segment
        {
            len += n.size;
            self.free_set(slot.large).remove(&(n.size, next, n.segment));
            self.blocks.remove(&next);
        }
        self.blocks.insert(
            start,
            Slot {
                size: len,
                segment: slot.segment,
                large: slot.large,
                id: None,
            },
        );
        self.free_set(slot.large).insert((len, start, slot.segment));
        Ok(size)
    }

    /// The allocated block with this id, if it is allocated.
    pub fn block(&self, id: BlockId) -> Option<Block> {
        let addr = *self.ids.get(&id)?;
        let slot = self.blocks.get(&addr)?;
        Some(Block {
            id,
            addr: DevicePtr(addr),
            size: slot.size,
        })
    }

    /// An exact snapshot of the bookkeeping: segments, block layout, allocated ids. O(n) in the
    /// number of blocks, two allocations.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            pool: self.uid,
            segments: self
                .segments
                .iter()
                .map(|(&addr, &seg)| SegRec { addr, seg })
                .collect(),
            blocks: self.blocks.iter().map(|(&a, &s)| (a, s)).collect(),
        }
    }

    /// Puts back the exact layout of `cp`: afterwards the allocated blocks (ids, addresses,
    /// sizes) are the checkpoint's, and segments reserved since the checkpoint stay reserved but
    /// are entirely free. Ids allocated since the checkpoint become stale.
    ///
    /// Rolling back across [`Pool::restore`] is exact too. Blocks of segments released since the
    /// checkpoint are gone and are left out; a checkpoint of another pool changes nothing (it
    /// is logged as a warning). [`Pool::try_rollback`] reports both cases as errors instead.
    pub fn rollback(&mut self, cp: &Checkpoint) {
        if cp.pool != self.uid {
            tracing::warn!("pool rollback to a checkpoint of another pool ignored");
            return;
        }
        self.rollback_unchecked(cp);
    }

    /// [`Pool::rollback`] that first checks `cp` is this pool's and that every segment it
    /// describes is still held; on error the pool is unchanged.
    pub fn try_rollback(&mut self, cp: &Checkpoint) -> Result<(), PoolError> {
        if cp.pool != self.uid {
            return Err(PoolError::ForeignCheckpoint);
        }
        for rec in &cp.segments {
            if self.segments.get(&rec.addr) != Some(&rec.seg) {
                return Err(PoolError::StaleCheckpoint {
                    segment: DevicePtr(rec.addr),
                });
            }
        }
        self.rollback_unchecked(cp);
        Ok(())
    }

    fn rollback_unchecked(&mut self, cp: &Checkpoint) {
        let mut layout = Vec::with_capacity(cp.blocks.len() + self.segments.len());
        for (&addr, seg) in &self.segments {
            let same = cp
                .segments
                .binary_search_by_key(&addr, |r| r.addr)
                .is_ok_and(|i| cp.segments[i].seg == *seg);
            let old: &[(u64, Slot)] = if same {
                let lo = cp.blocks.partition_point(|(a, _)| *a < addr);
                let end = end_of(addr, seg.size);
                let hi = lo + cp.blocks[lo..].partition_point(|(a, _)| *a < end);
                &cp.blocks[lo..hi]
            } else {
                &[]
            };
            if old.is_empty() {
                layout.push((
                    addr,
                    Slot {
                        size: seg.size,
                        segment: addr,
                        large: seg.large,
                        id: None,
                    },
                ));
            } else {
                layout.extend_from_slice(old);
            }
        }
        self.install(layout);
    }

    /// Replaces the bookkeeping with `layout`: every block of every segment, address order.
    fn install(&mut self, layout: Vec<(u64, Slot)>) {
        let mut free_small = Vec::new();
        let mut free_large = Vec::new();
        let mut ids = IdMap::with_capacity_and_hasher(layout.len(), Default::default());
        let mut allocated = 0;
        for &(addr, slot) in &layout {
            match slot.id {
                Some(id) => {
                    ids.insert(id, addr);
                    allocated += slot.size;
                    self.next_id = self.next_id.max(id.0.saturating_add(1));
                }
                None if slot.large => free_large.push((slot.size, addr, slot.segment)),
                None => free_small.push((slot.size, addr, slot.segment)),
            }
        }
        // Bulk construction from sorted runs: linear, no rebalancing.
        self.blocks = layout.into_iter().collect();
        self.free_small = free_small.into_iter().collect();
        self.free_large = free_large.into_iter().collect();
        self.ids = ids;
        self.allocated = allocated;
        self.note_peaks();
    }

    /// Rebuilds the bookkeeping so that exactly the given live ranges are allocated and every
    /// other byte of every segment is free.
    ///
    /// Each range `(addr, len)` is widened to the granularity: its start rounded down and its end
    /// up to a multiple of 512 (a `len` of 0 counts as 1 byte, as in [`Pool::alloc`]). Returns,
    /// per input range in order, `Some(block)` if it was placed (it lies entirely inside one
    /// segment and does not overlap a range placed before it in the input), else `None`. New
    /// blocks get new ids in input order; every id issued before becomes stale.
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
            let Some((&seg_addr, seg)) = self.segments.range(..=start).next_back() else {
                continue;
            };
            if end > end_of(seg_addr, seg.size) {
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

        let mut layout = Vec::with_capacity(2 * placed.len() + self.segments.len());
        for (&seg_addr, seg) in &self.segments {
            let seg_end = end_of(seg_addr, seg.size);
            let slot = |size: u64, id| Slot {
                size: size as usize,
                segment: seg_addr,
                large: seg.large,
                id,
            };
            let mut cursor = seg_addr;
            for (&start, &(end, id)) in placed.range(seg_addr..seg_end) {
                if start > cursor {
                    layout.push((cursor, slot(start - cursor, None)));
                }
                layout.push((start, slot(end - start, Some(id))));
                cursor = end;
            }
            if seg_end > cursor {
                layout.push((cursor, slot(seg_end - cursor, None)));
            }
        }
        self.install(layout);
        out
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            reserved: self.reserved,
            allocated: self.allocated,
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            live_blocks: self.ids.len(),
            segments: self.segments.len(),
        }
    }

    /// `(address, size)` of each segment, address order.
    pub fn segments(&self) -> Vec<(DevicePtr, usize)> {
        self.segments
            .iter()
            .map(|(&a, s)| (DevicePtr(a), s.size))
            .collect()
    }

    /// Every block, address order, with whether it is allocated. Free blocks carry
    /// [`BlockId::FREE`]. For reports and tests.
    pub fn blocks(&self) -> Vec<(Block, bool)> {
        self.blocks
            .iter()
            .map(|(&a, s)| {
                (
                    Block {
                        id: s.id.unwrap_or(BlockId::FREE),
                        addr: DevicePtr(a),
                        size: s.size,
                    },
                    s.id.is_some(),
                )
            })
            .collect()
    }

    /// Forgets every block and hands every segment to `free`. Every segment is attempted; the
    /// first error is returned after all of them. Afterwards the pool is empty (all counters
    /// zero but the peaks), whatever `free` returned, and every id is stale.
    pub fn release_all(
        &mut self,
        free: &mut dyn FnMut(DevicePtr, usize) -> Result<(), DeviceError>,
    ) -> Result<(), PoolError> {
        let mut first = None;
        for (&addr, seg) in &self.segments {
            if let Err(source) = free(DevicePtr(addr), seg.size) {
                first.get_or_insert(PoolError::Release {
                    addr: DevicePtr(addr),
                    bytes: seg.size,
                    source,
                });
            }
        }
        self.segments.clear();
        self.blocks.clear();
        self.free_small.clear();
        self.free_large.clear();
        self.ids = IdMap::default();
        self.reserved = 0;
        self.allocated = 0;
        first.map_or(Ok(()), Err)
    }

    /// Hands to `free` every segment that is entirely free and returns the bytes released. Every
    /// such segment is attempted and forgotten, even when `free` fails for it; the first error
    /// is returned after all of them. Meant for pools that no recorded graph uses: a graph may
    /// still write into memory the bookkeeping shows as free.
    pub fn release_unused(
        &mut self,
        free: &mut dyn FnMut(DevicePtr, usize) -> Result<(), DeviceError>,
    ) -> Result<usize, PoolError> {
        let unused: Vec<(u64, Seg)> = self
            .segments
            .iter()
            .filter(|(addr, seg)| {
                self.blocks
                    .get(addr)
                    .is_some_and(|b| b.id.is_none() && b.size == seg.size)
            })
            .map(|(&a, &s)| (a, s))
            .collect();
        let mut released = 0;
        let mut first = None;
        for (addr, seg) in unused {
            self.segments.remove(&addr);
            self.blocks.remove(&addr);
            self.free_set(seg.large).remove(&(seg.size, addr, addr));
            self.reserved -= seg.size;
            match free(DevicePtr(addr), seg.size) {
                Ok(()) => released += seg.size,
                Err(source) => {
                    first.get_or_insert(PoolError::Release {
                        addr: DevicePtr(addr),
                        bytes: seg.size,
                        source,
                    });
                }
            }
        }
        first.map_or(Ok(released), Err)
    }

    /// Checks every internal invariant of the bookkeeping; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let gran = GRANULARITY as u64;
        let mut free_small = BTreeSet::new();
        let mut free_large = BTreeSet::new();
        let mut allocated = 0;
        let mut live = 0;
        let mut iter = self.blocks.iter().peekable();
        for (&seg_addr, seg) in &self.segments {
            let seg_end = end_of(seg_addr, seg.size);
            let mut cursor = seg_addr;
            let mut prev_free = false;
            while cursor < seg_end {
                let Some((&a, s)) = iter.next() else {
                    return Err(format!(
                        "segment {seg_addr:#x} not covered from {cursor:#x}"
                    ));
                };
                if a != cursor || s.segment != seg_addr || s.large != seg.large {
                    return Err(format!("block {a:#x} {s:?} misplaced at {cursor:#x}"));
                }
                if s.size == 0 || !s.size.is_multiple_of(GRANULARITY) || !a.is_multiple_of(gran) {
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
                        allocated += s.size;
                        live += 1;
                        prev_free = false;
                    }
                    None => {
                        if prev_free {
                            return Err(format!("free block {a:#x} not coalesced"));
                        }
                        prev_free = true;
                        if s.large {
                            free_large.insert((s.size, a, seg_addr));
                        } else {
                            free_small.insert((s.size, a, seg_addr));
                        }
                    }
                }
                cursor = end_of(a, s.size);
            }
            if cursor != seg_end {
                return Err(format!("segment {seg_addr:#x} overrun"));
            }
        }
        if let Some((a, _)) = iter.next() {
            return Err(format!("block {a:#x} outside every segment"));
        }
        if live != self.ids.len() {
            return Err(format!(
                "{} ids mapped, {live} blocks allocated",
                self.ids.len()
            ));
        }
        if free_small != self.free_small || free_large != self.free_large {
            return Err("free lists differ from the layout".to_owned());
        }
        if allocated != self.allocated {
            return Err(format!("allocated {} != {allocated}", self.allocated));
        }
        let reserved: usize = self.segments.values().map(|s| s.size).sum();
        if reserved != self.reserved {
            return Err(format!("reserved {} != {reserved}", self.reserved));
        }
        if self.peak_allocated < self.allocated || self.peak_reserved < self.reserved {
            return Err("peak below the current value".to_owned());
        }
        Ok(())
    }
}
