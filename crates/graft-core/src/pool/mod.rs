//! The caching allocator ("the pool"): one reserved address range, physical memory mapped in
//! on demand, carved into blocks, with checkpoints.
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

use crate::device::{CORE, CoreOnly, Device, DeviceError, DevicePtr};

mod error;
mod hold;
mod intervals;
#[cfg(feature = "test-support")]
mod invariants;
mod layout;
mod mapping;

pub use error::PoolError;
use intervals::{Intervals, covered, covers, gaps, insert_interval, remove_interval};
// The pool's own surface is public for the `testing` module alone (feature test-support).
#[cfg(feature = "test-support")]
pub use invariants::InvariantViolation;
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub use layout::Checkpoint;

/// Every block address and size is a multiple of this many bytes.
pub(crate) const GRANULARITY: usize = 512;

/// What the pool needs from the memory behind it: the memory calls of [`Device`] (see the
/// device module's Memory section for their rules), sealed to graft-core by the same token.
/// Every device is one; tests use fakes.
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub trait Backing {
    /// See [`Device::granularity`].
    fn granularity(&self) -> usize;
    /// See [`Device::reserve`].
    fn reserve(&self, core: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError>;
    /// See [`Device::release_reservation`].
    fn release_reservation(
        &self,
        core: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError>;
    /// See [`Device::map`].
    fn map(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;
    /// See [`Device::unmap`].
    fn unmap(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError>;
}

impl<D: Device> Backing for D {
    fn granularity(&self) -> usize {
        Device::granularity(self)
    }
    fn reserve(&self, core: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        Device::reserve(self, core, bytes)
    }
    fn release_reservation(
        &self,
        core: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        Device::release_reservation(self, core, addr, bytes)
    }
    fn map(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        Device::map(self, core, addr, bytes)
    }
    fn unmap(&self, core: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        Device::unmap(self, core, addr, bytes)
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
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct Block {
    /// The block's id ([`BlockId::FREE`] for a free block in [`Pool::blocks`]).
    pub id: BlockId,
    /// First address.
    pub addr: DevicePtr,
    /// The block's length in bytes.
    pub size: usize,
}

/// Counters of a pool. `peak_*` are high-water marks since the pool was created.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PoolStats {
    /// Bytes of physical memory mapped into the pool's range (what the pool holds).
    pub mapped: usize,
    /// Bytes of all allocated blocks.
    pub allocated: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `mapped` seen.
    pub peak_mapped: usize,
    /// Allocated blocks.
    pub live_blocks: usize,
    /// Maximal contiguous mapped ranges.
    pub mapped_ranges: usize,
    /// Bytes of address space reserved (0 until the first allocation, and after a release).
    pub address_space: usize,
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
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
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
    peak_mapped: usize,
    /// While a fork is open: the blocks freed since, still allocated in the bookkeeping
    /// (`hold.rs`).
    held: Option<Vec<BlockId>>,
}

/// Rounds a request to the granularity (0 counts as 1 byte, so it becomes 512).
fn round_request(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(GRANULARITY)
}

/// End address of `len` bytes at `addr`.
fn end_of(addr: u64, len: usize) -> u64 {
    addr.saturating_add(len as u64)
}

#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
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
            peak_mapped: 0,
            held: None,
        }
    }

    fn issue_id(&mut self) -> BlockId {
        let id = BlockId(self.next_id);
        self.next_id += 1;
        id
    }

    fn note_peaks(&mut self) {
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        self.peak_mapped = self.peak_mapped.max(self.mapped_bytes);
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

    /// Frees an allocated block, coalescing it with its free neighbours, and returns its size.
    /// Unmaps nothing. An id that is not allocated (freed, stale, or of another pool) is
    /// [`PoolError::UnknownBlock`] and changes nothing. While frees are held
    /// ([`Pool::hold_frees`], a fork), the block stays allocated until [`Pool::release_held`].
    pub fn free(&mut self, id: BlockId) -> Result<usize, PoolError> {
        if self.held.is_some() {
            return self.hold(id);
        }
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
    #[cfg(feature = "test-support")]
    pub fn block(&self, id: BlockId) -> Option<Block> {
        let addr = *self.ids.get(&id)?;
        let slot = self.blocks.get(&addr)?;
        Some(Block {
            id,
            addr: DevicePtr(addr),
            size: slot.size,
        })
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            mapped: self.mapped_bytes,
            allocated: self.allocated,
            peak_allocated: self.peak_allocated,
            peak_mapped: self.peak_mapped,
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
}
