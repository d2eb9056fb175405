//! Simulated device memory: segments at fixed, never-reused addresses, and the accessors kernels use.

use std::fmt;

use graft_core::{DeviceError, DeviceOp, DevicePtr};

/// The byte every fresh allocation is filled with, so that reading memory nobody wrote shows up.
pub const POISON_BYTE: u8 = 0xA5;

/// The address of the first allocation of every simulated device.
pub const ADDRESS_BASE: u64 = 0x7f00_0000_0000;

/// Allocations start on multiples of this (2 MiB), with at least this much unmapped space between
/// two of them.
pub const SEGMENT_ALIGN: u64 = 2 << 20;

/// Device memory of a [`crate::SimDevice::new`] device (8 GiB): allocations past it fail with
/// `OutOfMemory`.
pub const DEFAULT_MEMORY_LIMIT: usize = 8 << 30;

/// CUDA's code for a misaligned typed access (`CUDA_ERROR_MISALIGNED_ADDRESS`).
const MISALIGNED_CODE: u32 = 716;
const MISALIGNED_NAME: &str = "CUDA_ERROR_MISALIGNED_ADDRESS";

/// Who owns an allocation: graft's pool ([`crate::SimDevice`]'s `alloc_segment`) or user code
/// (`raw_alloc`). Each kind can only be freed through its own call.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum SegmentKind {
    Pool,
    Raw,
}

struct Segment {
    base: u64,
    kind: SegmentKind,
    data: Vec<u8>,
}

/// The memory of one simulated device, as kernels see it.
///
/// Every address is a plain `u64` in a sparse address space: an access must lie wholly inside
/// one live allocation, otherwise it fails with [`DeviceError::InvalidAddress`]. Typed accessors
/// (`f32`, `i32`, `u32`) are little-endian and need an address aligned to the element size,
/// otherwise they fail like CUDA with a `CUDA_ERROR_MISALIGNED_ADDRESS` driver error.
/// Zero-length accesses do nothing and always succeed, at any address.
///
/// Errors from these accessors name [`DeviceOp::KernelLaunch`]: they are what a kernel sees.
pub struct SimMemory {
    /// Live allocations, sorted by base address (new ones always go last: addresses only grow).
    segments: Vec<Segment>,
    next_base: u64,
    live_bytes: usize,
    limit: usize,
}

impl fmt::Debug for SimMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Seg<'a>(&'a Segment);
        impl fmt::Debug for Seg<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "{:?} {:#x}+{}",
                    self.0.kind,
                    self.0.base,
                    self.0.data.len()
                )
            }
        }
        f.debug_struct("SimMemory")
            .field("live_bytes", &self.live_bytes)
            .field("limit", &self.limit)
            .field(
                "segments",
                &self.segments.iter().map(Seg).collect::<Vec<_>>(),
            )
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

/// Rounds `x` up to a multiple of [`SEGMENT_ALIGN`], `None` on overflow.
fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(SEGMENT_ALIGN - 1)? & !(SEGMENT_ALIGN - 1))
}

impl SimMemory {
    pub(crate) fn new(limit: usize) -> SimMemory {
        SimMemory {
            segments: Vec::new(),
            next_base: ADDRESS_BASE,
            live_bytes: 0,
            limit,
        }
    }

    /// Allocates `bytes` at the next fresh address, filled with [`POISON_BYTE`].
    pub(crate) fn alloc(
        &mut self,
        kind: SegmentKind,
        op: DeviceOp,
        bytes: usize,
    ) -> Result<DevicePtr, DeviceError> {
        let oom = DeviceError::OutOfMemory { op, bytes };
        if bytes > self.limit - self.live_bytes {
            return Err(oom);
        }
        let base = self.next_base;
        let next = (base.checked_add(bytes as u64))
            .and_then(align_up)
            .and_then(|end| end.checked_add(SEGMENT_ALIGN))
            .ok_or_else(|| oom.clone())?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| oom)?;
        data.resize(bytes, POISON_BYTE);
        self.segments.push(Segment { base, kind, data });
        self.next_base = next;
        self.live_bytes += bytes;
        Ok(DevicePtr(base))
    }

    /// Frees the allocation of `kind` starting exactly at `ptr`; when `bytes` is given it must
    /// be the allocation's size. Returns the size freed.
    pub(crate) fn free(
        &mut self,
        kind: SegmentKind,
        op: DeviceOp,
        ptr: DevicePtr,
        bytes: Option<usize>,
    ) -> Result<usize, DeviceError> {
        let err = || invalid(op, ptr, bytes.unwrap_or(0));
        let i = self
            .segments
            .binary_search_by_key(&ptr.0, |s| s.base)
            .map_err(|_| err())?;
        let seg = &self.segments[i];
        if seg.kind != kind || bytes.is_some_and(|b| b != seg.data.len()) {
            return Err(err());
        }
        let len = seg.data.len();
        self.segments.remove(i);
        self.live_bytes -= len;
        Ok(len)
    }

    /// The segment index and offset of `[ptr, ptr+len)`, which must lie in one live allocation.
    #[inline]
    fn locate(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<(usize, usize), DeviceError> {
        let end = ptr
            .0
            .checked_add(len as u64)
            .ok_or_else(|| invalid(op, ptr, len))?;
        let i = self.segments.partition_point(|s| s.base <= ptr.0);
        let Some(seg) = i.checked_sub(1).map(|i| &self.segments[i]) else {
            return Err(invalid(op, ptr, len));
        };
        if end > seg.base + seg.data.len() as u64 {
            return Err(invalid(op, ptr, len));
        }
        Ok((i - 1, (ptr.0 - seg.base) as usize))
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
        Ok(&self.segments[s].data[o..o + len])
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
        Ok(&mut self.segments[s].data[o..o + len])
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
        let bytes = &self.segments[s].data[o..o + dst.len() * T::SIZE];
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
        let bytes = &mut self.segments[s].data[o..o + src.len() * T::SIZE];
        for (v, c) in src.iter().zip(bytes.chunks_exact_mut(T::SIZE)) {
            v.store(c);
        }
        Ok(())
    }

    pub(crate) fn read_f32_as(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        dst: &mut [f32],
    ) -> Result<(), DeviceError> {
        self.read_elems(op, ptr, dst)
    }

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
            self.segments[ss].data.copy_within(so..so + len, d_off);
        } else if ss < ds {
            let (lo, hi) = self.segments.split_at_mut(ds);
            hi[0].data[d_off..d_off + len].copy_from_slice(&lo[ss].data[so..so + len]);
        } else {
            let (lo, hi) = self.segments.split_at_mut(ss);
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
        let bytes = &mut self.segments[s].data[o..o + n * 4];
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
            let x = f32::load(&self.segments[ss].data[so + k..so + k + 4]);
            f(x).store(&mut self.segments[ds].data[d_off + k..d_off + k + 4]);
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
            let x = f32::load(&self.segments[sa].data[oa + k..oa + k + 4]);
            let y = f32::load(&self.segments[sb].data[ob + k..ob + k + 4]);
            f(x, y).store(&mut self.segments[ds].data[d_off + k..d_off + k + 4]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: DeviceOp = DeviceOp::KernelLaunch;

    #[test]
    fn placement_is_aligned_gapped_and_monotonic() {
        let mut m = SimMemory::new(1 << 30);
        let a = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 100)
            .unwrap();
        let b = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 2 << 20)
            .unwrap();
        let c = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 0)
            .unwrap();
        let d = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 1)
            .unwrap();
        assert_eq!(a, DevicePtr(ADDRESS_BASE));
        // 100 bytes round up to one 2 MiB unit, then a 2 MiB gap.
        assert_eq!(b.0, ADDRESS_BASE + 2 * SEGMENT_ALIGN);
        // exactly 2 MiB: ends on a boundary, then the gap.
        assert_eq!(c.0, b.0 + 2 * SEGMENT_ALIGN);
        // zero bytes still leave a gap.
        assert_eq!(d.0, c.0 + SEGMENT_ALIGN);
        for p in [a, b, c, d] {
            assert_eq!(p.0 % SEGMENT_ALIGN, 0);
        }
        m.free(SegmentKind::Pool, DeviceOp::SegmentFree, b, Some(2 << 20))
            .unwrap();
        let e = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 8)
            .unwrap();
        assert!(e.0 > d.0, "addresses are never reused");
    }

    #[test]
    fn fresh_memory_is_poisoned() {
        let mut m = SimMemory::new(1 << 20);
        let a = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 16)
            .unwrap();
        assert!(m.bytes(a, 16).unwrap().iter().all(|&b| b == POISON_BYTE));
    }

    #[test]
    fn accesses_must_stay_inside_one_allocation() {
        let mut m = SimMemory::new(1 << 30);
        let a = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 64)
            .unwrap();
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
        let a = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 64)
            .unwrap();
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
        let a = m
            .alloc(SegmentKind::Pool, DeviceOp::SegmentAlloc, 64)
            .unwrap();
        m.fill_f32(a, 16, 1.0).unwrap();
        m.map_f32(a, a, 4, |x| x + 1.0).unwrap();
        assert_eq!(m.f32s(a, 5).unwrap(), [2.0, 2.0, 2.0, 2.0, 1.0]);
        assert!(matches!(
            m.zip_f32(a.offset(4), a, a.offset(32), 4, |x, y| x + y),
            Err(DeviceError::OverlappingCopy { .. })
        ));
    }
}
