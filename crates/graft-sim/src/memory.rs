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

/// A plain element type stored little-endian in device memory.
trait Element: Copy {
    const SIZE: usize;
    fn load(bytes: &[u8]) -> Self;
    fn store(self, bytes: &mut [u8]);
}

macro_rules! element {
    ($t:ty) => {
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline]
            fn load(bytes: &[u8]) -> Self {
                let mut b = [0u8; std::mem::size_of::<$t>()];
                b.copy_from_slice(bytes);
                <$t>::from_le_bytes(b)
            }
            #[inline]
            fn store(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_le_bytes());
            }
        }
    };
}
element!(f32);
element!(i32);
element!(u32);

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

    /// The region index and offset of `[ptr, ptr+len)`, which must lie in one raw allocation
    /// or in mapped granules of one reservation.
    #[inline]
    fn locate(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<(usize, usize), DeviceError> {
        let ptr = self.redirected(ptr, len);
        let end = ptr
            .0
            .checked_add(len as u64)
            .ok_or_else(|| invalid(op, ptr, len))?;
        let i = self.regions.partition_point(|s| s.base <= ptr.0);
        let Some(r) = i.checked_sub(1).map(|i| &self.regions[i]) else {
            return Err(invalid(op, ptr, len));
        };
        if end > r.base + r.data.len() as u64 {
            return Err(invalid(op, ptr, len));
        }
        if let Kind::Reservation { mapped, .. } = &r.kind {
            let first = ((ptr.0 - r.base) / GRAN) as usize;
            let last = ((end - 1 - r.base) / GRAN) as usize;
            if mapped[first..=last].iter().any(|m| !*m) {
                return Err(invalid(op, ptr, len));
            }
        }
        Ok((i - 1, (ptr.0 - r.base) as usize))
    }

    /// Where an access of `len` bytes at `ptr` goes under the current redirects.
    #[inline]
    fn redirected(&self, ptr: DevicePtr, len: usize) -> DevicePtr {
        for &(start, n, to) in &self.redirects {
            if ptr.0 >= start && ptr.0.saturating_add(len as u64) <= start + n {
                return DevicePtr(to + (ptr.0 - start));
            }
        }
        ptr
    }

    /// Sets the redirects in force (empty: none).
    pub(crate) fn set_redirects(&mut self, redirects: &[(u64, u64, u64)]) {
        self.redirects.clear();
        self.redirects.extend_from_slice(redirects);
    }

    /// Like [`SimMemory::locate`] for `n` elements of `T`, also checking alignment.
    #[inline]
    fn locate_elems<T: Element>(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        n: usize,
    ) -> Result<(usize, usize), DeviceError> {
        let len = n
            .checked_mul(T::SIZE)
            .ok_or_else(|| invalid(op, ptr, usize::MAX))?;
        if !ptr.0.is_multiple_of(T::SIZE as u64) {
            return Err(DeviceError::Driver {
                op,
                code: MISALIGNED_CODE,
                name: MISALIGNED_NAME,
            });
        }
        self.locate(op, ptr, len)
    }

    pub(crate) fn range(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<&[u8], DeviceError> {
        if len == 0 {
            return Ok(&[]);
        }
        let (s, o) = self.locate(op, ptr, len)?;
        Ok(&self.regions[s].data[o..o + len])
    }

    pub(crate) fn range_mut(
        &mut self,
        op: DeviceOp,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<&mut [u8], DeviceError> {
        if len == 0 {
            return Ok(&mut []);
        }
        let (s, o) = self.locate(op, ptr, len)?;
        Ok(&mut self.regions[s].data[o..o + len])
    }

    fn read_elems<T: Element>(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        dst: &mut [T],
    ) -> Result<(), DeviceError> {
        if dst.is_empty() {
            return Ok(());
        }
        let (s, o) = self.locate_elems::<T>(op, ptr, dst.len())?;
        let bytes = &self.regions[s].data[o..o + dst.len() * T::SIZE];
        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(T::SIZE)) {
            *d = T::load(c);
        }
        Ok(())
    }

    fn write_elems<T: Element>(
        &mut self,
        op: DeviceOp,
        ptr: DevicePtr,
        src: &[T],
    ) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let (s, o) = self.locate_elems::<T>(op, ptr, src.len())?;
        let bytes = &mut self.regions[s].data[o..o + src.len() * T::SIZE];
        for (v, c) in src.iter().zip(bytes.chunks_exact_mut(T::SIZE)) {
            v.store(c);
        }
        Ok(())
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn read_f32_as(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        dst: &mut [f32],
    ) -> Result<(), DeviceError> {
        self.read_elems(op, ptr, dst)
    }

    #[cfg(any(test, feature = "test-support"))]
    pub(crate) fn write_f32_as(
        &mut self,
        op: DeviceOp,
        ptr: DevicePtr,
        src: &[f32],
    ) -> Result<(), DeviceError> {
        self.write_elems(op, ptr, src)
    }

    /// Copies `len` bytes from `src` to `dst`; overlapping ranges are an error.
    pub(crate) fn copy_as(
        &mut self,
        op: DeviceOp,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        if overlaps(dst, src, len) {
            return Err(DeviceError::OverlappingCopy { op, dst, src, len });
        }
        let (ss, so) = self.locate(op, src, len)?;
        let (ds, d_off) = self.locate(op, dst, len)?;
        if ss == ds {
            self.regions[ss].data.copy_within(so..so + len, d_off);
        } else if ss < ds {
            let (lo, hi) = self.regions.split_at_mut(ds);
            hi[0].data[d_off..d_off + len].copy_from_slice(&lo[ss].data[so..so + len]);
        } else {
            let (lo, hi) = self.regions.split_at_mut(ss);
            lo[ds].data[d_off..d_off + len].copy_from_slice(&hi[0].data[so..so + len]);
        }
        Ok(())
    }

    /// Elementwise ops may write in place (`dst == src`) but not to a partly overlapping range,
    /// which a GPU leaves undefined.
    fn check_elementwise_alias(
        op: DeviceOp,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
    ) -> Result<(), DeviceError> {
        if dst != src && overlaps(dst, src, len) {
            return Err(DeviceError::OverlappingCopy { op, dst, src, len });
        }
        Ok(())
    }

    // ----- public accessors for kernels -----

    /// The `len` bytes at `ptr`, which must lie inside one live allocation.
    pub fn bytes(&self, ptr: DevicePtr, len: usize) -> Result<&[u8], DeviceError> {
        self.range(DeviceOp::KernelLaunch, ptr, len)
    }

    /// The `len` bytes at `ptr` for writing, which must lie inside one live allocation.
    pub fn bytes_mut(&mut self, ptr: DevicePtr, len: usize) -> Result<&mut [u8], DeviceError> {
        self.range_mut(DeviceOp::KernelLaunch, ptr, len)
    }

    /// Reads `dst.len()` `f32`s starting at `ptr`.
    pub fn read_f32(&self, ptr: DevicePtr, dst: &mut [f32]) -> Result<(), DeviceError> {
        self.read_elems(DeviceOp::KernelLaunch, ptr, dst)
    }

    /// Writes `src` as `f32`s starting at `ptr`.
    pub fn write_f32(&mut self, ptr: DevicePtr, src: &[f32]) -> Result<(), DeviceError> {
        self.write_elems(DeviceOp::KernelLaunch, ptr, src)
    }

    /// Reads `n` `f32`s starting at `ptr` into a new vector (allocates; prefer
    /// [`SimMemory::read_f32`] in hot kernels).
    pub fn f32s(&self, ptr: DevicePtr, n: usize) -> Result<Vec<f32>, DeviceError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        self.locate_elems::<f32>(DeviceOp::KernelLaunch, ptr, n)?;
        let mut v = vec![0.0; n];
        self.read_elems(DeviceOp::KernelLaunch, ptr, &mut v)?;
        Ok(v)
    }

    /// Reads `dst.len()` `i32`s starting at `ptr`.
    pub fn read_i32(&self, ptr: DevicePtr, dst: &mut [i32]) -> Result<(), DeviceError> {
        self.read_elems(DeviceOp::KernelLaunch, ptr, dst)
    }

    /// Writes `src` as `i32`s starting at `ptr`.
    pub fn write_i32(&mut self, ptr: DevicePtr, src: &[i32]) -> Result<(), DeviceError> {
        self.write_elems(DeviceOp::KernelLaunch, ptr, src)
    }

    /// Reads `dst.len()` `u32`s starting at `ptr`.
    pub fn read_u32(&self, ptr: DevicePtr, dst: &mut [u32]) -> Result<(), DeviceError> {
        self.read_elems(DeviceOp::KernelLaunch, ptr, dst)
    }

    /// Writes `src` as `u32`s starting at `ptr`.
    pub fn write_u32(&mut self, ptr: DevicePtr, src: &[u32]) -> Result<(), DeviceError> {
        self.write_elems(DeviceOp::KernelLaunch, ptr, src)
    }

    /// Copies `len` bytes from `src` to `dst` inside a kernel; overlapping ranges fail with
    /// [`DeviceError::OverlappingCopy`].
    pub fn copy(&mut self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<(), DeviceError> {
        self.copy_as(DeviceOp::KernelLaunch, dst, src, len)
    }

    /// Sets `n` `f32`s at `dst` to `value`.
    pub fn fill_f32(&mut self, dst: DevicePtr, n: usize, value: f32) -> Result<(), DeviceError> {
        if n == 0 {
            return Ok(());
        }
        let (s, o) = self.locate_elems::<f32>(DeviceOp::KernelLaunch, dst, n)?;
        let bytes = &mut self.regions[s].data[o..o + n * 4];
        for c in bytes.chunks_exact_mut(4) {
            value.store(c);
        }
        Ok(())
    }

    /// `dst[i] = f(src[i])` for `n` `f32`s. `dst` may equal `src` but not partly overlap it.
    pub fn map_f32(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        f: impl Fn(f32) -> f32,
    ) -> Result<(), DeviceError> {
        const OP: DeviceOp = DeviceOp::KernelLaunch;
        if n == 0 {
            return Ok(());
        }
        let (ss, so) = self.locate_elems::<f32>(OP, src, n)?;
        let (ds, d_off) = self.locate_elems::<f32>(OP, dst, n)?;
        Self::check_elementwise_alias(OP, dst, src, n * 4)?;
        for k in (0..n * 4).step_by(4) {
            let x = f32::load(&self.regions[ss].data[so + k..so + k + 4]);
            f(x).store(&mut self.regions[ds].data[d_off + k..d_off + k + 4]);
        }
        Ok(())
    }

    /// `dst[i] = f(a[i], b[i])` for `n` `f32`s. `dst` may equal an input but not partly
    /// overlap one.
    pub fn zip_f32(
        &mut self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
        f: impl Fn(f32, f32) -> f32,
    ) -> Result<(), DeviceError> {
        const OP: DeviceOp = DeviceOp::KernelLaunch;
        if n == 0 {
            return Ok(());
        }
        let (sa, oa) = self.locate_elems::<f32>(OP, a, n)?;
        let (sb, ob) = self.locate_elems::<f32>(OP, b, n)?;
        let (ds, d_off) = self.locate_elems::<f32>(OP, dst, n)?;
        Self::check_elementwise_alias(OP, dst, a, n * 4)?;
        Self::check_elementwise_alias(OP, dst, b, n * 4)?;
        for k in (0..n * 4).step_by(4) {
            let x = f32::load(&self.regions[sa].data[oa + k..oa + k + 4]);
            let y = f32::load(&self.regions[sb].data[ob + k..ob + k + 4]);
            f(x, y).store(&mut self.regions[ds].data[d_off + k..d_off + k + 4]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: DeviceOp = DeviceOp::KernelLaunch;

    /// A reservation of `bytes` (rounded up to granules) with all of it mapped.
    fn mapped(m: &mut SimMemory, bytes: usize) -> DevicePtr {
        let size = bytes.max(1).next_multiple_of(GRANULARITY);
        let p = m.reserve(DeviceOp::Reserve, size).unwrap();
        m.map(DeviceOp::Map, p, size).unwrap();
        p
    }

    #[test]
    fn placement_is_aligned_gapped_and_monotonic() {
        let mut m = SimMemory::new(1 << 30);
        let a = m.alloc_raw(DeviceOp::RawAlloc, 100).unwrap();
        let b = m.reserve(DeviceOp::Reserve, GRANULARITY).unwrap();
        let c = m.alloc_raw(DeviceOp::RawAlloc, 0).unwrap();
        let d = m.alloc_raw(DeviceOp::RawAlloc, 1).unwrap();
        assert_eq!(a, DevicePtr(ADDRESS_BASE));
        // 100 bytes round up to one 2 MiB unit, then a 2 MiB gap.
        assert_eq!(b.0, ADDRESS_BASE + 2 * GRAN);
        // exactly 2 MiB: ends on a boundary, then the gap.
        assert_eq!(c.0, b.0 + 2 * GRAN);
        // zero bytes still leave a gap.
        assert_eq!(d.0, c.0 + GRAN);
        for p in [a, b, c, d] {
            assert_eq!(p.0 % GRAN, 0);
        }
        m.free_raw(DeviceOp::RawAlloc, a).unwrap();
        m.release_reservation(DeviceOp::ReleaseReservation, b, GRANULARITY)
            .unwrap();
        let e = m.alloc_raw(DeviceOp::RawAlloc, 8).unwrap();
        assert!(e.0 > d.0, "addresses are never reused");
    }

    #[test]
    fn fresh_memory_is_poisoned() {
        let mut m = SimMemory::new(4 << 20);
        let a = m.alloc_raw(DeviceOp::RawAlloc, 16).unwrap();
        assert!(m.bytes(a, 16).unwrap().iter().all(|&b| b == POISON_BYTE));
        let r = mapped(&mut m, 16);
        assert!(m.bytes(r, 16).unwrap().iter().all(|&b| b == POISON_BYTE));
    }

    #[test]
    fn a_huge_reservation_costs_no_host_memory_and_accesses_need_mapping() {
        let mut m = SimMemory::new(16 << 20);
        let r = m.reserve(DeviceOp::Reserve, 256 << 30).unwrap();
        let far = r.offset(4 * GRANULARITY);
        assert_eq!(m.bytes(far, 4), Err(invalid(K, far, 4)));
        m.map(DeviceOp::Map, far, GRANULARITY).unwrap();
        m.bytes_mut(far, 4).unwrap().copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(m.regions[0].data.len(), 5 * GRANULARITY);
        assert_eq!(m.bytes(r, 4), Err(invalid(K, r, 4)), "below the mapping");
        let edge = far.offset(GRANULARITY - 2);
        assert_eq!(
            m.bytes(edge, 4),
            Err(invalid(K, edge, 4)),
            "past the mapping"
        );
        m.unmap(DeviceOp::Unmap, far, GRANULARITY).unwrap();
        assert_eq!(m.bytes(far, 4), Err(invalid(K, far, 4)));
        assert!(m.regions[0].data.is_empty());
        m.map(DeviceOp::Map, far, GRANULARITY).unwrap();
        assert_eq!(
            m.bytes(far, 4).unwrap(),
            &[POISON_BYTE; 4],
            "remapped memory is fresh"
        );
    }

    #[test]
    fn misuse_is_an_invalid_argument() {
        let mut m = SimMemory::new(1 << 30);
        let r = m.reserve(DeviceOp::Reserve, 4 * GRANULARITY).unwrap();
        let is_bad =
            |e: Result<(), DeviceError>| matches!(e, Err(DeviceError::InvalidArgument { .. }));
        assert!(matches!(
            m.reserve(DeviceOp::Reserve, 100),
            Err(DeviceError::InvalidArgument { .. })
        ));
        assert!(is_bad(m.map(DeviceOp::Map, r.offset(512), GRANULARITY)));
        assert!(is_bad(m.map(DeviceOp::Map, r, 0)));
        assert!(
            is_bad(m.map(DeviceOp::Map, r, 5 * GRANULARITY)),
            "past the end"
        );
        m.map(DeviceOp::Map, r, GRANULARITY).unwrap();
        assert!(
            is_bad(m.map(DeviceOp::Map, r, 2 * GRANULARITY)),
            "mapped twice"
        );
        assert!(
            is_bad(m.unmap(DeviceOp::Unmap, r, 2 * GRANULARITY)),
            "not all mapped"
        );
        assert!(is_bad(m.release_reservation(
            DeviceOp::ReleaseReservation,
            r,
            4 * GRANULARITY
        )));
        m.unmap(DeviceOp::Unmap, r, GRANULARITY).unwrap();
        assert!(is_bad(m.release_reservation(
            DeviceOp::ReleaseReservation,
            r,
            GRANULARITY
        )));
        m.release_reservation(DeviceOp::ReleaseReservation, r, 4 * GRANULARITY)
            .unwrap();
    }

    #[test]
    fn the_limit_counts_mapped_and_raw_bytes() {
        let mut m = SimMemory::new(3 * GRANULARITY);
        let r = m.reserve(DeviceOp::Reserve, 8 * GRANULARITY).unwrap();
        m.map(DeviceOp::Map, r, 2 * GRANULARITY).unwrap();
        m.alloc_raw(DeviceOp::RawAlloc, GRANULARITY).unwrap();
        assert_eq!(
            m.map(DeviceOp::Map, r.offset(2 * GRANULARITY), GRANULARITY),
            Err(DeviceError::OutOfMemory {
                op: DeviceOp::Map,
                bytes: GRANULARITY
            })
        );
        m.unmap(DeviceOp::Unmap, r, GRANULARITY).unwrap();
        m.map(DeviceOp::Map, r.offset(2 * GRANULARITY), GRANULARITY)
            .unwrap();
    }

    #[test]
    fn accesses_must_stay_inside_one_allocation() {
        let mut m = SimMemory::new(1 << 30);
        let a = m.alloc_raw(DeviceOp::RawAlloc, 64).unwrap();
        assert!(m.bytes(a, 64).is_ok());
        assert_eq!(
            m.bytes(a, 65),
            Err(invalid(K, a, 65)),
            "one byte past the end"
        );
        assert_eq!(m.bytes(a.offset(64), 1), Err(invalid(K, a.offset(64), 1)));
        assert_eq!(
            m.bytes(DevicePtr(ADDRESS_BASE - 4), 4),
            Err(invalid(K, DevicePtr(ADDRESS_BASE - 4), 4)),
            "below the first allocation"
        );
        assert_eq!(
            m.bytes(DevicePtr(u64::MAX - 1), 8),
            Err(invalid(K, DevicePtr(u64::MAX - 1), 8)),
            "address overflow"
        );
        assert!(m.bytes(DevicePtr(3), 0).unwrap().is_empty());
        assert_eq!(
            m.f32s(a, usize::MAX),
            Err(invalid(K, a, usize::MAX)),
            "length overflow"
        );
    }

    #[test]
    fn typed_access_round_trips_and_checks_alignment() {
        let mut m = SimMemory::new(1 << 30);
        let a = mapped(&mut m, 64);
        m.write_i32(a, &[-1, 2]).unwrap();
        assert_eq!(m.bytes(a, 4).unwrap(), &[0xff; 4]);
        let mut u = [0u32; 2];
        m.read_u32(a, &mut u).unwrap();
        assert_eq!(u, [u32::MAX, 2]);
        m.write_f32(a.offset(8), &[1.5]).unwrap();
        assert_eq!(m.bytes(a.offset(8), 4).unwrap(), &1.5f32.to_le_bytes());
        assert!(matches!(
            m.write_f32(a.offset(2), &[1.0]),
            Err(DeviceError::Driver { code: 716, .. })
        ));
    }

    #[test]
    fn elementwise_rejects_partial_overlap_but_allows_in_place() {
        let mut m = SimMemory::new(1 << 30);
        let a = mapped(&mut m, 64);
        m.fill_f32(a, 16, 1.0).unwrap();
        m.map_f32(a, a, 4, |x| x + 1.0).unwrap();
        assert_eq!(m.f32s(a, 5).unwrap(), [2.0, 2.0, 2.0, 2.0, 1.0]);
        assert!(matches!(
            m.zip_f32(a.offset(4), a, a.offset(32), 4, |x, y| x + y),
            Err(DeviceError::OverlappingCopy { .. })
        ));
    }
}
