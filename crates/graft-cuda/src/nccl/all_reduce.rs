//! The data all-reduce a tensor-parallel body runs: an in-place sum on the device's runtime
//! stream, captured when the stream is capturing, of a graft buffer (f32) or of a raw device
//! range of f32, bf16 or f16 (another library's tensors): the one-shot kernel over peer memory
//! for messages up to the communicator's limit (`one_shot/`), `ncclAllReduce` otherwise.

use std::time::Instant;

use cudarc::nccl::sys;
use graft_core::{Buffer, DeviceError};

use super::status::OP;
use super::{NcclComm, one_shot};
use crate::driver::nccl as dn;

/// The element types [`NcclComm::all_reduce_sum_raw`] reduces.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NcclDtype {
    /// 32-bit float (`ncclFloat32`).
    F32,
    /// bfloat16 (`ncclBfloat16`).
    Bf16,
    /// IEEE half (`ncclFloat16`).
    F16,
}

impl NcclDtype {
    /// The bytes of one element.
    pub fn size(self) -> usize {
        match self {
            NcclDtype::F32 => 4,
            NcclDtype::Bf16 | NcclDtype::F16 => 2,
        }
    }

    fn raw(self) -> sys::ncclDataType_t {
        match self {
            NcclDtype::F32 => sys::ncclDataType_t::ncclFloat32,
            NcclDtype::Bf16 => sys::ncclDataType_t::ncclBfloat16,
            NcclDtype::F16 => sys::ncclDataType_t::ncclFloat16,
        }
    }
}

impl NcclComm {
    /// Enqueues an in-place all-reduce (sum) of the first `n` `f32`s of `buffer` on the
    /// device's runtime stream (`ncclAllReduce`; captured when the stream is capturing). The
    /// buffer is checked as a kernel argument: this device's, still valid, long enough. On a
    /// non-blocking communicator ([`NcclComm::init_rank`]) the enqueue is polled until NCCL has
    /// taken it, at most the communicator's deadline; past it, or on an error NCCL reports,
    /// the communicator is aborted.
    pub fn all_reduce_sum_f32(&self, buffer: &Buffer, n: usize) -> Result<(), DeviceError> {
        let bytes = n.checked_mul(4).ok_or(DeviceError::InvalidArgument {
            op: OP,
            what: "the element count overflows",
        })?;
        let at = buffer.device_addr(OP, self.queue.inner.id, 0, bytes)?;
        // SAFETY: `at` is `bytes` of live memory on this communicator's device (checked
        // above; graft keeps a buffer's memory while it is held, and the caller holds it until
        // the stream has run the collective).
        unsafe { self.all_reduce_sum_raw(at.0, n, NcclDtype::F32) }
    }

    /// Enqueues an in-place all-reduce (sum) of `count` elements of `dtype` at device address
    /// `at` on the device's runtime stream, as [`NcclComm::all_reduce_sum_f32`] does for a
    /// graft buffer: for memory graft does not own (another library's tensors on the same
    /// stream). Refused inside an open conditional body, and on an aborted communicator.
    ///
    /// A message of at most [`NcclComm::one_shot_limit`] bytes takes the one-shot kernel (every
    /// rank's elements summed in rank order in f32, rounded once: the same bits on every
    /// rank); a larger one `ncclAllReduce`. Either way every rank must make the same calls
    /// with the same sizes, in the same order.
    ///
    /// # Safety
    ///
    /// `at` must be the start of `count * dtype.size()` bytes of device memory of this
    /// communicator's device (allocated in its primary context), and that memory must stay
    /// allocated, and be neither read nor written by anything else, until the runtime stream
    /// has run the collective (work enqueued later on the same stream is ordered after it).
    pub unsafe fn all_reduce_sum_raw(
        &self,
        at: u64,
        count: usize,
        dtype: NcclDtype,
    ) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.make_current(OP)?;
        if !inner.conditionals.lock().open_is_empty() {
            // NCCL records event nodes (and, with graph mixing, host-side bookkeeping), which
            // a conditional body cannot hold: refused here, before NCCL enqueues anything.
            return Err(DeviceError::Conditional {
                op: OP,
                rule: graft_core::ConditionalRule::Collective,
            });
        }
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or(DeviceError::InvalidArgument {
                op: OP,
                what: "the element count overflows",
            })?;
        if one_shot::takes_one_shot(bytes, self.one_shot_limit())
            && let Some(shot) = &self.one_shot
        {
            // Under the lock, so that an abort comes before (refused) or after (the kernel
            // sees the abort word), never between the check and the launch.
            let comm = self.lock();
            if comm.is_null() {
                return Err(DeviceError::CollectiveAborted { op: OP });
            }
            // `at` is `count` elements of `dtype` of live memory on this device (the caller's
            // contract), at most the workspace's capacity (the limit is capped by it).
            return shot.launch(at, count, dtype);
        }
        let start = Instant::now();
        self.enqueue(|comm| {
            // `at` is `count` elements of `dtype` of live memory on this communicator's device
            // (the caller's contract), the stream is that device's runtime stream, and the
            // handle is live and used by this thread alone (`enqueue`).
            dn::all_reduce_sum(comm, at, count, dtype.raw(), inner.stream)
        })?;
        self.settle_enqueue(start)
    }

    /// Calls `op` with the live handle, under the lock (NCCL allows one thread at a time per
    /// communicator); an aborted communicator refuses.
    pub(super) fn enqueue(
        &self,
        op: impl FnOnce(sys::ncclComm_t) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let comm = self.lock();
        if comm.is_null() {
            return Err(DeviceError::CollectiveAborted { op: OP });
        }
        op(*comm)
    }

    /// After an enqueue started at `start`: on a non-blocking communicator, waits (at most its
    /// deadline) until NCCL has taken it; a blocking one has already.
    pub(super) fn settle_enqueue(&self, start: Instant) -> Result<(), DeviceError> {
        match self.deadline {
            Some(limit) => self.settle_or_abort(start, start + limit),
            None => Ok(()),
        }
    }
}
