//! `JoinError` and `ExchangeError`: what can go wrong joining the TCP rendezvous of a job,
//! and exchanging bytes over it once joined.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

/// Errors of [`Rendezvous::join`](crate::Rendezvous::join).
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum JoinError {
    /// MASTER_ADDR does not resolve.
    #[error(
        "cannot resolve MASTER_ADDR {addr}:{port} ({kind}); set MASTER_ADDR to rank 0's host name or address"
    )]
    Resolve {
        /// The address as given.
        addr: String,
        /// The port.
        port: u16,
        /// The resolver's error.
        kind: ErrorKind,
    },
    /// Rank 0 cannot listen on its address and port (`MASTER_ADDR`, and `GRAFT_PORT` or the
    /// launcher's port rule: see `ProcessGroup::from_env`).
    #[error(
        "rank 0 cannot listen on {at} ({kind}): the port is taken, or the address is not this host's; set GRAFT_PORT (or MASTER_PORT) to a free port and MASTER_ADDR to rank 0's host"
    )]
    Bind {
        /// The address it tried.
        at: SocketAddr,
        /// The system's error.
        kind: ErrorKind,
    },
    /// A rank could not connect to rank 0 before the deadline.
    #[error(
        "rank {rank} could not connect to rank 0 at {at} within {waited:?} (last error: {kind}); start rank 0 with the same MASTER_ADDR and MASTER_PORT, or give the ranks a longer deadline"
    )]
    Unreachable {
        /// The rank that tried.
        rank: usize,
        /// Rank 0's address.
        at: SocketAddr,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        kind: ErrorKind,
    },
    /// Some ranks never joined before the deadline (reported by rank 0, and passed on to the
    /// ranks that did join).
    #[error(
        "rank {rank}: ranks {missing:?} never joined the rendezvous within {waited:?}; start all WORLD_SIZE ranks with the same MASTER_ADDR and MASTER_PORT"
    )]
    NeverJoined {
        /// The rank reporting.
        rank: usize,
        /// The ranks that did not join.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// Something connected to rank 0's port that is not a rank of this job.
    #[error(
        "a connection from {from} to rank 0's port did not introduce itself as a graft rank; another program uses MASTER_PORT: pick a free one"
    )]
    BadHello {
        /// Where it came from.
        from: SocketAddr,
    },
    /// Two ranks disagree on the number of ranks.
    #[error(
        "rank {peer} joined with WORLD_SIZE={peer_world} while rank {rank} has {world}; start every rank with the same WORLD_SIZE"
    )]
    WorldMismatch {
        /// The rank reporting.
        rank: usize,
        /// The rank it disagrees with.
        peer: usize,
        /// The reporting rank's world.
        world: usize,
        /// The other rank's world.
        peer_world: usize,
    },
    /// Two processes joined with the same rank (or a rank outside the job).
    #[error(
        "a second process joined as rank {peer} (or that rank is outside the job); give every process its own RANK in 0..WORLD_SIZE"
    )]
    DuplicateRank {
        /// The rank claimed twice.
        peer: usize,
    },
    /// The connection to rank 0 failed while joining (it closed, timed out, or spoke out of
    /// turn).
    #[error(transparent)]
    Link(#[from] ExchangeError),
}

/// Errors of a [`Rendezvous`](crate::Rendezvous)'s broadcast and all-gather. Each leaves the
/// rendezvous unusable: its later operations return [`ExchangeError::Failed`].
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum ExchangeError {
    /// Rank 0 waited for ranks that did not send their part of an all-gather in time.
    #[error(
        "rank {rank} waited {waited:?} for ranks {missing:?} to send their part, and they did not; every rank must make the same calls in the same order"
    )]
    Timeout {
        /// The rank that waited (rank 0).
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks whose part did not arrive.
        missing: Vec<usize>,
    },
    /// A rank waited for rank 0's answer past its deadline.
    #[error(
        "rank {rank} waited {waited:?} for rank 0 to answer, and it did not: rank 0 is stuck, late, or gone"
    )]
    NoReply {
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// A connection closed or failed.
    #[error(
        "rank {rank} lost its connection to rank {peer} ({kind}): that process ended or the network failed; start the job again"
    )]
    Lost {
        /// The rank that noticed.
        rank: usize,
        /// The rank at the other end.
        peer: usize,
        /// What the connection reported (end of file for a closed one).
        kind: ErrorKind,
    },
    /// A message of another kind or size than the operation expects arrived.
    #[error(
        "rank {rank} got {what} from rank {peer}: the ranks are out of step (they run different programs or make different calls)"
    )]
    OutOfStep {
        /// The rank that noticed.
        rank: usize,
        /// The rank it came from.
        peer: usize,
        /// What arrived, lowercase.
        what: &'static str,
    },
    /// Rank 0 failed an all-gather and told this rank why.
    #[error("rank {rank}'s all-gather failed at rank 0: {cause}")]
    Aborted {
        /// The rank told.
        rank: usize,
        /// Rank 0's error.
        cause: Box<ExchangeError>,
    },
    /// An earlier operation failed, so the connections are in an unknown state.
    #[error("rank {rank}'s rendezvous failed earlier ({cause}); start the job again")]
    Failed {
        /// The rank asked.
        rank: usize,
        /// The first failure.
        cause: Box<ExchangeError>,
    },
}
