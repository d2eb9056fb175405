//! Accesses to a simulated device's memory: locating an address range in one region (through
//! a graph's redirects), typed little-endian reads and writes, copies, and the kernel-facing
//! helpers of [`SimMemory`].

use graft_core::{DeviceError, DeviceOp, DevicePtr};

use super::{GRAN, Kind, MISALIGNED_CODE, MISALIGNED_NAME, SimMemory, invalid, overlaps};

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

// Without raw allocations (feature `test-support`) every region is a reservation.
#[cfg_attr(
    not(any(test, feature = "test-support")),
    allow(irrefutable_let_patterns)
)]
impl SimMemory {
    /// The region index and offset of `[ptr, ptr+len)`, which must lie in one raw allocation
    /// or in mapped granules of one reservation.
    #[inline]
    fn locate(
        &self,
        op: DeviceOp,
        ptr: DevicePtr,
        len: usize,
        write: bool,
    ) -> Result<(usize, usize), DeviceError> {
        let ptr = self.redirected(ptr, len);
        self.note_access(ptr.0, len, write);
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
        write: bool,
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
        self.locate(op, ptr, len, write)
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
        let (s, o) = self.locate(op, ptr, len, false)?;
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
        let (s, o) = self.locate(op, ptr, len, true)?;
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
        let (s, o) = self.locate_elems::<T>(op, ptr, dst.len(), false)?;
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
        let (s, o) = self.locate_elems::<T>(op, ptr, src.len(), true)?;
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
        let (ss, so) = self.locate(op, src, len, false)?;
        let (ds, d_off) = self.locate(op, dst, len, true)?;
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
        self.locate_elems::<f32>(DeviceOp::KernelLaunch, ptr, n, false)?;
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
        let (s, o) = self.locate_elems::<f32>(DeviceOp::KernelLaunch, dst, n, true)?;
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
        let (ss, so) = self.locate_elems::<f32>(OP, src, n, false)?;
        let (ds, d_off) = self.locate_elems::<f32>(OP, dst, n, true)?;
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
        let (sa, oa) = self.locate_elems::<f32>(OP, a, n, false)?;
        let (sb, ob) = self.locate_elems::<f32>(OP, b, n, false)?;
        let (ds, d_off) = self.locate_elems::<f32>(OP, dst, n, true)?;
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
