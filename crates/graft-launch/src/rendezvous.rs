//! [`Rendezvous`]: the TCP star of a job, rank 0 at its centre. Joining it: rank 0 listens on
//! MASTER_ADDR:MASTER_PORT and accepts one connection per other rank, each introducing itself
//! (magic, rank, world); the others connect, retrying until the deadline.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::config::ProcessGroup;
use crate::error::{ExchangeError, JoinError};
use crate::wire::{self, Kind, WireError};

/// How long rank 0 sleeps between polls of its listener, and others between connection tries.
const POLL: Duration = Duration::from_millis(5);
const RETRY: Duration = Duration::from_millis(20);

/// Why rank 0 refused a hello, as it travels.
const REFUSED_WORLD: u64 = 1;
const REFUSED_RANK: u64 = 2;

/// One rank's end of the job's TCP star: rank 0 holds a connection to every other rank, each
/// other rank one to rank 0. Carries [`Rendezvous::broadcast`] from rank 0 (the NCCL unique
/// id) and [`Rendezvous::all_gather`] through rank 0 (the votes of a
/// [`TcpBallotBox`](crate::TcpBallotBox)). Every wait is bounded.
#[derive(Debug)]
pub struct Rendezvous {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Rank 0: the connection to rank `r` at `r - 1`. Others: the connection to rank 0.
    pub(crate) links: Vec<TcpStream>,
    /// The first failed exchange: the connections' state is unknown after it.
    pub(crate) failed: Option<ExchangeError>,
}

impl Rendezvous {
    /// Joins the job's rendezvous as `group` places this process, within `deadline`: rank 0
    /// waits for every other rank to connect, the others retry connecting to rank 0. Returns
    /// once every rank has joined (rank 0 tells the others), or the reason not.
    pub fn join(group: &ProcessGroup, deadline: Duration) -> Result<Rendezvous, JoinError> {
        let until = Instant::now() + deadline;
        let mut rv = Rendezvous {
            rank: group.rank(),
            world: group.world(),
            links: Vec::new(),
            failed: None,
        };
        if rv.world == 1 {
            return Ok(rv);
        }
        let at = resolve(group)?;
        let _span =
            tracing::debug_span!("rendezvous", rank = rv.rank, world = rv.world, %at).entered();
        if rv.rank == 0 {
            rv.links = accept_all(rv.world, at, until, deadline)?;
        } else {
            rv.links = vec![connect(rv.rank, rv.world, at, until, deadline)?];
        }
        tracing::debug!("joined");
        Ok(rv)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }
}

/// What a wire error on rank `rank`'s link to `peer` is, after waiting `waited`.
pub(crate) fn link_error(
    rank: usize,
    peer: usize,
    e: WireError,
    waited: Duration,
) -> ExchangeError {
    match e {
        WireError::TimedOut => ExchangeError::NoReply { rank, waited },
        WireError::Lost(kind) => ExchangeError::Lost { rank, peer, kind },
        WireError::Garbled => ExchangeError::OutOfStep {
            rank,
            peer,
            what: "bytes that are no message",
        },
    }
}

/// MASTER_ADDR:MASTER_PORT as a socket address (the first the resolver gives).
fn resolve(group: &ProcessGroup) -> Result<SocketAddr, JoinError> {
    let failed = |kind| JoinError::Resolve {
        addr: group.master_addr().to_owned(),
        port: group.master_port(),
        kind,
    };
    (group.master_addr(), group.master_port())
        .to_socket_addrs()
        .map_err(|e| failed(e.kind()))?
        .next()
        .ok_or_else(|| failed(std::io::ErrorKind::NotFound))
}

/// Rank 0: listens at `at` and accepts every other rank's hello before `until`, then welcomes
/// them all, or tells those that came which ranks never did.
fn accept_all(
    world: usize,
    at: SocketAddr,
    until: Instant,
    deadline: Duration,
) -> Result<Vec<TcpStream>, JoinError> {
    let bind_failed = |e: std::io::Error| JoinError::Bind { at, kind: e.kind() };
    let listener = TcpListener::bind(at).map_err(bind_failed)?;
    listener.set_nonblocking(true).map_err(bind_failed)?;
    let mut slots: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
    let start = Instant::now();
    while slots.iter().any(Option::is_none) && Instant::now() < until {
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            // A connection that failed before it was accepted; the next may not.
            Err(_) => continue,
        };
        if stream.set_nonblocking(false).is_err() || stream.set_nodelay(true).is_err() {
            // A connection that failed as it was accepted; its rank may try again.
            continue;
        }
        let hello = match wire::receive(&mut stream, until) {
            Ok(f) if f.kind == Kind::Hello && f.payload.len() == 16 => wire::all_words(&f.payload),
            Ok(_) | Err(WireError::Garbled) => return Err(JoinError::BadHello { from }),
            // Silent until the deadline, or gone: a rank that did not join.
            Err(_) => continue,
        };
        let (peer, peer_world) = (hello[0], hello[1]);
        let peer = usize::try_from(peer).unwrap_or(usize::MAX);
        let peer_world = usize::try_from(peer_world).unwrap_or(usize::MAX);
        if peer_world != world {
            refuse(&mut stream, REFUSED_WORLD, world, until);
            return Err(JoinError::WorldMismatch {
                rank: 0,
                peer,
                world,
                peer_world,
            });
        }
        match slots.get_mut(peer.wrapping_sub(1)) {
            Some(slot @ None) => *slot = Some(stream),
            _ => {
                refuse(&mut stream, REFUSED_RANK, world, until);
                return Err(JoinError::DuplicateRank { peer });
            }
        }
    }
    let missing: Vec<usize> = (1..world).filter(|r| slots[r - 1].is_none()).collect();
    let mut links: Vec<TcpStream> = slots.into_iter().flatten().collect();
    let answer_by = Instant::now() + deadline.max(Duration::from_secs(1));
    if !missing.is_empty() {
        // Whole microseconds, as the report carries it: every rank says the same.
        let waited = Duration::from_micros(wire::micros(start.elapsed()));
        let mut report = vec![wire::micros(waited)];
        report.extend(missing.iter().map(|&r| r as u64));
        for link in &mut links {
            // Best effort: a rank that cannot be told finds out when its own wait ends.
            let _ = wire::send(
                link,
                Kind::NeverJoined,
                0,
                &wire::bytes_of(&report),
                answer_by,
            );
        }
        return Err(JoinError::NeverJoined {
            rank: 0,
            missing,
            waited,
        });
    }
    for (i, link) in links.iter_mut().enumerate() {
        wire::send(link, Kind::Welcome, 0, &[], answer_by)
            .map_err(|e| link_error(0, i + 1, e, start.elapsed()))?;
    }
    Ok(links)
}

/// Rank 0 tells a rank why it refused its hello (best effort: the rank also finds out when
/// its connection closes).
fn refuse(stream: &mut TcpStream, why: u64, world: usize, until: Instant) {
    let _ = wire::send(
        stream,
        Kind::Rejected,
        0,
        &wire::bytes_of(&[why, world as u64]),
        until,
    );
}

/// Another rank: connects to rank 0 at `at` (retrying until `until`), says hello, and waits
/// for rank 0's answer (a little past `until`, so that rank 0's own report arrives first).
fn connect(
    rank: usize,
    world: usize,
    at: SocketAddr,
    until: Instant,
    deadline: Duration,
) -> Result<TcpStream, JoinError> {
    let start = Instant::now();
    let mut stream = loop {
        let left = until.saturating_duration_since(Instant::now());
        let tried = if left.is_zero() {
            Err(std::io::ErrorKind::TimedOut)
        } else {
            TcpStream::connect_timeout(&at, left.min(Duration::from_secs(1))).map_err(|e| e.kind())
        };
        match tried {
            Ok(stream) => break stream,
            Err(kind) if Instant::now() + RETRY >= until => {
                return Err(JoinError::Unreachable {
                    rank,
                    at,
                    waited: start.elapsed(),
                    kind,
                });
            }
            Err(_) => std::thread::sleep(RETRY),
        }
    };
    let failed = |e| link_error(rank, 0, e, start.elapsed());
    stream
        .set_nodelay(true)
        .map_err(|e| failed(WireError::Lost(e.kind())))?;
    let hello = wire::bytes_of(&[rank as u64, world as u64]);
    let answer_by = until + wire::grace(deadline);
    wire::send(&mut stream, Kind::Hello, 0, &hello, answer_by).map_err(failed)?;
    let answer = wire::receive(&mut stream, answer_by).map_err(failed)?;
    let words = wire::all_words(&answer.payload);
    match (answer.kind, words.as_slice()) {
        (Kind::Welcome, _) => Ok(stream),
        (Kind::Rejected, &[REFUSED_WORLD, hub_world]) => Err(JoinError::WorldMismatch {
            rank,
            peer: 0,
            world,
            peer_world: usize::try_from(hub_world).unwrap_or(usize::MAX),
        }),
        (Kind::Rejected, _) => Err(JoinError::DuplicateRank { peer: rank }),
        (Kind::NeverJoined, [waited, missing @ ..]) => Err(JoinError::NeverJoined {
            rank,
            missing: missing.iter().map(|&r| r as usize).collect(),
            waited: Duration::from_micros(*waited),
        }),
        _ => Err(ExchangeError::OutOfStep {
            rank,
            peer: 0,
            what: "a message other than an answer to its hello",
        }
        .into()),
    }
}
