//! The data all-reduce a tensor-parallel body runs: an in-place sum on the device's runtime
//! stream, captured when the stream is capturing.

use std::time::Instant;

use cudarc::nccl::sys;
use graft_core::{Buffer, DeviceError};

use super::NcclComm;
use super::status::OP;
use crate::driver::nccl as dn;

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
        let inner = &self.queue.inner;
        let at = buffer.device_addr(OP, inner.id, 0, bytes)?;
        inner.make_current(OP)?;
        if !inner.conditionals.lock().open_is_empty() {
            // NCCL records event nodes (and, with graph mixing, host-side bookkeeping), which
            // a conditional body cannot hold: refused here, before NCCL enqueues anything.
            return Err(DeviceError::Conditional {
                op: OP,
                rule: graft_core::ConditionalRule::Collective,
            });
        }
        let start = Instant::now();
        self.enqueue(|comm| {
            // `at` is `bytes` of live memory on this communicator's device (checked above;
            // graft keeps a buffer's memory while it is held, and the caller holds it until the
            // stream has run the collective), the stream is that device's runtime stream, and
            // the handle is live and used by this thread alone (`enqueue`).
            dn::all_reduce_sum(
                comm,
                at.0,
                n,
                sys::ncclDataType_t::ncclFloat32,
                inner.stream,
            )
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
