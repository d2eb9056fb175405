//! The caching allocator ("the pool"): one reserved address range, physical memory mapped in on demand, carved into blocks, with checkpoints.
//!
//! The pool is pure bookkeeping. It talks to memory only through the [`Backing`] it is handed
//! (every [`Device`] is one): [`Pool::alloc`] reserves the pool's address range on first use
//! and maps the granules a new block needs, [`Pool::release_unused`] and [`Pool::release_all`]
//! unmap them again. See [`Pool`] for the allocation policy, the mapping rules and the two ways
//! of resetting the layout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{Device, DeviceError, DevicePtr};

/// Every block address and size is a multiple of this many bytes.
pub(crate) const GRANULARITY: usize = 512;

/// What the pool needs from the memory behind it: the memory calls of [`Device`] (see the
/// device module's Memory section for their rules). Every device is one; tests use fakes.
pub trait Backing {
    /// See [`Device::granularity`].
    fn granularity(&self) -> usize;
    /// See [`Device::reserve`].
    fn reserve(&self, bytes: usize) -> Result<DevicePtr, DeviceError>;
    /// See [`Device::release_reservation`].
    fn release_reservation(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;
    /// See [`Device::map`].
    fn map(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;
    /// See [`Device::unmap`].
    fn unmap(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;
}

impl<D: Device> Backing for D {
    fn granularity(&self) -> usize {
        Device::granularity(self)
    }
    fn reserve(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        Device::reserve(self, bytes)
    }
    fn release_reservation(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        Device::release_reservation(self, addr, bytes)
    }
    fn map(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        Device::map(self, addr, bytes)
    }
    fn unmap(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        Device::unmap(self, addr, bytes)
    }
}

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

/// A block of the pool's range. For an allocated block, `size` is the request rounded up to
/// [`GRANULARITY`].
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
    /// Bytes of physical memory mapped into the pool's range (what the pool holds).
    pub reserved: usize,
    /// Bytes of all allocated blocks.
    pub allocated: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
    /// Allocated blocks.
    pub live_blocks: usize,
    /// Maximal contiguous mapped ranges.
    pub mapped_ranges: usize,
    /// Bytes of address space reserved (0 until the first allocation, and after a release).
    pub address_space: usize,
}

/// Why a pool operation failed.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum PoolError {
    /// Reserving the pool's address range failed. The pool is unchanged.
    #[error(
        "reserving {bytes} bytes of address space for the pool failed: {source}; lower Config::pool_reservation"
    )]
    Reserve {
        /// Size of the range asked for.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// Mapping physical memory under a new block failed. The block layout is unchanged.
    #[error("mapping {bytes} bytes of device memory into the pool at {addr} failed: {source}")]
    Grow {
        /// First address of the range that could not be mapped.
        addr: DevicePtr,
        /// Size of that range.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The device is out of memory even after graft released the memory no block and no
    /// recorded graph uses.
    #[error(
        "out of device memory allocating {bytes} bytes: the pool holds {mapped} bytes, {allocated} of them live ({source}); free buffers you hold, call Graft::reset to drop recorded graphs, or lower the batch size"
    )]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
        /// Bytes mapped into the pool.
        mapped: usize,
        /// Bytes in allocated blocks of the pool.
        allocated: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The request does not fit in the free part of the pool's address range.
    #[error(
        "an allocation of {bytes} bytes does not fit in the pool's {reservation}-byte address range ({allocated} bytes allocated); raise Config::pool_reservation"
    )]
    ReservationExhausted {
        /// Bytes requested.
        bytes: usize,
        /// Size of the pool's address range.
        reservation: usize,
        /// Bytes allocated when it failed.
        allocated: usize,
    },
    /// The id is not an allocated block of this pool.
    #[error(
        "{id} is not allocated in this pool: it was already freed, made stale by a restore, rollback or release, or comes from another pool; free each block once, with an id this pool issued"
    )]
    UnknownBlock {
        /// The id given.
        id: BlockId,
    },
    /// The device failed to take memory back. The pool's bookkeeping says why it still counts
    /// it or not (see [`Pool::release_unused`] and [`Pool::release_all`]).
    #[error("returning {addr}+{bytes} bytes of the pool to the device failed: {source}")]
    Release {
        /// First address.
        addr: DevicePtr,
        /// Bytes.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The request cannot be rounded to the pool's granularity without overflow.
    #[error(
        "an allocation of {bytes} bytes is larger than the pool can address; request less memory"
    )]
    TooLarge {
        /// Bytes requested.
        bytes: usize,
    },
    /// The backing's granularity or reservation breaks its contract. The pool did not take it.
    #[error(
        "the device returned reservation {addr}+{bytes} bytes with granularity {granularity}, which is not aligned to it or not a multiple of 512 bytes; this is a bug in the device backend"
    )]
    BadReservation {
        /// Address returned (0 when the granularity alone was wrong).
        addr: DevicePtr,
        /// Size asked for.
        bytes: usize,
        /// The backing's granularity.
        granularity: usize,
    },
    /// The checkpoint was taken from another pool.
    #[error(
        "the checkpoint was taken from another pool; roll a pool back only to its own checkpoints"
    )]
    ForeignCheckpoint,
    /// A block the checkpoint describes lies over memory the pool has unmapped or released since.
    #[error(
        "the checkpoint's block at {addr} ({bytes} bytes) lies over memory the pool has unmapped or released since; do not release memory between a checkpoint and its rollback"
    )]
    StaleCheckpoint {
        /// The block's address.
        addr: DevicePtr,
        /// The block's size.
        bytes: usize,
    },
}

/// Source of pool identities, so a checkpoint of another pool is recognised.
static NEXT_POOL_UID: AtomicU64 = AtomicU64::new(1);

/// The pool's address range.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Reservation {
    base: u64,
    size: usize,
    /// Mapping granularity of the backing.
    gran: u64,
    /// Per-pool serial, so a checkpoint of an earlier reservation is recognised.
    serial: u64,
}

impl Reservation {
    fn end(&self) -> u64 {
        self.base + self.size as u64
    }
    fn floor(&self, a: u64) -> u64 {
        self.base + (a - self.base) / self.gran * self.gran
    }
    fn ceil(&self, a: u64) -> u64 {
        self.base + (a - self.base).div_ceil(self.gran) * self.gran
    }
}

/// A block in the address map: its size, and its id when allocated.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Slot {
    size: usize,
    id: Option<BlockId>,
}

/// A free list entry: (size, address). Ordered by size then address: best fit, lowest address
/// among equals.
type FreeKey = (usize, u64);

/// Disjoint, non-adjacent half-open intervals `start -> end`, merged on insert.
type Intervals = BTreeMap<u64, u64>;

/// Adds `[s, e)` to `set`, merging with overlapping or adjacent intervals.
fn insert_interval(set: &mut Intervals, mut s: u64, mut e: u64) {
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
fn remove_interval(set: &mut Intervals, s: u64, e: u64) {
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
fn gaps(set: &Intervals, s: u64, e: u64) -> Vec<(u64, u64)> {
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
fn covered(set: &Intervals, s: u64, e: u64) -> Vec<(u64, u64)> {
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
fn covers(set: &Intervals, s: u64, e: u64) -> bool {
    s >= e || set.range(..=s).next_back().is_some_and(|(_, &pe)| pe >= e)
}

/// An exact snapshot of a pool's block layout (allocated ids, addresses, sizes), taken with
/// [`Pool::checkpoint`] and applied with [`Pool::rollback`]. It holds no device memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pool: u64,
    /// Serial of the reservation it was taken in (`None`: no reservation).
    reservation: Option<u64>,
    /// Allocated blocks, address order: (address, size, id).
    allocated: Vec<(u64, usize, BlockId)>,
}

impl Checkpoint {
    /// Allocated blocks in the snapshot, address order.
    pub fn allocated(&self) -> impl Iterator<Item = Block> + '_ {
        self.allocated.iter().map(|&(addr, size, id)| Block {
            id,
            addr: DevicePtr(addr),
            size,
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
/// # One range, mapped on demand
///
/// The pool owns one range of address space of `reservation_bytes` (see [`Pool::new`]),
/// reserved from the backing on the first allocation. Physical memory is mapped into it in
/// granules of [`Backing::granularity`] bytes (2 MiB on CUDA) only under allocated blocks, so
/// the pool grows in place, addresses never move, and free space coalesces across the whole
/// range: there are no size classes and no segment boundaries.
///
/// # Allocation and free
///
/// Every request is rounded up to a multiple of [`GRANULARITY`] (512 bytes); a request of 0
/// bytes is treated as 512, so every block has a distinct address. [`Pool::alloc`] takes the
/// best fit among the free blocks (the smallest that fits, the lowest address among equals; the
/// tail of the range is one free block), splits it, and maps exactly the granules under the
/// block that are not mapped yet. Both `alloc` and [`Pool::free`] are O(log n) in the number of
/// blocks (plus the mapped ranges the block spans); `free` coalesces the block with its free
/// neighbours, so free space is always the maximal gaps between allocated blocks. Freeing
/// unmaps nothing.
///
/// # Mapping
///
/// Every allocated block is fully mapped. Mapped memory stays mapped until
/// [`Pool::release_unused`] unmaps the granules that no allocated block and no pin touches, or
/// [`Pool::release_all`] unmaps everything. [`Pool::pin`] marks memory a recorded graph uses,
/// which stays mapped until `release_all`: a graph replays at its recorded addresses whatever
/// the bookkeeping says.
///
/// # Two ways back
///
/// * [`Pool::rollback`] is the *exact* restore: it puts back the block layout of a
///   [`Checkpoint`] of this pool, with the same ids, addresses and sizes allocated. The mapping
///   is unchanged. It undoes a failed recording.
/// * [`Pool::restore`] is the *liveness* restore: given the address ranges that are still in use
///   (the buffers callers still hold), it rebuilds the layout so exactly those ranges are
///   allocated, as new blocks with new ids, and every other byte of the range is free. It is
///   how the pool is brought back from "what the last recording allocated" to "what is live"
///   before warming up or recording after replays.
///
/// Both leave [`PoolStats`] consistent (`allocated` is the sum of allocated block sizes) and make
/// every previously issued id that is not allocated afterwards stale.
#[derive(Debug)]
pub struct Pool {
    uid: u64,
    reservation_bytes: usize,
    next_id: u64,
    next_serial: u64,
    reservation: Option<Reservation>,
    blocks: BTreeMap<u64, Slot>,
    free: BTreeSet<FreeKey>,
    ids: IdMap,
    mapped: Intervals,
    pins: Intervals,
    mapped_bytes: usize,
    allocated: usize,
    peak_allocated: usize,
    peak_reserved: usize,
}

/// Rounds a request to the granularity (0 counts as 1 byte, so it becomes 512).
fn round_request(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(GRANULARITY)
}

/// End address of `len` bytes at `addr`.
fn end_of(addr: u64, len: usize) -> u64 {
    addr.saturating_add(len as u64)
}

impl Pool {
    /// An empty pool that will reserve `reservation_bytes` of address space (rounded up to the
    /// backing's granularity) on its first allocation. No single allocation, nor all live
    /// allocations together, can exceed it; address space costs no memory, so make it large.
    pub fn new(reservation_bytes: usize) -> Pool {
        Pool {
            uid: NEXT_POOL_UID.fetch_add(1, Ordering::Relaxed),
            reservation_bytes,
            next_id: 0,
            next_serial: 0,
            reservation: None,
            blocks: BTreeMap::new(),
            free: BTreeSet::new(),
            ids: IdMap::default(),
            mapped: Intervals::new(),
            pins: Intervals::new(),
            mapped_bytes: 0,
            allocated: 0,
            peak_allocated: 0,
            peak_reserved: 0,
        }
    }

    fn issue_id(&mut self) -> BlockId {
        let id = BlockId(self.next_id);
        self.next_id += 1;
        id
    }

    fn note_peaks(&mut self) {
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.peak_reserved = self.peak_reserved.max(self.mapped_bytes);
    }

    /// Reserves the range if the pool has none yet.
    fn ensure_reserved(&mut self, backing: &dyn Backing) -> Result<Reservation, PoolError> {
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
        let ptr = backing.reserve(size).map_err(|source| PoolError::Reserve {
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

    /// Allocates a block of at least `bytes` (rounded up to 512; 0 counts as 512).
    ///
    /// Reserves the pool's range on first use, takes the best-fitting free block, splits it and
    /// maps the granules under the new block that are not mapped yet (contiguous ones in one
    /// [`Backing::map`] call). If reserving or mapping fails, the block layout is unchanged and
    /// what this call mapped is unmapped again (should that unmap fail too, the memory stays
    /// counted as mapped, which is what the device holds).
    pub fn alloc(&mut self, bytes: usize, backing: &dyn Backing) -> Result<Block, PoolError> {
        let size = round_request(bytes).ok_or(PoolError::TooLarge { bytes })?;
        let r = self.ensure_reserved(backing)?;
        let Some(&(free_size, addr)) = self.free.range((size, 0)..).next() else {
            return Err(PoolError::ReservationExhausted {
                bytes,
                reservation: r.size,
                allocated: self.allocated,
            });
        };
        let end = addr + size as u64;
        self.map_range(backing, r.floor(addr), r.ceil(end))?;
        self.free.remove(&(free_size, addr));
        let remainder = free_size - size;
        if remainder > 0 {
            self.blocks.insert(
                end,
                Slot {
                    size: remainder,
                    id: None,
                },
            );
            self.free.insert((remainder, end));
        }
        let id = self.issue_id();
        self.blocks.insert(addr, Slot { size, id: Some(id) });
        self.ids.insert(id, addr);
        self.allocated += size;
        self.note_peaks();
        Ok(Block {
            id,
            addr: DevicePtr(addr),
            size,
        })
    }

    /// Maps every unmapped part of the granule-aligned `[s, e)`; all or nothing.
    fn map_range(&mut self, backing: &dyn Backing, s: u64, e: u64) -> Result<(), PoolError> {
        let todo = gaps(&self.mapped, s, e);
        for (i, &(a, b)) in todo.iter().enumerate() {
            let len = (b - a) as usize;
            if let Err(source) = backing.map(DevicePtr(a), len) {
                for &(ua, ub) in &todo[..i] {
                    if let Err(error) = backing.unmap(DevicePtr(ua), (ub - ua) as usize) {
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

    /// Frees an allocated block, coalescing it with its free neighbours, and returns its size.
    /// Unmaps nothing. An id that is not allocated (freed, stale, or of another pool) is
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
        {
            len += p.size;
            start = prev;
            self.free.remove(&(p.size, prev));
            self.blocks.remove(&addr);
        }
        let next = addr + size as u64;
        if let Some(n) = self.blocks.get(&next).copied()
            && n.id.is_none()
        {
            len += n.size;
            self.free.remove(&(n.size, next));
            self.blocks.remove(&next);
        }
        self.blocks.insert(
            start,
            Slot {
                size: len,
                id: None,
            },
        );
        self.free.insert((len, start));
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
        let mut ids = IdMap::with_capacity_and_hasher(allocated.len(), Default::default());
        let mut blocks = Vec::with_capacity(2 * allocated.len() + 1);
        let mut free = Vec::with_capacity(allocated.len() + 1);
        let mut total = 0;
        if let Some(r) = self.reservation {
            let mut cursor = r.base;
            for &(a, s, id) in &allocated {
                if a > cursor {
                    let gap = (a - cursor) as usize;
                    blocks.push((
                        cursor,
                        Slot {
                            size: gap,
                            id: None,
                        },
                    ));
                    free.push((gap, cursor));
                }
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
            if r.end() > cursor {
                let gap = (r.end() - cursor) as usize;
                blocks.push((
                    cursor,
                    Slot {
                        size: gap,
                        id: None,
                    },
                ));
                free.push((gap, cursor));
            }
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

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            reserved: self.mapped_bytes,
            allocated: self.allocated,
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            live_blocks: self.ids.len(),
            mapped_ranges: self.mapped.len(),
            address_space: self.reservation.map_or(0, |r| r.size),
        }
    }

    /// `(address, size)` of the pool's address range, once reserved.
    pub fn reservation(&self) -> Option<(DevicePtr, usize)> {
        self.reservation.map(|r| (DevicePtr(r.base), r.size))
    }

    /// `(address, size)` of each maximal mapped range, address order.
    pub fn mapped(&self) -> Vec<(DevicePtr, usize)> {
        self.mapped
            .iter()
            .map(|(&a, &b)| (DevicePtr(a), (b - a) as usize))
            .collect()
    }

    /// `(address, size)` of each maximal pinned range (rounded out to granules), address order.
    pub fn pinned(&self) -> Vec<(DevicePtr, usize)> {
        self.pins
            .iter()
            .map(|(&a, &b)| (DevicePtr(a), (b - a) as usize))
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

    /// Forgets every block and pin, unmaps every mapped range and releases the address range.
    /// Every range is attempted; the first error is returned after all of them. Afterwards the
    /// pool is empty (all counters zero but the peaks) whatever the backing returned, every id
    /// is stale, and the next allocation reserves a new range.
    pub fn release_all(&mut self, backing: &dyn Backing) -> Result<(), PoolError> {
        let mut first = None;
        for (&a, &b) in &self.mapped {
            let bytes = (b - a) as usize;
            tracing::debug!(addr = %DevicePtr(a), bytes, "pool memory unmapped");
            if let Err(source) = backing.unmap(DevicePtr(a), bytes) {
                first.get_or_insert(PoolError::Release {
                    addr: DevicePtr(a),
                    bytes,
                    source,
                });
            }
        }
        if let Some(r) = self.reservation.take() {
            tracing::debug!(addr = %DevicePtr(r.base), bytes = r.size, "pool address range released");
            if let Err(source) = backing.release_reservation(DevicePtr(r.base), r.size) {
                first.get_or_insert(PoolError::Release {
                    addr: DevicePtr(r.base),
                    bytes: r.size,
                    source,
                });
            }
        }
        self.blocks.clear();
        self.free.clear();
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
            match backing.unmap(DevicePtr(a), bytes) {
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
