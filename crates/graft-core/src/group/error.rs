//! `GroupError`: what can go wrong in a group's vote, whatever carries the ballots.

use std::time::Duration;

use crate::device::DeviceError;

/// How graft-launch's `Watchdog` found a peer gone.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Gone {
    /// The connection to it closed or failed: its process ended (killed, crashed, exited).
    Closed(std::io::ErrorKind),
    /// Nothing came from it for this long, past the watchdog's bound: it is stopped or hung.
    Silent(Duration),
    /// Rank 0's watchdog found it gone (this rank's own link is to rank 0 only) and said so.
    Reported,
}

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gone::Closed(kind) => write!(f, "its connection closed: {kind}"),
            Gone::Silent(waited) => write!(f, "silent for {waited:?}: stopped or hung"),
            Gone::Reported => write!(f, "rank 0's watchdog reported it gone"),
        }
    }
}

/// Errors of a group's agreement. Each ends the recording on every rank that sees it, before
/// anything is launched. All but [`GroupError::Diverged`] and [`GroupError::Empty`] break the
/// group: every later recording fails at once with [`GroupError::Broken`].
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum GroupError {
    /// A group was asked for with no ranks.
    #[error("a group needs at least one rank")]
    Empty,
    /// Some ranks never reached the recording this rank waited at.
    #[error(
        "rank {rank} waited {waited:?} for ranks {missing:?} to reach the same recording, and they never did; the group is broken: drive every rank with the same graft calls in the same order, then make a new group (new communicators, and new processes where ranks are processes)"
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// How long it waited (the group's timeout).
        waited: Duration,
        /// The ranks that did not vote.
        missing: Vec<usize>,
    },
    /// Not every rank's vote arrived in time, and the transport cannot tell which are missing
    /// (an all-reduce completes for all ranks or for none).
    #[error(
        "rank {rank} waited {waited:?} for the votes of the other ranks on a recording, and not all came (this transport cannot tell which ranks are missing: read their logs); the group is broken: drive every rank with the same graft calls in the same order, then make a new group (new processes and communicators)"
    )]
    Unanswered {
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The connection to another rank closed or failed during a vote.
    #[error(
        "rank {rank} lost its connection to rank {peer} during a vote ({kind}): that rank's process ended or the network failed; the group is broken: make a new group (new processes and communicators)"
    )]
    PeerLost {
        /// The rank that noticed.
        rank: usize,
        /// The rank it lost.
        peer: usize,
        /// What the connection reported (end of file for a closed one).
        kind: std::io::ErrorKind,
    },
    /// The device that carries the vote (an NCCL communicator) failed; a peer's failure often
    /// shows as NCCL's `ncclRemoteError`.
    #[error(
        "rank {rank}'s vote failed on its device: {source}; the group is broken: make a new group (new processes and communicators)"
    )]
    Device {
        /// The rank whose vote failed.
        rank: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// A message of another kind than a vote arrived where a vote was expected.
    #[error(
        "rank {rank} got {what} from rank {peer} during a vote: the ranks are out of step (they run different programs or graft versions, or make different calls); the group is broken: make a new group (new processes and communicators)"
    )]
    OutOfStep {
        /// The rank that noticed.
        rank: usize,
        /// The rank it heard from.
        peer: usize,
        /// What arrived, lowercase.
        what: &'static str,
    },
    /// A rank's ballot arrived as words that are no ballot.
    #[error(
        "rank {rank} received a ballot from rank {from} that is not one (its first word is {word}): the transport corrupted it, or the ranks run different graft versions; the group is broken: make a new group (new processes and communicators)"
    )]
    Malformed {
        /// The rank that decoded it.
        rank: usize,
        /// The rank that sent it.
        from: usize,
        /// Its first word (1, 2 or 3 in a ballot).
        word: u64,
    },
    /// A transport returned another number of ballots than the group has ranks.
    #[error(
        "rank {rank}'s transport returned {got} ballots for a group of {world} ranks, a bug in the transport (an exchange returns one ballot per rank); the group is broken: make a new group"
    )]
    BallotCount {
        /// The rank whose transport it was.
        rank: usize,
        /// The ballots it returned.
        got: usize,
        /// The ranks of the group.
        world: usize,
    },
    /// This rank's watchdog (graft-launch's `Watchdog`) found a peer gone: its connection
    /// closed (the process ended) or it fell silent past the watchdog's bound (stopped or hung).
    /// The communicators were aborted, so collectives waiting on the peer returned and what
    /// they computed is invalid.
    #[error(
        "rank {rank}'s watchdog found rank {peer} gone ({gone}): collectives with it were aborted, so what they computed is invalid and nothing more runs; the group is broken: exit, and start the job again (new processes and communicators)"
    )]
    Watchdog {
        /// The rank whose watchdog noticed.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
        /// How it was found gone.
        gone: Gone,
    },
    /// An earlier vote broke the group (`cause`), so no later vote can be trusted to complete.
    #[error("rank {rank} cannot vote: the group broke at an earlier vote ({cause})")]
    Broken {
        /// The rank that was asked to vote.
        rank: usize,
        /// What broke the group, as the rank that saw it first reported it.
        cause: Box<GroupError>,
    },
    /// The ranks voted on different recordings: they called graft differently.
    #[error(
        "rank {rank} records function {function} (shape {shape:#x}) while rank {other} records function {other_function} (shape {other_shape:#x}); every rank must make the same graft calls in the same order, with the same input sizes and keys"
    )]
    Diverged {
        /// The lowest rank.
        rank: usize,
        /// The function (its registration index) it records.
        function: usize,
        /// A hash of the input sizes and keys it records with.
        shape: u64,
        /// The first rank that records something else.
        other: usize,
        /// The function that rank records.
        other_function: usize,
        /// Its hash of input sizes and keys.
        other_shape: u64,
    },
}

impl GroupError {
    /// Whether this error leaves the group unable to vote again: everything but a divergence
    /// (the round completed, the ranks just recorded different things) and an empty group.
    pub(crate) fn breaks_the_group(&self) -> bool {
        !matches!(self, GroupError::Diverged { .. } | GroupError::Empty)
    }
}
