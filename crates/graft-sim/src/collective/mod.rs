//! `SimComm`: an all-reduce among simulated devices, NCCL's stand-in in CI.
//!
//! Each rank's all-reduce is a kernel on its device's stream (recorded when capturing, like
//! NCCL's kernels), which meets the other ranks' kernels of the same collective: at a
//! host-side rendezvous for ranks that are threads of one process (`threads.rs`), or through
//! the job's TCP rendezvous for ranks that are processes (`processes.rs`). Sums are taken in
//! rank order, so every rank gets the same bits either way. Where NCCL would hang (a rank
//! never joins), the meeting times out, fails the collective with a typed error and aborts
//! the communicator, so tests can show that no rank ever waits for a collective its peers
//! skipped.

mod processes;
mod threads;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use graft_core::{Buffer, DeviceError, DeviceOp, DevicePtr};
use graft_launch::Rendezvous;

use crate::device::SimDevice;
use crate::queue::SimQueue;

const OP: DeviceOp = DeviceOp::Collective;

/// Where a collective's ranks meet.
#[derive(Clone)]
enum Meeting {
    /// Threads of this process.
    Threads(Arc<threads::Shared>),
    /// Processes of a job, through its rendezvous.
    Processes(Arc<processes::Link>),
}

/// One rank's communicator of a group of simulated devices (see the module docs).
#[derive(Clone)]
pub struct SimComm {
    rank: usize,
    world: usize,
    queue: SimQueue,
    meeting: Meeting,
}

impl fmt::Debug for SimComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field(
                "across",
                &match self.meeting {
                    Meeting::Threads(_) => "threads",
                    Meeting::Processes(_) => "processes",
                },
            )
            .finish_non_exhaustive()
    }
}

impl SimComm {
    /// One communicator per device, rank `i` on `devices[i]`, all in this process. A
    /// collective waits at most `timeout` for the other ranks, then fails and aborts the
    /// communicators.
    pub fn group(devices: &[SimDevice], timeout: Duration) -> Vec<SimComm> {
        let shared = Arc::new(threads::Shared::new(devices.len(), timeout));
        devices
            .iter()
            .enumerate()
            .map(|(rank, d)| SimComm {
                rank,
                world: devices.len(),
                queue: (**d).clone(),
                meeting: Meeting::Threads(shared.clone()),
            })
            .collect()
    }

    /// This process's communicator of a job of one process per rank, on `device`, meeting the
    /// other ranks through the job's `rendezvous` (which a
    /// [`TcpBallotBox`](graft_launch::TcpBallotBox) may share: the ranks then make their votes
    /// and collectives in the same order, as they make the same calls). A collective waits
    /// about `timeout` for the others, then fails and aborts this communicator.
    pub fn over_rendezvous(
        device: &SimDevice,
        rendezvous: Arc<Mutex<Rendezvous>>,
        timeout: Duration,
    ) -> SimComm {
        let link = processes::Link::new(rendezvous, timeout);
        SimComm {
            rank: link.rank(),
            world: link.world(),
            queue: (**device).clone(),
            meeting: Meeting::Processes(Arc::new(link)),
        }
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Aborts the communicator (every communicator of an in-process group): every waiting and
    /// later collective fails.
    pub fn abort(&self) {
        match &self.meeting {
            Meeting::Threads(shared) => shared.abort(),
            Meeting::Processes(link) => link.abort(),
        }
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
        let (rank, meeting) = (self.rank, self.meeting.clone());
        self.queue.launch_kernel("all_reduce_sum_f32", move |m| {
            let part = m.f32s(at, n)?;
            let sum = match &meeting {
                Meeting::Threads(shared) => shared.all_reduce(rank, part)?,
                Meeting::Processes(link) => link.all_reduce(part)?,
            };
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
