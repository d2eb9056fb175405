//! [`Ballot`], one rank's vote on a recording with what it records, as three words a transport
//! can carry, and [`BallotBox`], the transport that exchanges a round's ballots among the ranks.

use std::fmt;
use std::time::Duration;

use super::{GroupError, Subject, Vote};

/// One rank's ballot: how its recording ended and what it recorded (the function's index and a
/// hash of its input sizes and keys). Made by graft; a [`BallotBox`] only carries it, as the
/// three words of [`Ballot::to_words`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Ballot {
    pub(crate) vote: Vote,
    pub(crate) subject: Subject,
}

impl Ballot {
    /// The number of `u64` words a ballot travels as.
    pub const WORDS: usize = 3;

    /// The ballot as `[1 + vote, function, shape]`. The first word is never 0, so a transport
    /// that gathers ballots by summing (each rank writes its slot, zeros elsewhere) can tell a
    /// slot nobody wrote.
    pub fn to_words(self) -> [u64; 3] {
        let vote = match self.vote {
            Vote::Recorded => 1,
            Vote::FellBack => 2,
            Vote::Failed => 3,
        };
        let (function, shape) = self.subject;
        // usize is at most 64 bits on every target graft builds for.
        [vote, function as u64, shape]
    }

    /// The ballot [`Ballot::to_words`] made, or `None` when `words` are not one (an empty slot,
    /// or a first word no ballot has).
    pub fn from_words(words: [u64; 3]) -> Option<Ballot> {
        let vote = match words[0] {
            1 => Vote::Recorded,
            2 => Vote::FellBack,
            3 => Vote::Failed,
            _ => return None,
        };
        let function = usize::try_from(words[1]).ok()?;
        Some(Ballot {
            vote,
            subject: (function, words[2]),
        })
    }

    /// The `world * 3` words a rank contributes to a sum that gathers a round's ballots: this
    /// ballot's words at slot `rank`, zeros elsewhere. Summed over the ranks, slot `r` holds
    /// rank `r`'s ballot.
    pub fn slot_words(self, rank: usize, world: usize) -> Vec<u64> {
        let mut words = vec![0; world * Ballot::WORDS];
        words[rank * Ballot::WORDS..][..Ballot::WORDS].copy_from_slice(&self.to_words());
        words
    }

    /// Decodes gathered words (slot `r` rank `r`'s ballot, as [`Ballot::slot_words`] sums to)
    /// into the round's `world` ballots, for rank `rank`. Words of another count are
    /// [`GroupError::BallotCount`]; a slot that is not a ballot is [`GroupError::Malformed`].
    pub fn gather(rank: usize, world: usize, words: &[u64]) -> Result<Vec<Ballot>, GroupError> {
        if words.len() != world * Ballot::WORDS {
            return Err(GroupError::BallotCount {
                rank,
                got: words.len().div_ceil(Ballot::WORDS),
                world,
            });
        }
        words
            .chunks_exact(Ballot::WORDS)
            .enumerate()
            .map(|(from, slot)| {
                let w = [slot[0], slot[1], slot[2]];
                Ballot::from_words(w).ok_or(GroupError::Malformed {
                    rank,
                    from,
                    word: w[0],
                })
            })
            .collect()
    }
}

/// What carries a round's ballots between the ranks of a group: one rank's end of it.
///
/// Every rank calls [`BallotBox::exchange`] once per recording, in the same order; each gets
/// every rank's ballot, in rank order, the same on every rank. Implementations: the in-process
/// box of [`Member::group`](crate::Member::group), graft-launch's `TcpBallotBox` for
/// ranks that are processes, and graft-cuda's NCCL box.
///
/// A transport must bound every wait by the timeout it is given and report what went wrong
/// as a [`GroupError`]: [`GroupError::Timeout`] when it knows which ranks never voted,
/// [`GroupError::Unanswered`] when it cannot tell, [`GroupError::PeerLost`] for a connection
/// that closed, [`GroupError::Device`] for a device that failed, and
/// [`GroupError::Broken`] when another rank already broke the group. Any of these breaks the
/// group for good: the [`Member`](crate::Member) above it fails every later recording at once,
/// without calling the transport again.
pub trait BallotBox: Send + Sync + fmt::Debug {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// Casts `ballot` and returns the round's ballots, one per rank in rank order, waiting at
    /// most about `timeout` for the others.
    fn exchange(&self, ballot: Ballot, timeout: Duration) -> Result<Vec<Ballot>, GroupError>;

    /// Casts `ballot` for a rank that leaves the round without acting on it (its body
    /// panicked while recording), so that its peers learn the outcome without waiting for a
    /// timeout. By default an exchange whose ballots are dropped: the peers are at the same
    /// recording, so the wait is short. A transport that can cast without waiting does so.
    fn leave(&self, ballot: Ballot, timeout: Duration) -> Result<(), GroupError> {
        self.exchange(ballot, timeout).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ballot(vote: Vote, function: usize, shape: u64) -> Ballot {
        Ballot {
            vote,
            subject: (function, shape),
        }
    }

    #[test]
    fn ballots_round_trip_through_words() {
        for vote in [Vote::Recorded, Vote::FellBack, Vote::Failed] {
            let b = ballot(vote, 7, u64::MAX);
            assert_eq!(Ballot::from_words(b.to_words()), Some(b));
        }
        assert_eq!(Ballot::from_words([0, 1, 2]), None, "an empty slot");
        assert_eq!(Ballot::from_words([4, 1, 2]), None, "no such vote");
    }

    #[test]
    fn summed_slots_gather_every_ranks_ballot() {
        let ballots = [
            ballot(Vote::Recorded, 1, 9),
            ballot(Vote::Failed, 1, 9),
            ballot(Vote::FellBack, 2, 3),
        ];
        let mut sum = vec![0u64; 9];
        for (rank, b) in ballots.iter().enumerate() {
            for (s, w) in sum.iter_mut().zip(b.slot_words(rank, 3)) {
                *s += w;
            }
        }
        assert_eq!(Ballot::gather(0, 3, &sum), Ok(ballots.to_vec()));
    }

    #[test]
    fn an_empty_slot_is_malformed_and_names_its_rank() {
        let words = ballot(Vote::Recorded, 0, 0).slot_words(0, 2);
        assert_eq!(
            Ballot::gather(1, 2, &words),
            Err(GroupError::Malformed {
                rank: 1,
                from: 1,
                word: 0
            })
        );
        assert_eq!(
            Ballot::gather(1, 3, &words),
            Err(GroupError::BallotCount {
                rank: 1,
                got: 2,
                world: 3
            })
        );
    }
}
