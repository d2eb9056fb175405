//! Rank-consistent recording: the ranks of one tensor-parallel group vote, on the host and at
//! record time only, on how a recording ended, so that every rank keeps it, or every rank
//! falls back, or every rank fails, before any of them launches anything.
//!
//! The vote's decision ([`Member`] and `combine`) is the same for every transport; what
//! carries the ballots between ranks is a [`BallotBox`]: a mutex and a condition variable for
//! ranks that are threads of one process (`local.rs`), a TCP star for ranks that are
//! processes (graft-launch's `TcpBallotBox`), and NCCL itself in graft-cuda. Only the first is
//! here: graft-core holds no socket.

mod ballot;
mod combine;
mod error;
mod local;
mod member;

pub use ballot::{Ballot, BallotBox};
pub use error::{Gone, GroupError};
pub use member::Member;

/// How one rank's recording ended, as it votes. Ordered: the worst vote of a round wins.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Vote {
    /// Captured and instantiated; ready to attach and launch.
    Recorded,
    /// The capture failed in a way that makes the signature eager (a capture violation, a
    /// failed instantiation): the call runs eagerly.
    FellBack,
    /// The recording failed with an error the call returns (out of memory, a body error, a
    /// panic): the call runs nothing.
    Failed,
}

/// What a round agreed: the worst vote, and the lowest rank that cast it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Verdict {
    pub(crate) vote: Vote,
    pub(crate) rank: usize,
}

/// What a rank records: (function index, hash of the input sizes and keys). Ranks driven
/// alike record the same; ranks with different sizes (a batch on one rank only) differ.
pub(crate) type Subject = (usize, u64);
