//! The meeting of an in-process group's all-reduce: each rank's contribution at a host-side
//! rendezvous (a mutex and a condition variable), summed in rank order. Where NCCL would hang
//! (a rank never joins), it times out with [`DeviceError::CollectiveTimeout`] and aborts the
//! group's communicators.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use graft_core::DeviceError;

use super::OP;

/// The current collective: each rank's contribution, then the sum.
struct Round {
    /// Collectives completed.
    generation: u64,
    parts: Vec<Option<Vec<f32>>>,
    /// The last completed collective's sum, read by its waiters.
    sum: Arc<[f32]>,
    aborted: bool,
}

pub(super) struct Shared {
    timeout: Duration,
    round: Mutex<Round>,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A round is consistent after every statement.
        self.round.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `part` as `rank`'s contribution and waits for the sum.
    pub(super) fn all_reduce(
        &self,
        rank: usize,
        part: Vec<f32>,
    ) -> Result<Arc<[f32]>, DeviceError> {
        let mut round = self.lock();
        if round.aborted {
            return Err(DeviceError::CollectiveAborted { op: OP });
        }
        if let Some(other) = round.parts.iter().flatten().next()
            && other.len() != part.len()
        {
            round.aborted = true;
            self.done.notify_all();
            return Err(DeviceError::InvalidArgument {
                op: OP,
                what: "ranks passed all-reduces of different lengths",
            });
        }
        round.parts[rank] = Some(part);
        if round.parts.iter().all(Option::is_some) {
            let mut parts = round.parts.iter_mut().map(|p| p.take().unwrap_or_default());
            let mut sum = parts.next().unwrap_or_default();
            for p in parts {
                sum.iter_mut().zip(&p).for_each(|(s, v)| *s += v);
            }
            round.sum = sum.into();
            round.generation += 1;
            self.done.notify_all();
            return Ok(round.sum.clone());
        }
        let generation = round.generation;
        let start = Instant::now();
        let (mut round, _) = self
            .done
            .wait_timeout_while(round, self.timeout, |r| {
                r.generation == generation && !r.aborted
            })
            .unwrap_or_else(PoisonError::into_inner);
        if round.generation != generation {
            return Ok(round.sum.clone());
        }
        let missing = (0..round.parts.len())
            .filter(|&r| round.parts[r].is_none())
            .collect();
        if round.aborted {
            return Err(DeviceError::CollectiveAborted { op: OP });
        }
        round.aborted = true;
        self.done.notify_all();
        Err(DeviceError::CollectiveTimeout {
            op: OP,
            rank,
            waited: start.elapsed(),
            missing,
        })
    }

    /// The meeting of a new group of `world` ranks, whose collectives wait at most `timeout`.
    pub(super) fn new(world: usize, timeout: Duration) -> Shared {
        Shared {
            timeout,
            round: Mutex::new(Round {
                generation: 0,
                parts: vec![None; world],
                sum: Arc::from([]),
                aborted: false,
            }),
            done: Condvar::new(),
        }
    }

    /// Aborts the group: every waiting and later collective fails.
    pub(super) fn abort(&self) {
        self.lock().aborted = true;
        self.done.notify_all();
    }
}
