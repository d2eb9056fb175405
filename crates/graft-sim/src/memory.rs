//! Simulated device memory: raw allocations and pool reservations at fixed, never-reused addresses, granules mapped on demand, and the accessors kernels use.

use std::fmt;

use graft_core::{DeviceError, DeviceOp, DevicePtr};

/// The byte every fresh allocation and every fresh mapping is filled with, so that reading
/// memory nobody wrote shows up.
pub const POISON_BYTE: u8 = 0xA5;

/// The address of the first allocation or reservation of every simulated device.
pub const ADDRESS_BASE: u64 = 0x7f00_0000_0000;

/// The mapping granularity (2 MiB, as on an H100). Allocations and reservations start on
/// multiples of it, with at least this much unmapped space between two of them.
pub const GRANULARITY: usize = 2 << 20;

const GRAN: u64 = GRANULARITY as u64;

/// Device memory of a [`crate::SimDevice::new`] device (8 GiB): raw allocations and mappings
/// past it fail with `OutOfMemory`.
pub const DEFAULT_MEMORY_LIMIT: usize = 8 << 30;

/// CUDA's code for a misaligned typed access (`CUDA_ERROR_MISALIGNED_ADDRESS`).
const MISALIGNED_CODE: u32 = 716;
const MISALIGNED_NAME: &str = "CUDA_ERROR_MISALIGNED_ADDRESS";

/// What a region of the address space is.
#[derive(Clone, PartialEq, Eq, Debug)]
enum Kind {
    /// A user allocation (`raw_alloc`): all of `data`.
    #[cfg(any(test, feature = "test-support"))]
    Raw,
    /// A pool reservation of `size` bytes; `mapped[g]` says whether granule `g` is mapped.
    /// `data` covers the reservation up to the end of its highest mapped granule.
    Reservation { size: usize, mapped: Vec<bool> },
}

struct Region {
    base: u64,
    kind: Kind,
    data: Vec<u8>,
}

/// The memory of one simulated device, as kernels see it.
///
/// Every address is a plain `u64` in a sparse address space: an access must lie wholly inside
/// one raw allocation, or inside mapped granules of one reservation, otherwise it fails with
/// [`DeviceError::InvalidAddress`]. Typed accessors (`f32`, `i32`, `u32`) are little-endian and
/// need an address aligned to the element size, otherwise they fail like CUDA with a
/// `CUDA_ERROR_MISALIGNED_ADDRESS` driver error. Zero-length accesses do nothing and always
/// succeed, at any address.
///
/// Errors from these accessors name [`DeviceOp::KernelLaunch`]: they are what a kernel sees.
pub struct SimMemory {
    /// Live regions, sorted by base address (new ones always go last: addresses only grow).
    regions: Vec<Region>,
    next_base: u64,
    /// Bytes of raw allocations plus mapped granules: what counts against the limit.
    live_bytes: usize,
    limit: usize,
    /// While a graph with redirected reads runs: `(start, len, to)`, accesses inside
    /// `[start, start + len)` go to `to + (addr - start)` (see `Device::redirect`).
    redirects: Vec<(u64, u64, u64)>,
    /// The accesses of an open fork window (`race.rs`).
    tracker: race::Tracked,
}

impl fmt::Debug for SimMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Reg<'a>(&'a Region);
        impl fmt::Debug for Reg<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match &self.0.kind {
                    #[cfg(any(test, feature = "test-support"))]
                    Kind::Raw => write!(f, "raw {:#x}+{}", self.0.base, self.0.data.len()),
                    Kind::Reservation { size, mapped } => write!(
                        f,
                        "reservation {:#x}+{} ({} granules mapped)",
                        self.0.base,
                        size,
                        mapped.iter().filter(|m| **m).count()
                    ),
                }
            }
        }
        f.debug_struct("SimMemory")
            .field("live_bytes", &self.live_bytes)
            .field("limit", &self.limit)
            .field("regions", &self.regions.iter().map(Reg).collect::<Vec<_>>())
            .finish()
    }
}

fn invalid(op: DeviceOp, addr: DevicePtr, len: usize) -> DeviceError {
    DeviceError::InvalidAddress { op, addr, len }
}

/// Whether `[a, a+len)` and `[b, b+len)` share a byte (`len > 0`).
fn overlaps(a: DevicePtr, b: DevicePtr, len: usize) -> bool {
    let len = len as u64;
    a.0 < b.0.saturating_add(len) && b.0 < a.0.saturating_add(len)
}

/// Rounds `x` up to a multiple of [`GRANULARITY`], `None` on overflow.
fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(GRAN - 1)? & !(GRAN - 1))
}

fn bad(op: DeviceOp, what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument { op, what }
}

// Without raw allocations (feature `test-support`) every region is a reservation.
#[cfg_attr(
    not(any(test, feature = "test-support")),
    allow(irrefutable_let_patterns)
)]
impl SimMemory {
    pub(crate) fn new(limit: usize) -> SimMemory {
        SimMemory {
            regions: Vec::new(),
            next_base: ADDRESS_BASE,
            live_bytes: 0,
            limit,
            redirects: Vec::new(),
            tracker: race::Tracked::default(),
        }
    }

    /// Places a region of `bytes` at the next fresh address (then a one-granule gap).
    fn place(&mut self, bytes: usize, oom: DeviceError) -> Result<u64, DeviceError> {
        let base = self.next_base;
        let next = (base.checked_add(bytes as u64))
            .and_then(align_up)
            .and_then(|end| end.checked_add(GRAN))
            .ok_or(oom)?;
        self.next_base = next;
        Ok(base)
    }

    /// A raw allocation of `bytes` at the next fresh address, filled with [`POISON_BYTE`].
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn alloc_raw(
        &mut self,
        op: DeviceOp,
        bytes: usize,
    ) -> Result<DevicePtr, DeviceError> {
        let oom = DeviceError::OutOfMemory { op, bytes };
        if bytes > self.limit - self.live_bytes {
            return Err(oom);
        }
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| oom.clone())?;
        data.resize(bytes, POISON_BYTE);
        let base = self.place(bytes, oom)?;
        self.regions.push(Region {
            base,
            kind: Kind::Raw,
            data,
        });
        self.live_bytes += bytes;
        Ok(DevicePtr(base))
    }

    /// Frees the raw allocation starting exactly at `ptr`. Returns its size.
    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn free_raw(&mut self, op: DeviceOp, ptr: DevicePtr) -> Result<usize, DeviceError> {
        let i = self
            .regions
            .binary_search_by_key(&ptr.0, |r| r.base)
            .map_err(|_| invalid(op, ptr, 0))?;
        if self.regions[i].kind != Kind::Raw {
            return Err(invalid(op, ptr, 0));
        }
        let len = self.regions.remove(i).data.len();
        self.live_bytes -= len;
        Ok(len)
    }

    /// Reserves `bytes` of address space at the next fresh address; costs no memory.
    pub(crate) fn reserve(&mut self, op: DeviceOp, bytes: usize) -> Result<DevicePtr, DeviceError> {
        if bytes == 0 || !bytes.is_multiple_of(GRANULARITY) {
            return Err(bad(
                op,
                "the size is not a positive multiple of the granularity",
            ));
        }
        let base = self.place(bytes, DeviceError::OutOfMemory { op, bytes })?;
        self.regions.push(Region {
            base,
            kind: Kind::Reservation {
                size: bytes,
                mapped: Vec::new(),
            },
            data: Vec::new(),
        });
        Ok(DevicePtr(base))
    }

    /// Gives back the reservation made at `addr` with `bytes`; nothing of it may be mapped.
    pub(crate) fn release_reservation(
        &mut self,
        op: DeviceOp,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let Ok(i) = self.regions.binary_search_by_key(&addr.0, |r| r.base) else {
            return Err(bad(op, "the address is not the start of a reservation"));
        };
        match &self.regions[i].kind {
            Kind::Reservation { size, mapped } => {
                if *size != bytes {
                    return Err(bad(op, "the size is not the reservation's size"));
                }
                if mapped.iter().any(|m| *m) {
                    return Err(bad(op, "part of the reservation is still mapped"));
                }
            }
            #[cfg(any(test, feature = "test-support"))]
            Kind::Raw => return Err(bad(op, "the address is not the start of a reservation")),
        }
        self.regions.remove(i);
        Ok(())
    }

    /// The reservation holding the granule-aligned `[addr, addr+bytes)`, and the range's first
    /// granule and granule count.
    fn granules(
        &mut self,
        op: DeviceOp,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(usize, usize, usize), DeviceError> {
        if bytes == 0 || !bytes.is_multiple_of(GRANULARITY) || !addr.0.is_multiple_of(GRAN) {
            return Err(bad(
                op,
                "the range is empty or not aligned to the granularity",
            ));
        }
        let i = self.regions.partition_point(|r| r.base <= addr.0);
        let outside = || bad(op, "the range is not inside one reservation");
        let i = i.checked_sub(1).ok_or_else(outside)?;
        let r = &self.regions[i];
        let Kind::Reservation { size, .. } = r.kind else {
            return Err(outside());
        };
        let off = addr.0 - r.base;
        if off
            .checked_add(bytes as u64)
            .is_none_or(|e| e > size as u64)
        {
            return Err(outside());
        }
        Ok((i, (off / GRAN) as usize, bytes / GRANULARITY))
    }

    /// Maps fresh memory, filled with [`POISON_BYTE`], at the unmapped `[addr, addr+bytes)`.
    pub(crate) fn map(
        &mut self,
        op: DeviceOp,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let (i, g0, n) = self.granules(op, addr, bytes)?;
        let oom = DeviceError::OutOfMemory { op, bytes };
        if bytes > self.limit - self.live_bytes {
            return Err(oom);
        }
        let r = &mut self.regions[i];
        let Kind::Reservation { mapped, .. } = &mut r.kind else {
            return Err(bad(op, "the range is not inside one reservation"));
        };
        if mapped.iter().skip(g0).take(n).any(|m| *m) {
            return Err(bad(op, "part of the range is already mapped"));
        }
        let (off, end) = (g0 * GRANULARITY, (g0 + n) * GRANULARITY);
        if r.data.len() < end {
            r.data
                .try_reserve_exact(end - r.data.len())
                .map_err(|_| oom)?;
            r.data.resize(end, POISON_BYTE);
        }
        r.data[off..end].fill(POISON_BYTE);
        if mapped.len() < g0 + n {
            mapped.resize(g0 + n, false);
        }
        mapped[g0..g0 + n].fill(true);
        self.live_bytes += bytes;
        Ok(())
    }

    /// Unmaps the mapped `[addr, addr+bytes)`; host memory shrinks to the highest mapped granule.
    pub(crate) fn unmap(
        &mut self,
        op: DeviceOp,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let (i, g0, n) = self.granules(op, addr, bytes)?;
        let r = &mut self.regions[i];
        let Kind::Reservation { mapped, .. } = &mut r.kind else {
            return Err(bad(op, "the range is not inside one reservation"));
        };
        if mapped.len() < g0 + n || mapped[g0..g0 + n].iter().any(|m| !*m) {
            return Err(bad(op, "part of the range is not mapped"));
        }
        mapped[g0..g0 + n].fill(false);
        let top = mapped.iter().rposition(|m| *m).map_or(0, |g| g + 1);
        mapped.truncate(top);
        if r.data.len() > top * GRANULARITY {
            r.data.truncate(top * GRANULARITY);
            r.data.shrink_to_fit();
        }
        self.live_bytes -= bytes;
        Ok(())
    }

    /// Whether `addr` lies in a raw allocation (`raw_alloc`, CUDA's `cuMemAlloc`) rather than
    /// a pool reservation: CUDA refuses to re-point a graph's copy from memory mapped one way
    /// to memory mapped the other (`Device::repoint_copy`).
    pub(crate) fn is_raw(&self, addr: DevicePtr) -> bool {
        #[cfg(any(test, feature = "test-support"))]
        {
            self.regions.iter().any(|r| {
                r.kind == Kind::Raw && addr.0 >= r.base && addr.0 < r.base + r.data.len() as u64
            })
        }
        #[cfg(not(any(test, feature = "test-support")))]
        {
            let _ = addr;
            false
        }
    }
}

mod access;
mod race;

pub(crate) use race::Lane;
#[cfg(test)]
mod tests;
