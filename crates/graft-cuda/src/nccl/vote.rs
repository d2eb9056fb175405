//! [`NcclBallotBox`]: a group's votes carried by NCCL itself. A vote is an all-gather of the
//! ballots done as a sum all-reduce of `world * 3` words (each rank writes its ballot at its
//! slot, zeros elsewhere), enqueued on the device's runtime stream between captures, then
//! polled (an event query and the communicator's asynchronous state) until it completes or
//! the deadline passes, when the communicator is aborted.

use std::ffi::c_void;
use std::fmt;
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys;
use graft_core::{Ballot, BallotBox, DeviceError, GroupError};

use super::NcclComm;
use super::status::OP;
use crate::driver;
use crate::driver::nccl as dn;
use crate::driver::stream::CAPTURE_NONE;

const WORD: usize = std::mem::size_of::<u64>();

/// The longest sleep between two polls of a vote.
const MAX_POLL: Duration = Duration::from_millis(1);

/// One rank's ballot box over its NCCL communicator (see the module docs). The communicator
/// is shared with the rank's data all-reduces: one stream keeps all of its operations in one
/// order. A vote that times out, or that NCCL reports failed (a peer's failure shows as
/// `ncclRemoteError`), aborts the communicator: the group and the communicator are then both
/// done, and the job must make new ones (new processes and communicators).
pub struct NcclBallotBox {
    comm: Arc<NcclComm>,
    buffers: Mutex<Buffers>,
}

/// The vote's memory: `words` device words, twice as many pinned host words (what this rank
/// sends, then what it receives), and the event that marks the vote's completion on the
/// stream. Null until made; released by `NcclBallotBox`'s `Drop`.
struct Buffers {
    words: usize,
    device: cu::CUdeviceptr,
    host: *mut u64,
    done: cu::CUevent,
    /// Whether a vote's copies may still run (then its memory must not be reused or freed).
    flight: Flight,
}

/// What may still run on the vote's memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flight {
    /// Nothing: the last vote completed.
    Idle,
    /// Copies were enqueued, and the event that marks their end was not recorded.
    Unmarked,
    /// Copies were enqueued, and the event marks their end.
    Marked,
}

// SAFETY: the raw pointers are device memory, pinned host memory and an event of the
// communicator's device, which the driver lets any thread use once the context is current
// (every use makes it current first); they are reached only through the mutex, and released
// once, in `Drop`.
unsafe impl Send for NcclBallotBox {}
// SAFETY: as for `Send`: shared references reach the buffers only through the mutex.
unsafe impl Sync for NcclBallotBox {}

impl fmt::Debug for NcclBallotBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBallotBox")
            .field("comm", &self.comm)
            .finish_non_exhaustive()
    }
}

impl NcclBallotBox {
    /// The ballot box of `comm`'s rank, with its vote's memory made on `comm`'s device.
    pub fn new(comm: Arc<NcclComm>) -> Result<NcclBallotBox, DeviceError> {
        let words = comm.world * Ballot::WORDS;
        let vote = NcclBallotBox {
            buffers: Mutex::new(Buffers {
                words,
                device: 0,
                host: ptr::null_mut(),
                done: ptr::null_mut(),
                flight: Flight::Idle,
            }),
            comm,
        };
        // From here on an early return drops `vote`, which releases what was made.
        let inner = &vote.comm.queue.inner;
        inner.make_current(OP)?;
        let mut b = vote.lock();
        b.device = inner.alloc_relaxed(OP, words * WORD)?;
        // Freed once, in `Drop`.
        b.host = driver::memory::alloc_host(OP, 2 * words * WORD)?.cast();
        // Destroyed once, in `Drop`.
        b.done = driver::stream::create_event(OP)?;
        drop(b);
        Ok(vote)
    }

    fn lock(&self) -> MutexGuard<'_, Buffers> {
        // Every field is written whole; `flight` leaves `Idle` before copies are enqueued and
        // returns to it only once they completed, so a panic cannot leave it claiming less.
        self.buffers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The vote's device work: this rank's slot words up, the sum all-reduce, the result
    /// down, and the completion event. Marks the buffers in flight before anything is
    /// enqueued.
    fn enqueue(
        &self,
        b: &mut Buffers,
        ballot: Ballot,
        start: Instant,
        deadline: Instant,
    ) -> Result<(), DeviceError> {
        let inner = &self.comm.queue.inner;
        inner.make_current(OP)?;
        if inner.capture_status(OP)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op: OP,
                state: "the runtime stream is capturing, and a vote must run between captures",
            });
        }
        let words = b.words;
        // SAFETY: `host` holds `2 * words` pinned words (allocated in `new`), page-aligned;
        // no copy is in flight (`flight` is idle: the last vote completed), and the mutex
        // gives this thread the only access.
        let host = unsafe { std::slice::from_raw_parts_mut(b.host, 2 * words) };
        host[..words].copy_from_slice(&ballot.slot_words(self.comm.rank, self.comm.world));
        let stream = inner.stream;
        b.flight = Flight::Unmarked;
        // SAFETY: the first `words` pinned words stay untouched until the vote completes
        // (`flight`, cleared only once the event recorded after the copies completed);
        // `device` holds `words` words; the stream is the live runtime stream.
        unsafe {
            driver::memory::copy_htod_async(
                OP,
                b.device,
                b.host.cast::<c_void>(),
                words * WORD,
                stream,
            )
        }?;
        let at = b.device;
        self.comm.enqueue(|comm| {
            // `at` is `words` u64s of this device's memory, kept until `Drop`; the stream is the
            // device's runtime stream (not capturing: checked above); the handle is live and
            // used by this thread alone (`enqueue`).
            dn::all_reduce_sum(comm, at, words, sys::ncclDataType_t::ncclUint64, stream)
        })?;
        self.comm.settle_or_abort(start, deadline)?;
        // SAFETY: the second `words` pinned words (inside the `2 * words` allocated in `new`)
        // receive the sum; they are read only once the event below has completed.
        unsafe {
            driver::memory::copy_dtoh_async(
                OP,
                b.host.add(words).cast::<c_void>(),
                b.device,
                words * WORD,
                stream,
            )
        }?;
        driver::stream::record_event(OP, b.done, stream)?;
        b.flight = Flight::Marked;
        Ok(())
    }

    /// Polls the vote until its event completes: the communicator's errors and the deadline
    /// end the wait (and abort the communicator).
    fn wait(&self, b: &mut Buffers, start: Instant, deadline: Instant) -> Result<(), GroupError> {
        let rank = self.comm.rank;
        let failed = |source| {
            self.comm.abort_after_failure();
            GroupError::Device { rank, source }
        };
        let mut pause = Duration::from_micros(10);
        loop {
            // The event is live (made in `new`, destroyed in `Drop`).
            match driver::stream::query_event(OP, b.done) {
                Ok(true) => {
                    b.flight = Flight::Idle;
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => return Err(failed(e)),
            }
            match self.comm.async_state() {
                Ok(sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {}
                Ok(state) => {
                    let e = dn::check(state).err();
                    return Err(failed(
                        e.unwrap_or(DeviceError::CollectiveAborted { op: OP }),
                    ));
                }
                Err(e) => return Err(failed(e)),
            }
            if Instant::now() >= deadline {
                self.comm.abort_after_failure();
                return Err(GroupError::Unanswered {
                    rank,
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_POLL);
        }
    }
}

impl BallotBox for NcclBallotBox {
    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world(&self) -> usize {
        self.comm.world
    }

    fn exchange(&self, ballot: Ballot, timeout: Duration) -> Result<Vec<Ballot>, GroupError> {
        let _span = tracing::debug_span!("nccl_vote", rank = self.comm.rank).entered();
        let (rank, world) = (self.comm.rank, self.comm.world);
        let start = Instant::now();
        let deadline = start + timeout;
        let mut b = self.lock();
        if b.flight != Flight::Idle {
            // An earlier vote never completed: the communicator was aborted then.
            return Err(GroupError::Device {
                rank,
                source: DeviceError::CollectiveAborted { op: OP },
            });
        }
        if let Err(source) = self.enqueue(&mut b, ballot, start, deadline) {
            // No peer may wait on a vote this rank could not enqueue (aborting twice is
            // nothing).
            self.comm.abort_after_failure();
            return Err(GroupError::Device { rank, source });
        }
        self.wait(&mut b, start, deadline)?;
        let words = b.words;
        // SAFETY: the vote completed (its event did), so the copy into the second `words`
        // pinned words finished; the mutex gives this thread the only access.
        let sum = unsafe { std::slice::from_raw_parts(b.host.add(words), words) };
        tracing::debug!(waited = ?start.elapsed(), "voted over NCCL");
        Ballot::gather(rank, world, sum)
    }
}

impl Drop for NcclBallotBox {
    /// Releases the vote's memory and event. If the last vote never completed (it timed out
    /// or failed, and the communicator was aborted) and its copies may still run, the memory
    /// is kept (leaked, a few words) rather than freed under them.
    fn drop(&mut self) {
        let inner = self.comm.queue.inner.clone();
        let b = self
            .buffers
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = inner.make_current(OP) {
            inner.record_sticky(e);
            return;
        }
        let done = match b.flight {
            Flight::Idle => true,
            Flight::Unmarked => false,
            // The event is live (made in `new`) and was recorded after the copies.
            Flight::Marked => matches!(driver::stream::query_event(OP, b.done), Ok(true)),
        };
        if !done {
            tracing::warn!(
                rank = self.comm.rank,
                "the last vote's copies may still run: its few words of memory are kept, not freed"
            );
            return;
        }
        // Made in `new`, destroyed exactly once here (null: nothing).
        let mut first_error = driver::stream::destroy_event(OP, &mut b.done).err();
        if !b.host.is_null() {
            // Pinned memory from `cuMemAllocHost` in `new`, no copy in flight (`done` above),
            // freed exactly once here.
            let freed = driver::memory::free_host(OP, b.host.cast());
            first_error = first_error.or(freed.err());
        }
        if b.device != 0 {
            // Device memory from `cuMemAlloc` in `new`, no work in flight on it, freed exactly
            // once here.
            let freed = driver::memory::free(OP, b.device);
            first_error = first_error.or(freed.err());
        }
        if let Some(e) = first_error {
            inner.record_sticky(e);
        }
    }
}
