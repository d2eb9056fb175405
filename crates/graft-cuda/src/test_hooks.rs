//! The `test-support` hooks on [`CudaQueue`], compiled only with that feature: joining the side stream (`side.rs`) back, raw allocations, stream queries and raw-address f32 reads and writes, modelling what a framework's code might do wrong inside a captured body.

use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::device::CudaQueue;
use crate::driver;

const F32_BYTES: usize = std::mem::size_of::<f32>();

impl CudaQueue {
    /// A raw `cuMemAlloc`, as framework code that calls cudaMalloc directly would make.
    /// Unlike the pool's mappings it is *not* switched to relaxed capture mode, so during a
    /// capture it fails as CUDA fails it (`Capture { op: RawAlloc, .. }`).
    pub fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        // The caller owns the memory and returns it with `raw_free`.
        Ok(DevicePtr(driver::memory::alloc(op, bytes)?))
    }

    /// Frees memory from [`CudaQueue::raw_alloc`] (reported as `DeviceOp::RawAlloc`: core has
    /// no raw-free operation). Like `cuMemFree`, it fails during a capture.
    pub fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        // The driver reports an error for anything it did not allocate.
        driver::memory::free(op, ptr.0)
    }

    /// Whether all work enqueued on the runtime stream has finished (`cuStreamQuery`). Fails
    /// during a capture, as CUDA forbids querying a capturing stream.
    pub fn query(&self) -> Result<bool, DeviceError> {
        let op = DeviceOp::Query;
        self.inner.enter(op)?;
        driver::stream::query(op, self.stream())
    }

    /// Reads `n` f32s from the device at a raw address, synchronously. Same signature as the
    /// simulator's, so tests run on both.
    pub fn read_f32(&self, src: DevicePtr, n: usize) -> Result<Vec<f32>, DeviceError> {
        let bytes = n
            .checked_mul(F32_BYTES)
            .ok_or(DeviceError::InvalidAddress {
                op: DeviceOp::Read,
                addr: src,
                len: usize::MAX,
            })?;
        let mut raw = vec![0u8; bytes];
        self.read_raw(src, &mut raw)?;
        Ok(raw
            .chunks_exact(F32_BYTES)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Writes `values` to the device as f32s at a raw address, synchronously.
    pub fn write_f32(&self, dst: DevicePtr, values: &[f32]) -> Result<(), DeviceError> {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.write_raw(dst, &raw)
    }

    /// Joins the side stream back: the runtime stream waits for the side stream's work so far
    /// (an event recorded on the side stream, waited on by the runtime stream). Inside a capture
    /// this is what makes forked work ([`CudaQueue::launch_function_on_side_stream`]) legal.
    pub fn join_side_stream(&self) -> Result<(), DeviceError> {
        let inner = &self.inner;
        inner.enter(DeviceOp::Event)?;
        inner.side.join(&inner.context)
    }
}
