//! [`TcpBallotBox`]: a group's votes carried by the job's TCP rendezvous, for ranks that are
//! processes without a device transport (the simulator in CI), or beside one.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::ExchangeError;
use crate::rendezvous::Rendezvous;
use crate::wire;
use graft_core::{Ballot, BallotBox, GroupError};

/// The all-gather tag of a vote, so that a vote meeting another exchange is out of step.
pub const VOTE_TAG: u32 = 0x766f_7465;

/// One rank's ballot box over the job's [`Rendezvous`]: each vote is an all-gather of the
/// ballots through rank 0, which decides whether every ballot arrived in time and tells the
/// others. The rendezvous may carry other exchanges too (the simulator's all-reduce); the ranks
/// must then make them in the same order.
#[derive(Debug)]
pub struct TcpBallotBox {
    rank: usize,
    world: usize,
    rendezvous: Arc<Mutex<Rendezvous>>,
}

impl TcpBallotBox {
    /// The ballot box of this process's rank of `rendezvous`.
    pub fn new(rendezvous: Arc<Mutex<Rendezvous>>) -> TcpBallotBox {
        let (rank, world) = {
            let rv = rendezvous.lock().unwrap_or_else(PoisonError::into_inner);
            (rv.rank(), rv.world())
        };
        TcpBallotBox {
            rank,
            world,
            rendezvous,
        }
    }
}

impl BallotBox for TcpBallotBox {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn exchange(&self, ballot: Ballot, timeout: Duration) -> Result<Vec<Ballot>, GroupError> {
        let part = wire::bytes_of(&ballot.to_words());
        let gathered = self
            .rendezvous
            .lock()
            // An exchange that panicked failed the rendezvous, which then refuses the next.
            .unwrap_or_else(PoisonError::into_inner)
            .all_gather(VOTE_TAG, &part, timeout)
            .map_err(group_error)?;
        Ballot::gather(self.rank, self.world, &wire::all_words(&gathered))
    }
}

/// The group's error for a failed exchange of votes.
fn group_error(e: ExchangeError) -> GroupError {
    match e {
        ExchangeError::Timeout {
            rank,
            waited,
            missing,
        } => GroupError::Timeout {
            rank,
            waited,
            missing,
        },
        ExchangeError::NoReply { rank, waited } => GroupError::Unanswered { rank, waited },
        ExchangeError::Lost { rank, peer, kind } => GroupError::PeerLost { rank, peer, kind },
        ExchangeError::OutOfStep { rank, peer, what } => GroupError::OutOfStep { rank, peer, what },
        ExchangeError::Aborted { rank, cause } | ExchangeError::Failed { rank, cause } => {
            GroupError::Broken {
                rank,
                cause: Box::new(group_error(*cause)),
            }
        }
    }
}
