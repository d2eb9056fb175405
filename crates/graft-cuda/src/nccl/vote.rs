//! [`NcclBallotBox`]: a group's votes carried by NCCL itself. A vote is an all-gather of the
//! ballots done as a sum all-reduce of `world * 3` words (each rank writes its ballot at its
//! slot, zeros elsewhere: [`Gather`]), enqueued on the device's runtime stream between
//! captures, then polled (an event query and the communicator's asynchronous state) until it
//! completes or the deadline passes, when the communicator is aborted.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use graft_core::{Ballot, BallotBox, DeviceError, GroupError};

use super::NcclComm;
use super::gather::Gather;

/// One rank's ballot box over its NCCL communicator (see the module docs). The communicator
/// is shared with the rank's data all-reduces: one stream keeps all of its operations in one
/// order. A vote that times out, or that NCCL reports failed (a peer's failure shows as
/// `ncclRemoteError`), aborts the communicator: the group and the communicator are then both
/// done, and the job must make new ones (new processes and communicators).
pub struct NcclBallotBox {
    /// Declared first, so dropped (its memory released) while the communicator lives.
    gather: Gather,
    comm: Arc<NcclComm>,
}

impl fmt::Debug for NcclBallotBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBallotBox")
            .field("comm", &self.comm)
            .finish_non_exhaustive()
    }
}

impl NcclBallotBox {
    /// The ballot box of `comm`'s rank, with its vote's memory made on `comm`'s device.
    pub fn new(comm: Arc<NcclComm>) -> Result<NcclBallotBox, DeviceError> {
        let gather = Gather::new(&comm, comm.world * Ballot::WORDS)?;
        Ok(NcclBallotBox { gather, comm })
    }
}

impl BallotBox for NcclBallotBox {
    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world(&self) -> usize {
        self.comm.world
    }

    fn exchange(&self, ballot: Ballot, timeout: Duration) -> Result<Vec<Ballot>, GroupError> {
        let _span = tracing::debug_span!("nccl_vote", rank = self.comm.rank).entered();
        let (rank, world) = (self.comm.rank, self.comm.world);
        let start = Instant::now();
        let sum = self.gather.exchange(
            &self.comm,
            &ballot.slot_words(rank, world),
            start,
            start + timeout,
        )?;
        tracing::debug!(waited = ?start.elapsed(), "voted over NCCL");
        Ballot::gather(rank, world, &sum)
    }
}
