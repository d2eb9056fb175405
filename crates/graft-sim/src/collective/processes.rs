//! The meeting of an all-reduce whose ranks are processes: every rank's part through the
//! job's TCP rendezvous (an all-gather through rank 0, which decides whether every part
//! arrived in time), summed in rank order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use graft_core::DeviceError;
use graft_launch::{ExchangeError, Rendezvous};

use super::OP;

/// The all-gather tag of an all-reduce's parts, so that one meeting a vote is out of step.
const SUM_TAG: u32 = 0x7375_6d73;

/// One process's link to its job's all-reduces.
pub(super) struct Link {
    rendezvous: Arc<Mutex<Rendezvous>>,
    timeout: Duration,
    rank: usize,
    world: usize,
    /// Set by an abort or a failed collective: every later one fails.
    aborted: AtomicBool,
}

impl Link {
    pub(super) fn new(rendezvous: Arc<Mutex<Rendezvous>>, timeout: Duration) -> Link {
        let (rank, world) = {
            let rv = rendezvous.lock().unwrap_or_else(PoisonError::into_inner);
            (rv.rank(), rv.world())
        };
        Link {
            rendezvous,
            timeout,
            rank,
            world,
            aborted: AtomicBool::new(false),
        }
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    pub(super) fn world(&self) -> usize {
        self.world
    }

    pub(super) fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }

    /// This rank's `part` summed with every other rank's, in rank order.
    pub(super) fn all_reduce(&self, part: Vec<f32>) -> Result<Arc<[f32]>, DeviceError> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(DeviceError::CollectiveAborted { op: OP });
        }
        let bytes: Vec<u8> = part.iter().flat_map(|v| v.to_le_bytes()).collect();
        let gathered = self
            .rendezvous
            .lock()
            // An exchange that panicked failed the rendezvous, which then refuses the next.
            .unwrap_or_else(PoisonError::into_inner)
            .all_gather(SUM_TAG, &bytes, self.timeout)
            .map_err(|e| {
                self.abort();
                device_error(e)
            })?;
        let mut parts = gathered.chunks_exact(bytes.len().max(1)).map(|p| {
            p.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        });
        let mut sum: Vec<f32> = parts.next().map(Iterator::collect).unwrap_or_default();
        for p in parts {
            sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
        }
        Ok(sum.into())
    }
}

/// The device error of a failed exchange of parts, as the threads' meeting reports its own.
fn device_error(e: ExchangeError) -> DeviceError {
    match e {
        ExchangeError::Timeout {
            rank,
            waited,
            missing,
        } => DeviceError::CollectiveTimeout {
            op: OP,
            rank,
            waited,
            missing,
        },
        ExchangeError::NoReply { rank, waited } => DeviceError::CollectiveUnanswered {
            op: OP,
            rank,
            waited,
        },
        ExchangeError::Lost { rank, peer, .. } => {
            DeviceError::CollectivePeerLost { op: OP, rank, peer }
        }
        ExchangeError::OutOfStep { .. } => DeviceError::InvalidArgument {
            op: OP,
            what: "the ranks' collectives are out of step (all-reduces of different lengths, or one where another rank votes)",
        },
        ExchangeError::Aborted { cause, .. } => device_error(*cause),
        ExchangeError::Failed { .. } => DeviceError::CollectiveAborted { op: OP },
    }
}

#[cfg(test)]
mod tests {
    use super::super::SimComm;
    use super::*;
    use crate::SimDevice;
    use graft_core::{Config, Graft};
    use graft_launch::ProcessGroup;

    /// Runs `f(comm, graft)` on two ranks (threads) of a job over loopback.
    fn two_ranks<T: Send>(
        timeout: Duration,
        f: impl Fn(&SimComm, &mut Graft<SimDevice>) -> T + Sync,
    ) -> Vec<T> {
        let port = graft_launch::free_port().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let place = ProcessGroup::new(rank, 2, rank, "127.0.0.1", port).unwrap();
                        let rv = Rendezvous::join(&place, Duration::from_secs(10)).unwrap();
                        let device = SimDevice::new();
                        let comm =
                            SimComm::over_rendezvous(&device, Arc::new(Mutex::new(rv)), timeout);
                        let mut g = Graft::new(device, Config::default());
                        f(&comm, &mut g)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn processes_get_the_sum_in_rank_order() {
        let sums = two_ranks(Duration::from_secs(10), |c, g| {
            let b = g.alloc(8).unwrap();
            g.write_f32(&b, &[1.0 + c.rank() as f32, 0.5]).unwrap();
            c.all_reduce_sum_f32(&b, 2).unwrap();
            g.read_f32(&b).unwrap()
        });
        assert_eq!(sums, vec![vec![3.0, 1.0]; 2]);
    }

    #[test]
    fn a_rank_that_never_comes_times_out_and_aborts() {
        let errs = two_ranks(Duration::from_millis(200), |c, g| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(1));
                return None;
            }
            let b = g.alloc(4).unwrap();
            let first = c.all_reduce_sum_f32(&b, 1).unwrap_err();
            Some((first, c.all_reduce_sum_f32(&b, 1).unwrap_err()))
        });
        let (first, then) = errs[0].clone().unwrap();
        assert!(
            matches!(&first, DeviceError::CollectiveTimeout { rank: 0, missing, .. } if missing == &[1]),
            "{first}"
        );
        assert_eq!(then, DeviceError::CollectiveAborted { op: OP });
    }
}
