//! `NcclComm`: NCCL communicators over graft devices, with all-reduces enqueued on each
//! device's runtime stream, so that a body's collective is captured into its graph and
//! replayed with it (feature `nccl`; libnccl is loaded at run time like the rest of CUDA), and
//! `NcclBallotBox`, a group's votes carried by a tiny all-reduce on the same communicator.
//!
//! `init.rs` makes communicators (all ranks of a process at once, or one rank of a job of one
//! process per GPU, non-blocking with a bounded init); `all_reduce.rs` the data all-reduce,
//! which takes `one_shot/` (a kernel over NVLink peer memory) for small messages where every
//! rank's GPU reaches the others' memory, and `ncclAllReduce` otherwise; `gather.rs` the
//! exchange of a few words over the communicator (the votes, the one-shot path's setup);
//! `vote.rs` the ballot box; `status.rs` the bounded poll of a non-blocking communicator.
//! Every NCCL call goes through the floor (`driver::nccl`), which maps NCCL's results.

mod all_reduce;
mod gather;
mod init;
mod one_shot;
mod status;
mod vote;

use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::Duration;

use cudarc::nccl::sys;
use graft_core::{DeviceError, Member};
use graft_launch::{ProcessGroup, Rendezvous, Watchdog, WatchdogError};

use crate::device::CudaQueue;
use crate::driver::nccl::{self as dn, MISSING};
use one_shot::OneShot;
use status::OP;

pub use all_reduce::NcclDtype;
pub use init::UNIQUE_ID_BYTES;
pub use one_shot::one_shot_sum;
pub use vote::NcclBallotBox;

/// One rank's NCCL communicator, bound to one [`CudaDevice`](crate::CudaDevice) and its
/// runtime stream.
///
/// Made for all ranks of one process at once by [`NcclComm::init_all`], or for one rank of a
/// job of one process per GPU by [`NcclComm::init_rank`] (non-blocking: every wait on it is
/// bounded). Destroy it after the graphs that captured its collectives (drop the rank's
/// `Graft` first). NCCL allows one thread at a time per communicator, which a lock inside
/// guarantees.
///
/// All-reduces of up to [`NcclComm::one_shot_limit`] bytes (256 KiB by default) take a
/// one-shot kernel over peer memory instead of NCCL where every rank's GPU reaches every
/// other's memory (NVLink or PCIe peer access; the ranks agree on it when the communicator is
/// made, and a rank where it is off says why in an `info` log); larger ones, and all of them
/// elsewhere, take `ncclAllReduce`.
pub struct NcclComm {
    /// The handle; null once aborted.
    comm: Mutex<sys::ncclComm_t>,
    queue: CudaQueue,
    rank: usize,
    world: usize,
    /// For a non-blocking communicator, how long an operation may stay in progress before the
    /// communicator is aborted; `None` for a blocking one.
    deadline: Option<Duration>,
    /// The one-shot all-reduce; `None` where it is off (the same on every rank).
    one_shot: Option<OneShot>,
    /// Bytes up to which an all-reduce takes the one-shot path (0: never).
    one_shot_limit: AtomicUsize,
    /// Why the one-shot path is off, where it is (also logged once, `info`).
    one_shot_off: Option<String>,
}

// SAFETY: an `ncclComm_t` is a heap handle NCCL lets any thread use, one at a time; every use
// here goes through the mutex, and the handle is destroyed once (nulled under the mutex by an
// abort, or in `Drop`).
unsafe impl Send for NcclComm {}
// SAFETY: as for `Send`: shared references reach the handle only through the mutex.
unsafe impl Sync for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.queue.inner.id)
            .field("non_blocking", &self.deadline.is_some())
            .field("one_shot_limit", &self.one_shot_limit())
            .field("one_shot_off", &self.one_shot_off)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// The version of the loaded libnccl as (major, minor, patch).
    pub fn version() -> Result<(u32, u32, u32), DeviceError> {
        if !dn::present() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: MISSING,
            });
        }
        let v = u32::try_from(dn::version()?).unwrap_or(0);
        // NCCL_VERSION(X,Y,Z) is X*10000 + Y*100 + Z since 2.9.
        Ok((v / 10000, v / 100 % 100, v % 100))
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The largest all-reduce, in bytes, that takes the one-shot path over peer memory
    /// rather than NCCL: 256 KiB by default, 0 where the path is off (a GPU cannot reach a
    /// peer's memory, ranks on several hosts, more than 8 ranks, compute capability below 7.0)
    /// or turned off with [`NcclComm::set_one_shot_limit`].
    pub fn one_shot_limit(&self) -> usize {
        self.one_shot_limit.load(Ordering::Relaxed)
    }

    /// Sets the largest all-reduce, in bytes, that takes the one-shot path (0: NCCL always,
    /// for an A/B comparison), at most 256 KiB (the workspace's size); returns the limit now
    /// in force (0 where the path is off). Every rank must set the same limit at the same
    /// point of its sequence of all-reduces (between the same two calls): ranks whose limits
    /// differ would take different paths for one all-reduce and wait on each other forever
    /// (until the watchdog or a deadline aborts them). A graph keeps the path it captured.
    pub fn set_one_shot_limit(&self, bytes: usize) -> usize {
        let limit = one_shot::effective_limit(bytes, self.one_shot.is_some());
        self.one_shot_limit.store(limit, Ordering::Relaxed);
        limit
    }

    /// The handle, locked: null once aborted.
    fn lock(&self) -> MutexGuard<'_, sys::ncclComm_t> {
        // The guarded value is a plain pointer, replaced whole: never torn by a panic.
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Aborts the communicator (`ncclCommAbort`, which aborts its uncompleted operations, and
    /// makes its kernels return; and the one-shot path's abort word, which makes its kernels
    /// return too, their data undefined): every later operation on it fails with
    /// [`DeviceError::CollectiveAborted`]. Use it when a peer failed after collectives were
    /// enqueued, then make new communicators. Aborting twice does nothing.
    ///
    /// Bounded: NCCL's abort first tells its kernels and threads to quit (so collectives
    /// waiting on a lost peer return), then frees the communicator, which within a host can
    /// wait on the lost peer forever. The abort runs on a thread of its own; after 2 s this
    /// returns, and the communicator's resources are left to the
    /// process's exit.
    pub fn abort(&self) -> Result<(), DeviceError> {
        if let Some(shot) = &self.one_shot {
            shot.raise_abort();
        }
        let handle = std::mem::replace(&mut *self.lock(), ptr::null_mut());
        if handle.is_null() {
            return Ok(());
        }
        let handle = Taken(handle);
        let (done, finished) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("graft-nccl-abort".to_owned())
            .spawn(move || {
                let handle = handle;
                // The handle was live and is taken out of the lock (nulled there), so neither
                // another operation nor `Drop` uses it again.
                let _ = done.send(dn::abort(handle.0));
            });
        if spawned.is_err() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: "no thread could be started to abort the NCCL communicator; the system is out of threads or memory",
            });
        }
        match finished.recv_timeout(ABORT_WAIT) {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(
                    rank = self.rank,
                    waited = ?ABORT_WAIT,
                    "NCCL's abort told its kernels to quit but has not freed the communicator (it waits on a lost peer): its resources are left to the process's exit"
                );
                Ok(())
            }
        }
    }

    /// Starts this rank's [`Watchdog`] on its peers (every rank at the same point, over the
    /// job's rendezvous) with this communicator as what it aborts: a peer whose process ends,
    /// or that stays silent for `bound`, breaks `member`'s group and then aborts the
    /// communicator, so that collectives waiting on the peer (a vote, an eager all-reduce, a
    /// replay's recorded one) return. An error aborting is logged: the group is broken
    /// already.
    pub fn watchdog(
        self: &Arc<Self>,
        rendezvous: &mut Rendezvous,
        place: &ProcessGroup,
        join: Duration,
        bound: Duration,
        member: &Member,
    ) -> Result<Watchdog, WatchdogError> {
        let comm = self.clone();
        Watchdog::start(rendezvous, place, join, bound, member, move |_| {
            if let Err(error) = comm.abort() {
                tracing::warn!(%error, "aborting the NCCL communicator after a loss failed");
            }
        })
    }

    /// Aborts after a failure that is being returned: an error aborting cannot be returned
    /// too, so it goes to the device's sticky slot and the next graft call returns it.
    fn abort_after_failure(&self) {
        if let Err(e) = self.abort() {
            self.queue.inner.record_sticky(e);
        }
    }
}

/// How long [`NcclComm::abort`] waits for NCCL's abort to return.
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// A communicator handle taken out of its `NcclComm`, sent to the thread that aborts it.
struct Taken(sys::ncclComm_t);

// SAFETY: the handle was taken out of its communicator's lock, so the aborting thread is its
// only user; NCCL lets any thread abort a communicator.
unsafe impl Send for Taken {}

impl Drop for NcclComm {
    /// Releases the one-shot path's memory (see `OneShot::release`: after the stream ran its
    /// kernels, bounded), then destroys the communicator. A non-blocking one is finalized
    /// first (its operations flushed), at most for its deadline; past that (a peer is gone)
    /// it is aborted instead, so that dropping never hangs.
    fn drop(&mut self) {
        if let Some(shot) = self.one_shot.take() {
            shot.release(self);
        }
        if self.lock().is_null() {
            return;
        }
        if let Some(limit) = self.deadline
            && !self.finalize(limit)
        {
            self.abort_after_failure();
            return;
        }
        let comm = std::mem::replace(&mut *self.lock(), ptr::null_mut());
        // The handle was live (not aborted) and is taken out of the lock: this is its only
        // destruction.
        self.queue.inner.sticky_on_error(dn::destroy(comm));
    }
}

impl NcclComm {
    /// Finalizes a non-blocking communicator (`ncclCommFinalize`, then polls until done):
    /// whether it finished within `limit`.
    fn finalize(&self, limit: Duration) -> bool {
        let started = {
            let comm = self.lock();
            // The handle is live (checked non-null by the caller, and only `Drop`, which holds
            // `&mut self`, runs) and used by this thread alone under the lock.
            dn::finalize(*comm)
        };
        started.is_ok() && self.settle(std::time::Instant::now() + limit).is_ok()
    }
}
