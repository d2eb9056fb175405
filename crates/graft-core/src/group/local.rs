//! `LocalBallotBox`: the ballot box of ranks that are threads of one process, a mutex and a
//! condition variable shared by the group.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{Ballot, BallotBox, GroupError};

/// The state of the current round.
#[derive(Debug)]
struct Round {
    /// Rounds completed so far.
    generation: u64,
    /// This round's ballots, by rank.
    ballots: Vec<Option<Ballot>>,
    /// The ballots of the last completed round, read by its waiters.
    result: Vec<Ballot>,
    /// Set when a wait timed out: that rank's error. Every wait and later round fails.
    aborted: Option<GroupError>,
}

#[derive(Debug)]
struct Shared {
    round: Mutex<Round>,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A round is consistent after every statement: a panic elsewhere cannot leave it torn.
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One rank's end of an in-process group's ballot box.
#[derive(Debug)]
pub(super) struct LocalBallotBox {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl LocalBallotBox {
    /// The boxes of a new group of `world` ranks (at least one), in rank order.
    pub(super) fn group(world: usize) -> Vec<LocalBallotBox> {
        let shared = Arc::new(Shared {
            round: Mutex::new(Round {
                generation: 0,
                ballots: vec![None; world],
                result: Vec::new(),
                aborted: None,
            }),
            done: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalBallotBox {
                rank,
                world,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Records this rank's ballot; when it is the last, completes the round and returns its
    /// ballots.
    fn cast(&self, round: &mut Round, ballot: Ballot) -> Option<Vec<Ballot>> {
        round.ballots[self.rank] = Some(ballot);
        if round.ballots.iter().any(Option::is_none) {
            return None;
        }
        round.result = round.ballots.iter_mut().filter_map(Option::take).collect();
        round.generation += 1;
        self.shared.done.notify_all();
        Some(round.result.clone())
    }

    fn broken(&self, cause: &GroupError) -> GroupError {
        GroupError::Broken {
            rank: self.rank,
            cause: Box::new(cause.clone()),
        }
    }
}

impl BallotBox for LocalBallotBox {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn exchange(&self, ballot: Ballot, timeout: Duration) -> Result<Vec<Ballot>, GroupError> {
        let shared = &*self.shared;
        let mut round = shared.lock();
        if let Some(cause) = &round.aborted {
            return Err(self.broken(cause));
        }
        if let Some(ballots) = self.cast(&mut round, ballot) {
            return Ok(ballots);
        }
        let generation = round.generation;
        let start = Instant::now();
        let (mut round, _) = shared
            .done
            .wait_timeout_while(round, timeout, |r| {
                r.generation == generation && r.aborted.is_none()
            })
            .unwrap_or_else(PoisonError::into_inner);
        if round.generation != generation {
            // The round completed; no later one can complete before this rank votes again.
            return Ok(round.result.clone());
        }
        if let Some(cause) = &round.aborted {
            return Err(self.broken(cause));
        }
        let missing = (0..self.world)
            .filter(|&r| round.ballots[r].is_none())
            .collect();
        let timed_out = GroupError::Timeout {
            rank: self.rank,
            waited: start.elapsed(),
            missing,
        };
        round.aborted = Some(timed_out.clone());
        shared.done.notify_all();
        Err(timed_out)
    }

    /// Casts without waiting: the round completes when the others have voted.
    fn leave(&self, ballot: Ballot, _timeout: Duration) -> Result<(), GroupError> {
        let mut round = self.shared.lock();
        if let Some(cause) = &round.aborted {
            return Err(self.broken(cause));
        }
        let _ = self.cast(&mut round, ballot);
        Ok(())
    }
}
