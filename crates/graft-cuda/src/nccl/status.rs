//! The bounded wait on a non-blocking communicator: polling `ncclCommGetAsyncError` until an
//! operation leaves `ncclInProgress`, at most until a deadline. (NCCL's results become core's
//! errors in the floor, `driver::nccl`.)

use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use graft_core::{DeviceError, DeviceOp};

use super::NcclComm;
use crate::driver::nccl::{self as dn, check};

pub(super) const OP: DeviceOp = DeviceOp::Collective;

pub(super) const LAZY_CONNECT: &str = "NCCL_RUNTIME_CONNECT is not 0: NCCL would connect ranks at their first collective, which blocks until every rank gets there, so a rank whose recording failed before its collective would leave its peers stuck inside theirs; set NCCL_RUNTIME_CONNECT=0 in the environment before the program starts";

/// The longest sleep between two polls of a communicator's state.
const MAX_POLL: Duration = Duration::from_millis(1);

/// Why [`NcclComm::settle`] gave up.
#[derive(Debug)]
pub(super) enum Unsettled {
    /// The deadline passed with the operation still in progress.
    TimedOut,
    /// The communicator reported an error (a peer's failure shows as `ncclRemoteError`), or
    /// was aborted.
    Failed(DeviceError),
}

impl NcclComm {
    /// The communicator's asynchronous state (`ncclCommGetAsyncError`).
    pub(super) fn async_state(&self) -> Result<sys::ncclResult_t, DeviceError> {
        let comm = self.lock();
        if comm.is_null() {
            return Err(DeviceError::CollectiveAborted { op: OP });
        }
        // The handle is live (not null: aborted and destroyed handles are nulled under this
        // lock) and used by this thread alone while the lock is held.
        dn::async_error(*comm)
    }

    /// Polls the communicator until its last operation is no longer in progress: `Ok` when it
    /// completed, or why not by `deadline`.
    pub(super) fn settle(&self, deadline: Instant) -> Result<(), Unsettled> {
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_state().map_err(Unsettled::Failed)? {
                sys::ncclResult_t::ncclInProgress if Instant::now() >= deadline => {
                    return Err(Unsettled::TimedOut);
                }
                sys::ncclResult_t::ncclInProgress => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(MAX_POLL);
                }
                state => return check(state).map_err(Unsettled::Failed),
            }
        }
    }

    /// [`NcclComm::settle`] for an operation started at `start`, as one error: on a timeout or
    /// a failure the communicator is aborted (so no peer waits on it) and the error says so.
    pub(super) fn settle_or_abort(
        &self,
        start: Instant,
        deadline: Instant,
    ) -> Result<(), DeviceError> {
        let unsettled = match self.settle(deadline) {
            Ok(()) => return Ok(()),
            Err(u) => u,
        };
        self.abort_after_failure();
        Err(match unsettled {
            Unsettled::TimedOut => DeviceError::CollectiveUnanswered {
                op: OP,
                rank: self.rank,
                waited: start.elapsed(),
            },
            Unsettled::Failed(e) => e,
        })
    }
}
