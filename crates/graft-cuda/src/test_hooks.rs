//! The `test-support` hooks, compiled only with that feature: the side stream with its fork and join events, raw allocations, stream queries and raw-address f32 reads and writes, modelling what a framework's code might do wrong inside a captured body.

use std::ffi::c_uint;
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::context::{Inner, create_stream, destroy_stream};
use crate::device::CudaQueue;
use crate::error::{check, check_alloc, map};

const F32_BYTES: usize = std::mem::size_of::<f32>();

/// A second stream of the device and two events to fork it from the runtime stream and join
/// it back. Null until [`SideStream::create`]; released by [`SideStream::release`].
pub(crate) struct SideStream {
    pub(crate) stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
}

impl Default for SideStream {
    fn default() -> Self {
        SideStream {
            stream: ptr::null_mut(),
            fork: ptr::null_mut(),
            join: ptr::null_mut(),
        }
    }
}

impl SideStream {
    /// Creates the stream and the events in the current context (the device's, being opened).
    /// On failure what was created stays set, and [`SideStream::release`] destroys it.
    pub(crate) fn create(&mut self) -> Result<(), DeviceError> {
        let op = DeviceOp::Init;
        self.stream = create_stream(op)?;
        let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        for slot in [&mut self.fork, &mut self.join] {
            // SAFETY: the context is current; `slot` is a valid out-pointer. Destroyed once in
            // `release`.
            check(op, unsafe { sys::cuEventCreate(slot, no_timing) })?;
        }
        Ok(())
    }

    /// Waits for the side stream, then destroys the events and the stream (each once). Errors
    /// are ignored: this only runs when the device is dropped, with its context current.
    pub(crate) fn release(&mut self) {
        if !self.stream.is_null() {
            // SAFETY: the side stream is live until destroyed below.
            let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
        }
        for slot in [&mut self.fork, &mut self.join] {
            let event = std::mem::replace(slot, ptr::null_mut());
            if !event.is_null() {
                // SAFETY: created by cuEventCreate in `create`, destroyed exactly once (swapped
                // out).
                let _ = unsafe { sys::cuEventDestroy_v2(event) };
            }
        }
        destroy_stream(&mut self.stream);
    }
}

impl Inner {
    /// Makes the side stream wait for the runtime stream's work so far (an event recorded on
    /// the runtime stream, waited on by the side stream) and returns it. During a capture this
    /// pulls the side stream into the capture.
    pub(crate) fn fork_side_stream(&self) -> Result<sys::CUstream, DeviceError> {
        // SAFETY: the fork event and both streams are live handles of this device's context,
        // which is current (callers `enter` first).
        check(DeviceOp::Event, unsafe {
            sys::cuEventRecord(self.side.fork, self.stream)
        })?;
        // SAFETY: as above; flags 0 is CU_EVENT_WAIT_DEFAULT.
        check(DeviceOp::Event, unsafe {
            sys::cuStreamWaitEvent(self.side.stream, self.side.fork, 0)
        })?;
        Ok(self.side.stream)
    }
}

impl CudaQueue {
    /// A raw `cuMemAlloc`, as framework code that calls cudaMalloc directly would make.
    /// Unlike the pool's mappings it is *not* switched to relaxed capture mode, so during a
    /// capture it fails as CUDA fails it (`Capture { op: RawAlloc, .. }`).
    pub fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out-pointer. The caller owns the
        // memory and returns it with `raw_free`.
        check_alloc(op, unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, bytes)?;
        Ok(DevicePtr(ptr))
    }

    /// Frees memory from [`CudaQueue::raw_alloc`] (reported as `DeviceOp::RawAlloc`: core has
    /// no raw-free operation). Like `cuMemFree`, it fails during a capture.
    pub fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let op = DeviceOp::RawAlloc;
        self.inner.enter(op)?;
        // SAFETY: the caller passes a pointer from `raw_alloc` that it has not freed; the driver
        // validates the address and reports an error for anything it did not allocate.
        check(op, unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    /// Whether all work enqueued on the runtime stream has finished (`cuStreamQuery`). Fails
    /// during a capture, as CUDA forbids querying a capturing stream.
    pub fn query(&self) -> Result<bool, DeviceError> {
        let op = DeviceOp::Query;
        self.inner.enter(op)?;
        // SAFETY: `stream` is the live runtime stream.
        match unsafe { sys::cuStreamQuery(self.inner.stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map(op, other, 0)),
        }
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
        // SAFETY: the join event and both streams are live handles of this device's context.
        check(DeviceOp::Event, unsafe {
            sys::cuEventRecord(inner.side.join, inner.side.stream)
        })?;
        // SAFETY: as above; flags 0 is CU_EVENT_WAIT_DEFAULT.
        check(DeviceOp::Event, unsafe {
            sys::cuStreamWaitEvent(inner.stream, inner.side.join, 0)
        })
    }
}
