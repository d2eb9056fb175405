//! Rank-consistent recording: the ranks of one tensor-parallel group vote, on the host and at
//! record time only, on how a recording ended, so that every rank keeps it, or every rank
//! falls back, or every rank fails, before any of them launches anything.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

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

/// Errors of a group's agreement. Each ends the recording on every rank that sees it, before
/// anything is launched.
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum GroupError {
    /// A group was asked for with no ranks.
    #[error("a group needs at least one rank")]
    Empty,
    /// Some ranks never reached the recording this rank waited at.
    #[error(
        "rank {rank} waited {waited:?} for ranks {missing:?} to reach the same recording, and they never did; the group is broken: drive every rank with the same graft calls in the same order, then make a new group"
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// How long it waited (the group's timeout).
        waited: Duration,
        /// The ranks that did not vote.
        missing: Vec<usize>,
    },
    /// An earlier round timed out, so no later round can be trusted to complete.
    #[error(
        "the group is broken since rank {timed_out} timed out waiting for its peers; make a new group (and new communicators)"
    )]
    Broken {
        /// The rank whose wait timed out.
        timed_out: usize,
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

/// What a rank records: (function index, hash of the input sizes and keys). Ranks driven
/// alike record the same; ranks with different sizes (a batch on one rank only) differ.
pub(crate) type Subject = (usize, u64);

/// The state of the current round.
#[derive(Debug)]
struct Round {
    /// Rounds completed so far.
    generation: u64,
    /// This round's votes, by rank.
    votes: Vec<Option<(Vote, Subject)>>,
    /// The outcome of the last completed round, read by its waiters.
    result: Result<Verdict, GroupError>,
    /// Set when a wait timed out: the rank that timed out.
    broken: Option<usize>,
}

#[derive(Debug)]
struct Shared {
    timeout: Duration,
    round: Mutex<Round>,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A round is consistent after every statement: a panic elsewhere cannot leave it torn.
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One rank's membership of a tensor-parallel group: give it to that rank's [`Graft`](crate::Graft) with
/// [`Graft::join`](crate::Graft::join). Made by [`Member::group`] (or by a
/// [`Coordinator`](crate::Coordinator), which hands one to each rank's thread).
///
/// Every rank of a group must make the same graft calls in the same order (the collectives in
/// their bodies deadlock otherwise). Given the same calls, graft's decisions are the same on
/// every rank; what can differ is a failure on one rank while recording. So each recording
/// ends with a vote: every rank waits (at most the group's timeout) until all have voted, then
/// all keep the recording, or all fall back to eager (one rank's capture failed), or all return
/// an error (one rank failed). Replays take no vote.
#[derive(Clone, Debug)]
pub struct Member {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl Member {
    /// The members of a new group of `world` ranks, in rank order. A rank waits at most
    /// `timeout` for the others at a recording; past it the group is broken.
    pub fn group(world: usize, timeout: Duration) -> Result<Vec<Member>, GroupError> {
        if world == 0 {
            return Err(GroupError::Empty);
        }
        let shared = Arc::new(Shared {
            timeout,
            round: Mutex::new(Round {
                generation: 0,
                votes: vec![None; world],
                result: Err(GroupError::Empty),
                broken: None,
            }),
            done: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| Member {
                rank,
                world,
                shared: shared.clone(),
            })
            .collect())
    }

    /// This member's rank, `0..world`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether a wait timed out, so that every later recording fails.
    pub fn is_broken(&self) -> bool {
        self.shared.lock().broken.is_some()
    }

    /// Votes and waits for the others: the group's verdict, the same on every rank.
    pub(crate) fn agree(&self, vote: Vote, subject: Subject) -> Result<Verdict, GroupError> {
        let shared = &*self.shared;
        let mut round = shared.lock();
        if let Some(timed_out) = round.broken {
            return Err(GroupError::Broken { timed_out });
        }
        if let Some(result) = self.cast(&mut round, vote, subject) {
            return result;
        }
        let generation = round.generation;
        let start = Instant::now();
        let (mut round, _) = shared
            .done
            .wait_timeout_while(round, shared.timeout, |r| {
                r.generation == generation && r.broken.is_none()
            })
            .unwrap_or_else(PoisonError::into_inner);
        if round.generation != generation {
            // The round completed; no later one can complete before this rank votes again.
            return round.result.clone();
        }
        if let Some(timed_out) = round.broken {
            return Err(GroupError::Broken { timed_out });
        }
        round.broken = Some(self.rank);
        let missing = (0..self.world)
            .filter(|&r| round.votes[r].is_none())
            .collect();
        shared.done.notify_all();
        Err(GroupError::Timeout {
            rank: self.rank,
            waited: start.elapsed(),
            missing,
        })
    }

    /// Votes [`Vote::Failed`] without waiting: a rank whose body panicked while recording
    /// leaves, and its peers learn at once that the recording failed.
    pub(crate) fn abandon(&self, subject: Subject) {
        let mut round = self.shared.lock();
        if round.broken.is_none() {
            let _ = self.cast(&mut round, Vote::Failed, subject);
        }
    }

    /// Records this rank's vote; when it is the last, completes the round and returns its
    /// result.
    fn cast(
        &self,
        round: &mut Round,
        vote: Vote,
        subject: Subject,
    ) -> Option<Result<Verdict, GroupError>> {
        round.votes[self.rank] = Some((vote, subject));
        if round.votes.iter().any(Option::is_none) {
            return None;
        }
        let votes: Vec<(Vote, Subject)> = round.votes.iter_mut().filter_map(Option::take).collect();
        round.result = combine(&votes);
        round.generation += 1;
        self.shared.done.notify_all();
        Some(round.result.clone())
    }
}

/// The verdict of a complete round: an error if the ranks record different things, else the
/// worst vote with the lowest rank that cast it.
fn combine(votes: &[(Vote, Subject)]) -> Result<Verdict, GroupError> {
    let (_, first) = votes[0];
    if let Some(other) = votes.iter().position(|&(_, s)| s != first) {
        let (_, theirs) = votes[other];
        return Err(GroupError::Diverged {
            rank: 0,
            function: first.0,
            shape: first.1,
            other,
            other_function: theirs.0,
            other_shape: theirs.1,
        });
    }
    let (rank, &(vote, _)) = votes
        .iter()
        .enumerate()
        .max_by(|(ra, (va, _)), (rb, (vb, _))| va.cmp(vb).then(rb.cmp(ra)))
        .expect("a complete round has one vote per rank, and a group at least one rank");
    Ok(Verdict { vote, rank })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn vote_of(i: u8) -> Vote {
        [Vote::Recorded, Vote::FellBack, Vote::Failed][usize::from(i % 3)]
    }

    proptest! {
        // Against the obvious oracle: the worst vote, first rank to cast it; any differing
        // subject is a divergence naming the first rank that differs.
        #[test]
        fn combine_matches_the_oracle(votes in proptest::collection::vec((0u8..3, 0u64..2), 1..8)) {
            let votes: Vec<(Vote, Subject)> = votes.iter().map(|&(v, s)| (vote_of(v), (0, s))).collect();
            let got = combine(&votes);
            match votes.iter().position(|v| v.1 != votes[0].1) {
                Some(other) => {
                    let named = matches!(got, Err(GroupError::Diverged { other: o, .. }) if o == other);
                    prop_assert!(named, "{:?}", got);
                }
                None => {
                    let worst = votes.iter().map(|v| v.0).max().unwrap();
                    let rank = votes.iter().position(|v| v.0 == worst).unwrap();
                    prop_assert_eq!(got, Ok(Verdict { vote: worst, rank }));
                }
            }
        }
    }

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
        assert_eq!(
            members[1].agree(Vote::Recorded, (0, 0)),
            Err(GroupError::Broken { timed_out: 0 })
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
}
