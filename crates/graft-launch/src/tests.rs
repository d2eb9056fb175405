//! The rendezvous and the TCP ballot box over loopback, each rank a thread: joining, the two
//! exchanges, and every way they fail, each within its deadline.

use std::io::ErrorKind;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::*;
use graft_core::{Ballot, BallotBox, GroupError};

const DEADLINE: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);

fn free_port() -> u16 {
    super::free_port().unwrap()
}

fn place(rank: usize, world: usize, port: u16) -> ProcessGroup {
    ProcessGroup::new(rank, world, rank, "127.0.0.1", port).unwrap()
}

/// Runs `f(rank)` on `world` threads, each rank with its own place in one job, and returns the
/// results in rank order.
fn ranks<T: Send>(world: usize, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    let port = free_port();
    thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                s.spawn(move || f(place(r, world, port)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_join_broadcast_and_gather() {
    let out = ranks(3, |g| {
        let mut rv = Rendezvous::join(&g, DEADLINE).unwrap();
        let mut id = if g.rank() == 0 { [7u8; 128] } else { [0; 128] };
        rv.broadcast(&mut id, DEADLINE).unwrap();
        let gathered = rv.all_gather(1, &[g.rank() as u8; 2], DEADLINE).unwrap();
        (id, gathered)
    });
    for (id, gathered) in out {
        assert_eq!(id, [7u8; 128]);
        assert_eq!(gathered, vec![0, 0, 1, 1, 2, 2]);
    }
}

#[test]
fn a_rank_that_never_joins_is_named_to_every_rank_in_time() {
    let start = Instant::now();
    let out = ranks(3, |g| {
        (g.rank() < 2).then(|| Rendezvous::join(&g, SHORT).unwrap_err())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    for (rank, err) in out.into_iter().take(2).enumerate() {
        let err = err.unwrap();
        assert!(
            matches!(&err, JoinError::NeverJoined { rank: r, missing, .. } if *r == rank && missing == &[2]),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn a_missing_rank_0_is_unreachable() {
    let start = Instant::now();
    let err = Rendezvous::join(&place(1, 2, free_port()), SHORT).unwrap_err();
    assert!(
        matches!(err, JoinError::Unreachable { rank: 1, .. }),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn ranks_disagreeing_on_the_world_are_refused() {
    let port = free_port();
    let (hub, spoke) = thread::scope(|s| {
        let hub = s.spawn(|| Rendezvous::join(&place(0, 2, port), DEADLINE).unwrap_err());
        let spoke = s.spawn(|| Rendezvous::join(&place(1, 3, port), DEADLINE).unwrap_err());
        (hub.join().unwrap(), spoke.join().unwrap())
    });
    assert_eq!(
        hub,
        JoinError::WorldMismatch {
            rank: 0,
            peer: 1,
            world: 2,
            peer_world: 3
        }
    );
    assert_eq!(
        spoke,
        JoinError::WorldMismatch {
            rank: 1,
            peer: 0,
            world: 3,
            peer_world: 2
        }
    );
}

#[test]
fn a_stranger_on_the_port_is_a_bad_hello() {
    let port = free_port();
    let err = thread::scope(|s| {
        let hub = s.spawn(|| Rendezvous::join(&place(0, 2, port), DEADLINE).unwrap_err());
        let mut stranger = loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        };
        std::io::Write::write_all(
            &mut stranger,
            b"GET / HTTP/1.1\r\nHost: example.org\r\nAccept: */*\r\n\r\n",
        )
        .unwrap();
        hub.join().unwrap()
    });
    assert!(matches!(err, JoinError::BadHello { .. }), "{err}");
}

#[test]
fn a_late_part_times_out_at_rank_0_which_tells_the_others() {
    let start = Instant::now();
    let out = ranks(3, |g| {
        let mut rv = Rendezvous::join(&g, DEADLINE).unwrap();
        if g.rank() == 2 {
            thread::sleep(SHORT * 3);
            return None;
        }
        Some(rv.all_gather(1, &[1], SHORT).unwrap_err())
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let hub = out[0].clone().unwrap();
    assert!(
        matches!(&hub, ExchangeError::Timeout { rank: 0, missing, .. } if missing == &[2]),
        "{hub}"
    );
    let spoke = out[1].clone().unwrap();
    assert_eq!(
        spoke,
        ExchangeError::Aborted {
            rank: 1,
            cause: Box::new(hub)
        }
    );
}

#[test]
fn a_closed_rank_is_lost_and_the_rendezvous_stays_failed() {
    let out = ranks(3, |g| {
        let mut rv = Rendezvous::join(&g, DEADLINE).unwrap();
        if g.rank() == 1 {
            return None;
        }
        let first = rv.all_gather(1, &[1], DEADLINE).unwrap_err();
        let second = rv.all_gather(1, &[1], DEADLINE).unwrap_err();
        Some((first, second))
    });
    let (hub, again) = out[0].clone().unwrap();
    let lost = ExchangeError::Lost {
        rank: 0,
        peer: 1,
        kind: ErrorKind::UnexpectedEof,
    };
    assert_eq!(hub, lost);
    assert_eq!(
        again,
        ExchangeError::Failed {
            rank: 0,
            cause: Box::new(lost.clone())
        }
    );
    let (spoke, _) = out[2].clone().unwrap();
    assert_eq!(
        spoke,
        ExchangeError::Aborted {
            rank: 2,
            cause: Box::new(lost)
        }
    );
}

#[test]
fn exchanges_with_different_tags_are_out_of_step() {
    let out = ranks(2, |g| {
        let mut rv = Rendezvous::join(&g, DEADLINE).unwrap();
        let tag = if g.rank() == 0 { 1 } else { 2 };
        rv.all_gather(tag, &[1], DEADLINE).unwrap_err()
    });
    assert!(
        matches!(
            out[0],
            ExchangeError::OutOfStep {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{}",
        out[0]
    );
}

/// A ballot as its words travel: `[1 + vote, function, shape]` (vote 0 recorded, 1 fell back).
fn ballot(words: [u64; 3]) -> Ballot {
    Ballot::from_words(words).unwrap()
}

// The vote's decision over these boxes (graft-core's `Member`) is tested in graft-core; the
// root crate's tests/processes.rs runs it over this box, ranks as processes.

#[test]
fn tcp_ballot_boxes_carry_a_groups_votes() {
    let recorded = ballot([1, 3, 9]);
    let fell_back = ballot([2, 3, 9]);
    let out = ranks(2, |g| {
        let rv = Arc::new(Mutex::new(Rendezvous::join(&g, DEADLINE).unwrap()));
        let tcp = TcpBallotBox::new(rv);
        let mine = if g.rank() == 1 { fell_back } else { recorded };
        (0..20)
            .map(|_| tcp.exchange(mine, DEADLINE))
            .collect::<Vec<_>>()
    });
    for rounds in out {
        assert!(
            rounds
                .iter()
                .all(|r| r.as_deref() == Ok(&[recorded, fell_back][..])),
            "{rounds:?}"
        );
    }
}

#[test]
fn a_tcp_vote_timing_out_at_rank_0_breaks_every_rank() {
    let out = ranks(3, |g| {
        let rv = Arc::new(Mutex::new(Rendezvous::join(&g, DEADLINE).unwrap()));
        let tcp = TcpBallotBox::new(rv);
        if g.rank() == 2 {
            thread::sleep(SHORT * 3);
            return None;
        }
        Some(tcp.exchange(ballot([1, 0, 0]), SHORT).unwrap_err())
    });
    let hub = out[0].clone().unwrap();
    assert!(
        matches!(&hub, GroupError::Timeout { rank: 0, missing, .. } if missing == &[2]),
        "{hub}"
    );
    let spoke = out[1].clone().unwrap();
    assert_eq!(
        spoke,
        GroupError::Broken {
            rank: 1,
            cause: Box::new(hub)
        }
    );
}

#[test]
fn a_group_of_one_process_votes_alone() {
    let rv = Rendezvous::join(&place(0, 1, free_port()), DEADLINE).unwrap();
    let tcp = TcpBallotBox::new(Arc::new(Mutex::new(rv)));
    assert_eq!((tcp.rank(), tcp.world()), (0, 1));
    let mine = ballot([2, 1, 2]);
    assert_eq!(tcp.exchange(mine, SHORT), Ok(vec![mine]));
}
