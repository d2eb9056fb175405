//! Host reads and writes of a buffer's bytes through its device, checked: what framework code uses, since the device's raw-address `read` and `write` are graft-core's alone.

use crate::buffer::Buffer;
use crate::device::{CORE, Device, DeviceError, DeviceOp};

impl Buffer {
    /// Reads `dst.len()` bytes of this buffer from `offset` into `dst`, after the device's
    /// earlier work (synchronous; fails during a capture). The range is checked first with
    /// [`Buffer::device_addr`]: a buffer of another device or a range past its end is
    /// `InvalidArgument`, memory graft reused or freed is `InvalidBuffer`.
    pub fn read_at<D: Device>(
        &self,
        device: &D,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let src = self.device_addr(DeviceOp::Read, device.id(), offset, dst.len())?;
        device.read(CORE, src, dst)
    }

    /// Writes `src` into this buffer from `offset` (synchronous; fails during a capture),
    /// checked as [`Buffer::read_at`] checks.
    pub fn write_at<D: Device>(
        &self,
        device: &D,
        offset: usize,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let dst = self.device_addr(DeviceOp::Write, device.id(), offset, src.len())?;
        device.write(CORE, dst, src)
    }
}
