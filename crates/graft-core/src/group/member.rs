//! `Member`: one rank's membership of a group, the vote's state machine over any
//! [`BallotBox`]: cast, combine, and stay broken once a round failed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::combine::combine;
use super::local::LocalBallotBox;
use super::{Ballot, BallotBox, GroupError, Subject, Verdict, Vote};

/// One rank's membership of a tensor-parallel group: give it to that rank's [`Graft`](crate::Graft) with
/// [`Graft::join`](crate::Graft::join). Made by [`Member::group`] for ranks that are threads of
/// one process (or by a [`Coordinator`](crate::Coordinator), which hands one to each rank's
/// thread), or by [`Member::new`] over a transport for ranks that are processes
/// (graft-launch's `TcpBallotBox`, graft-cuda's NCCL box).
///
/// Every rank of a group must make the same graft calls in the same order (the collectives in
/// their bodies deadlock otherwise). Given the same calls, graft's decisions are the same on
/// every rank; what can differ is a failure on one rank while recording. So each recording
/// ends with a vote: every rank waits (at most the group's timeout) until all have voted, then
/// all keep the recording, or all fall back to eager (one rank's capture failed), or all return
/// an error (one rank failed). Replays take no vote. A vote that fails (a timeout, a lost
/// peer, a failed transport) breaks the group: every later recording fails at once.
#[derive(Clone, Debug)]
pub struct Member {
    transport: Arc<dyn BallotBox>,
    timeout: Duration,
    /// What broke the group, once something did. Shared by the members of one in-process
    /// group, so that a timeout on one rank breaks every rank at once.
    broken: Arc<Mutex<Option<GroupError>>>,
    /// Whether `broken` holds a cause: what every call reads (one atomic load), since a broken
    /// group refuses every call, replays included.
    is_broken: Arc<AtomicBool>,
}

impl Member {
    /// The members of a new in-process group of `world` ranks, in rank order. A rank waits at
    /// most `timeout` for the others at a recording; past it the group is broken.
    pub fn group(world: usize, timeout: Duration) -> Result<Vec<Member>, GroupError> {
        if world == 0 {
            return Err(GroupError::Empty);
        }
        let broken = Arc::new(Mutex::new(None));
        let is_broken = Arc::new(AtomicBool::new(false));
        Ok(LocalBallotBox::group(world)
            .into_iter()
            .map(|b| Member {
                transport: Arc::new(b),
                timeout,
                broken: broken.clone(),
                is_broken: is_broken.clone(),
            })
            .collect())
    }

    /// This rank's member of a group whose ballots `transport` carries. A rank waits about
    /// `timeout` for the others at a recording (the transport bounds the wait); past it the
    /// group is broken.
    pub fn new(transport: Arc<dyn BallotBox>, timeout: Duration) -> Member {
        Member {
            transport,
            timeout,
            broken: Arc::new(Mutex::new(None)),
            is_broken: Arc::new(AtomicBool::new(false)),
        }
    }

    /// This member's rank, `0..world`.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// The number of ranks in the group.
    pub fn world(&self) -> usize {
        self.transport.world()
    }

    /// Whether the group is broken (a vote failed, or graft-launch's `Watchdog` found a peer
    /// gone), so that every later call and read fails.
    pub fn is_broken(&self) -> bool {
        self.is_broken.load(Ordering::Acquire)
    }

    fn lock_broken(&self) -> std::sync::MutexGuard<'_, Option<GroupError>> {
        // The slot is written once, whole: a panic elsewhere cannot leave it torn.
        self.broken.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The error of a call (or a vote) on a broken group, or `None` when the group is whole.
    pub(crate) fn refuse(&self) -> Option<GroupError> {
        self.lock_broken().as_ref().map(|cause| GroupError::Broken {
            rank: self.rank(),
            cause: Box::new(cause.clone()),
        })
    }

    /// Remembers what broke the group (the first cause only; a `Broken` learned from another
    /// rank is remembered as its cause): from then on every call and read refuses. An error
    /// that does not break a group ([`GroupError::Diverged`], [`GroupError::Empty`]) is ignored.
    ///
    /// Public for what breaks a group outside a vote: graft-launch's `Watchdog`, which lives
    /// beside graft-core (graft-core holds no socket) and breaks the group with
    /// [`GroupError::Watchdog`] when it finds a peer gone, before it aborts the communicators.
    pub fn note(&self, error: &GroupError) {
        if !error.breaks_the_group() {
            return;
        }
        let cause = match error {
            GroupError::Broken { cause, .. } => (**cause).clone(),
            other => other.clone(),
        };
        self.lock_broken().get_or_insert(cause);
        self.is_broken.store(true, Ordering::Release);
    }

    /// Votes and waits for the others: the group's verdict, the same on every rank.
    pub(crate) fn agree(&self, vote: Vote, subject: Subject) -> Result<Verdict, GroupError> {
        if let Some(refused) = self.refuse() {
            return Err(refused);
        }
        let ballot = Ballot { vote, subject };
        let verdict = self
            .transport
            .exchange(ballot, self.timeout)
            .and_then(|ballots| {
                if ballots.len() != self.world() || ballots.is_empty() {
                    return Err(GroupError::BallotCount {
                        rank: self.rank(),
                        got: ballots.len(),
                        world: self.world(),
                    });
                }
                combine(&ballots)
            });
        match verdict {
            Ok(v) => {
                tracing::debug!(?vote, agreed = ?v.vote, by = v.rank, "vote");
                Ok(v)
            }
            Err(e) => {
                tracing::debug!(?vote, error = %e, "vote failed");
                self.note(&e);
                // A watchdog that found a peer gone aborted the transport under the vote: its
                // finding, which names the peer, is the error, not the aborted transport's.
                match &*self.lock_broken() {
                    Some(found @ GroupError::Watchdog { .. }) => Err(found.clone()),
                    _ => Err(e),
                }
            }
        }
    }

    /// Votes [`Vote::Failed`] for a rank whose body panicked while recording: its peers learn
    /// at once that the recording failed (see [`BallotBox::leave`]).
    pub(crate) fn abandon(&self, subject: Subject) {
        if self.is_broken() {
            return;
        }
        let ballot = Ballot {
            vote: Vote::Failed,
            subject,
        };
        if let Err(e) = self.transport.leave(ballot, self.timeout) {
            tracing::debug!(error = %e, "leaving the vote failed");
            self.note(&e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    #[test]
    fn every_rank_gets_the_same_verdict() {
        let members = Member::group(3, Duration::from_secs(10)).unwrap();
        let verdicts: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .iter()
                .map(|m| {
                    s.spawn(move || {
                        let vote = if m.rank() == 1 {
                            Vote::FellBack
                        } else {
                            Vote::Recorded
                        };
                        (0..50).map(|_| m.agree(vote, (0, 0))).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for v in &verdicts {
            assert!(v.iter().all(|r| *r
                == Ok(Verdict {
                    vote: Vote::FellBack,
                    rank: 1
                })));
        }
    }

    #[test]
    fn a_missing_rank_times_out_and_breaks_the_group() {
        let members = Member::group(2, Duration::from_millis(50)).unwrap();
        let err = members[0].agree(Vote::Recorded, (0, 0)).unwrap_err();
        assert!(
            matches!(&err, GroupError::Timeout { rank: 0, missing, .. } if missing == &[1]),
            "{err}"
        );
        assert!(members[1].is_broken());
        let later = members[1].agree(Vote::Recorded, (0, 0)).unwrap_err();
        assert!(
            matches!(&later, GroupError::Broken { rank: 1, cause } if **cause == err),
            "{later}"
        );
    }

    #[test]
    fn a_rank_waiting_when_a_peer_times_out_learns_it_at_once() {
        let members = Member::group(3, Duration::from_secs(30)).unwrap();
        let short = Member {
            timeout: Duration::from_millis(50),
            ..members[0].clone()
        };
        let started = Instant::now();
        let waiting = std::thread::scope(|s| {
            let waiter = s.spawn(|| members[1].agree(Vote::Recorded, (0, 0)));
            std::thread::sleep(Duration::from_millis(10));
            let _ = short.agree(Vote::Recorded, (0, 0));
            waiter.join().unwrap()
        });
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            matches!(&waiting, Err(GroupError::Broken { rank: 1, cause })
                if matches!(**cause, GroupError::Timeout { rank: 0, .. })),
            "{waiting:?}"
        );
    }

    #[test]
    fn an_abandoning_rank_fails_the_round_without_a_wait() {
        let members = Member::group(2, Duration::from_secs(60)).unwrap();
        members[1].abandon((0, 0));
        let start = Instant::now();
        assert_eq!(
            members[0].agree(Vote::Recorded, (0, 0)),
            Ok(Verdict {
                vote: Vote::Failed,
                rank: 1
            })
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    /// A transport that answers every exchange with `answer`, counting the exchanges.
    #[derive(Debug)]
    struct Scripted {
        answer: Result<Vec<Ballot>, GroupError>,
        calls: AtomicUsize,
    }

    impl BallotBox for Scripted {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn exchange(&self, _: Ballot, _: Duration) -> Result<Vec<Ballot>, GroupError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.answer.clone()
        }
    }

    fn scripted(answer: Result<Vec<Ballot>, GroupError>) -> (Member, Arc<Scripted>) {
        let transport = Arc::new(Scripted {
            answer,
            calls: AtomicUsize::new(0),
        });
        (
            Member::new(transport.clone(), Duration::from_secs(1)),
            transport,
        )
    }

    #[test]
    fn a_lost_peer_breaks_the_group_and_the_transport_is_not_asked_again() {
        let lost = GroupError::PeerLost {
            rank: 0,
            peer: 1,
            kind: std::io::ErrorKind::UnexpectedEof,
        };
        let (member, transport) = scripted(Err(lost.clone()));
        assert_eq!(member.agree(Vote::Recorded, (0, 0)), Err(lost.clone()));
        assert!(member.is_broken());
        assert_eq!(
            member.agree(Vote::Recorded, (0, 0)),
            Err(GroupError::Broken {
                rank: 0,
                cause: Box::new(lost)
            })
        );
        assert_eq!(transport.calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_divergence_does_not_break_the_group() {
        let ballots = vec![
            Ballot {
                vote: Vote::Recorded,
                subject: (0, 1),
            },
            Ballot {
                vote: Vote::Recorded,
                subject: (0, 2),
            },
        ];
        let (member, transport) = scripted(Ok(ballots));
        for _ in 0..2 {
            let err = member.agree(Vote::Recorded, (0, 1)).unwrap_err();
            assert!(
                matches!(err, GroupError::Diverged { other: 1, .. }),
                "{err}"
            );
        }
        assert!(!member.is_broken());
        assert_eq!(transport.calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_transport_returning_too_few_ballots_breaks_the_group() {
        let one = Ballot {
            vote: Vote::Recorded,
            subject: (0, 0),
        };
        let (member, _) = scripted(Ok(vec![one]));
        assert_eq!(
            member.agree(Vote::Recorded, (0, 0)),
            Err(GroupError::BallotCount {
                rank: 0,
                got: 1,
                world: 2
            })
        );
        assert!(member.is_broken());
    }
}
