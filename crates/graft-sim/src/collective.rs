//! `SimComm`: an in-process all-reduce among simulated devices, NCCL's stand-in in CI.
//!
//! Each rank's all-reduce is a kernel on its device's stream (recorded when capturing, like
//! NCCL's kernels), which meets the other ranks' kernels of the same collective at a host-side
//! rendezvous. Sums are taken in rank order, so every rank gets the same bits. Where NCCL
//! would hang (a rank never joins), the rendezvous times out, fails the collective with
//! [`DeviceError::CollectiveTimeout`] and aborts the communicator, so tests can show that no
//! rank ever waits for a collective its peers skipped.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use graft_core::{Buffer, DeviceError, DeviceOp, DevicePtr};

use crate::device::{SimDevice, SimQueue};

const OP: DeviceOp = DeviceOp::Collective;

/// The current collective: each rank's contribution, then the sum.
struct Round {
    /// Collectives completed.
    generation: u64,
    parts: Vec<Option<Vec<f32>>>,
    /// The last completed collective's sum, read by its waiters.
    sum: Arc<[f32]>,
    aborted: bool,
}

struct Shared {
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
    fn all_reduce(&self, rank: usize, part: Vec<f32>) -> Result<Arc<[f32]>, DeviceError> {
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
}

/// One rank's communicator of a group of simulated devices (see the module docs).
#[derive(Clone)]
pub struct SimComm {
    rank: usize,
    world: usize,
    queue: SimQueue,
    shared: Arc<Shared>,
}

impl fmt::Debug for SimComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl SimComm {
    /// One communicator per device, rank `i` on `devices[i]`. A collective waits at most
    /// `timeout` for the other ranks, then fails and aborts the communicators.
    pub fn group(devices: &[SimDevice], timeout: Duration) -> Vec<SimComm> {
        let shared = Arc::new(Shared {
            timeout,
            round: Mutex::new(Round {
                generation: 0,
                parts: vec![None; devices.len()],
                sum: Arc::from([]),
                aborted: false,
            }),
            done: Condvar::new(),
        });
        devices
            .iter()
            .enumerate()
            .map(|(rank, d)| SimComm {
                rank,
                world: devices.len(),
                queue: (**d).clone(),
                shared: shared.clone(),
            })
            .collect()
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Aborts the communicators of the group: every waiting and later collective fails.
    pub fn abort(&self) {
        self.shared.lock().aborted = true;
        self.shared.done.notify_all();
    }

    /// Enqueues an in-place all-reduce (sum) of the first `n` `f32`s of `buffer` on this
    /// rank's stream (recorded when capturing). The buffer is checked as a kernel argument.
    pub fn all_reduce_sum_f32(&self, buffer: &Buffer, n: usize) -> Result<(), DeviceError> {
        let bytes = n.checked_mul(4).ok_or(DeviceError::InvalidArgument {
            op: OP,
            what: "the element count overflows",
        })?;
        let at: DevicePtr = self.queue.buffer_addr(buffer, 0, bytes)?;
        // NCCL's graph nodes include event nodes, which conditional bodies cannot hold.
        self.queue
            .refuse_in_conditional(OP, graft_core::ConditionalRule::Collective)?;
        let (rank, shared) = (self.rank, self.shared.clone());
        self.queue.launch_kernel("all_reduce_sum_f32", move |m| {
            let part = m.f32s(at, n)?;
            let sum = shared.all_reduce(rank, part)?;
            m.write_f32(at, &sum)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graft_core::{Config, Graft};

    fn group(timeout: Duration) -> (Vec<Graft<SimDevice>>, Vec<SimComm>) {
        let devices = [SimDevice::new(), SimDevice::new()];
        let comms = SimComm::group(&devices, timeout);
        let grafts = devices
            .into_iter()
            .map(|d| Graft::new(d, Config::default()))
            .collect();
        (grafts, comms)
    }

    #[test]
    fn ranks_get_the_sum_in_rank_order() {
        let (mut grafts, comms) = group(Duration::from_secs(10));
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = grafts
                .iter_mut()
                .zip(&comms)
                .map(|(g, c)| {
                    s.spawn(move || {
                        let b = g.alloc(8).unwrap();
                        g.write_f32(&b, &[1.0 + c.rank() as f32, 0.5]).unwrap();
                        c.all_reduce_sum_f32(&b, 2).unwrap();
                        g.read_f32(&b).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![vec![3.0, 1.0]; 2]);
    }

    #[test]
    fn a_rank_that_never_joins_times_out_and_aborts() {
        let (mut grafts, comms) = group(Duration::from_millis(50));
        let b = grafts[0].alloc(4).unwrap();
        let err = comms[0].all_reduce_sum_f32(&b, 1).unwrap_err();
        assert!(
            matches!(&err, DeviceError::CollectiveTimeout { rank: 0, missing, .. } if missing == &[1]),
            "{err}"
        );
        let b1 = grafts[1].alloc(4).unwrap();
        assert_eq!(
            comms[1].all_reduce_sum_f32(&b1, 1),
            Err(DeviceError::CollectiveAborted { op: OP })
        );
    }
}
