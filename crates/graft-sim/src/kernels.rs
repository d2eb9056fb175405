//! The elementwise `f32` kernels that backend-neutral tests use; graft-cuda provides the same signatures.

use graft_core::{DeviceError, DevicePtr};

use crate::SimQueue;

impl SimQueue {
    /// `dst[i] = value` for `n` `f32`s, as a kernel on the runtime stream.
    pub fn fill_f32(&self, dst: DevicePtr, n: usize, value: f32) -> Result<(), DeviceError> {
        self.launch_kernel("fill_f32", move |m| m.fill_f32(dst, n, value))
    }

    /// `dst[i] = a[i] + b[i]` for `n` `f32`s, as a kernel. `dst` may equal an input.
    pub fn add_f32(
        &self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("add_f32", move |m| m.zip_f32(dst, a, b, n, |x, y| x + y))
    }

    /// `dst[i] = a[i] * b[i]` for `n` `f32`s, as a kernel. `dst` may equal an input.
    pub fn mul_f32(
        &self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("mul_f32", move |m| m.zip_f32(dst, a, b, n, |x, y| x * y))
    }

    /// `dst[i] = a * x[i] + b` for `n` `f32`s, as a kernel. `dst` may equal `x`.
    ///
    /// Computed as one fused multiply-add (`a.mul_add(x, b)`, CUDA's `fmaf`), so that both
    /// backends round identically.
    pub fn axpb_f32(
        &self,
        dst: DevicePtr,
        x: DevicePtr,
        a: f32,
        b: f32,
        n: usize,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("axpb_f32", move |m| {
            m.map_f32(dst, x, n, |v| a.mul_add(v, b))
        })
    }
}
