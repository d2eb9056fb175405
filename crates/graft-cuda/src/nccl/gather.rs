//! [`Gather`]: every rank's words on every rank, carried by the communicator itself: a sum
//! all-reduce of `words` u64s in which each rank writes its part at its slot and zeros
//! elsewhere, enqueued on the device's runtime stream between captures, then polled (an event
//! query and the communicator's asynchronous state) until it completes or the deadline
//! passes, when the communicator is aborted. The ballot box's votes and the one-shot
//! all-reduce's setup (its IPC handles) travel so.

use std::ffi::c_void;
use std::ptr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys;
use graft_core::{DeviceError, GroupError};

use super::NcclComm;
use super::status::OP;
use crate::device::CudaQueue;
use crate::driver;
use crate::driver::nccl as dn;
use crate::driver::stream::CAPTURE_NONE;

const WORD: usize = std::mem::size_of::<u64>();

/// The longest sleep between two polls of an exchange.
const MAX_POLL: Duration = Duration::from_millis(1);

/// The memory of one communicator's exchanges (see the module docs).
pub(super) struct Gather {
    /// The communicator's device, for `Drop`.
    queue: CudaQueue,
    buffers: Mutex<Buffers>,
}

/// `words` device words, twice as many pinned host words (what this rank sends, then what it
/// receives), and the event that marks an exchange's completion on the stream. Null until
/// made; released by `Gather`'s `Drop`.
struct Buffers {
    words: usize,
    device: cu::CUdeviceptr,
    host: *mut u64,
    done: cu::CUevent,
    /// Whether an exchange's copies may still run (then its memory must not be reused or
    /// freed).
    flight: Flight,
}

/// What may still run on the exchange's memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flight {
    /// Nothing: the last exchange completed.
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
unsafe impl Send for Gather {}
// SAFETY: as for `Send`: shared references reach the buffers only through the mutex.
unsafe impl Sync for Gather {}

impl Gather {
    /// The memory for exchanges of `words` u64s (all ranks' parts together) on `comm`'s
    /// device.
    pub(super) fn new(comm: &NcclComm, words: usize) -> Result<Gather, DeviceError> {
        let gather = Gather {
            queue: comm.queue.clone(),
            buffers: Mutex::new(Buffers {
                words,
                device: 0,
                host: ptr::null_mut(),
                done: ptr::null_mut(),
                flight: Flight::Idle,
            }),
        };
        // From here on an early return drops `gather`, which releases what was made.
        let inner = &gather.queue.inner;
        inner.make_current(OP)?;
        let mut b = gather.lock();
        b.device = inner.alloc_relaxed(OP, words * WORD)?;
        // Freed once, in `Drop`.
        b.host = driver::memory::alloc_host(OP, 2 * words * WORD)?.cast();
        // Destroyed once, in `Drop`.
        b.done = driver::stream::create_event(OP)?;
        drop(b);
        Ok(gather)
    }

    fn lock(&self) -> MutexGuard<'_, Buffers> {
        // Every field is written whole; `flight` leaves `Idle` before copies are enqueued and
        // returns to it only once they completed, so a panic cannot leave it claiming less.
        self.buffers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The sum over all ranks of `send` (this rank's part at its slot, zeros elsewhere: so
    /// every rank's part, in rank order), waiting until `deadline`; `start` is when the caller
    /// began, for the error. A failure or a timeout aborts `comm`.
    pub(super) fn exchange(
        &self,
        comm: &NcclComm,
        send: &[u64],
        start: Instant,
        deadline: Instant,
    ) -> Result<Vec<u64>, GroupError> {
        let rank = comm.rank;
        let mut b = self.lock();
        if b.flight != Flight::Idle {
            // An earlier exchange never completed: the communicator was aborted then.
            return Err(GroupError::Device {
                rank,
                source: DeviceError::CollectiveAborted { op: OP },
            });
        }
        if send.len() != b.words {
            return Err(GroupError::Device {
                rank,
                source: DeviceError::InvalidArgument {
                    op: OP,
                    what: "an exchange's words differ in number from its memory's",
                },
            });
        }
        if let Err(source) = self.enqueue(comm, &mut b, send, start, deadline) {
            // No peer may wait on an exchange this rank could not enqueue (aborting twice is
            // nothing).
            comm.abort_after_failure();
            return Err(GroupError::Device { rank, source });
        }
        self.wait(comm, &mut b, start, deadline)?;
        let words = b.words;
        // SAFETY: the exchange completed (its event did), so the copy into the second `words`
        // pinned words finished; the mutex gives this thread the only access.
        let sum = unsafe { std::slice::from_raw_parts(b.host.add(words), words) };
        Ok(sum.to_vec())
    }

    /// The exchange's device work: `send` up, the sum all-reduce, the result down, and the
    /// completion event. Marks the buffers in flight before anything is enqueued.
    fn enqueue(
        &self,
        comm: &NcclComm,
        b: &mut Buffers,
        send: &[u64],
        start: Instant,
        deadline: Instant,
    ) -> Result<(), DeviceError> {
        let inner = &self.queue.inner;
        inner.make_current(OP)?;
        if inner.capture_status(OP)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op: OP,
                state: "the runtime stream is capturing, and an exchange over NCCL (a vote) must run between captures",
            });
        }
        let words = b.words;
        // SAFETY: `host` holds `2 * words` pinned words (allocated in `new`), page-aligned;
        // no copy is in flight (`flight` is idle: the last exchange completed), and the mutex
        // gives this thread the only access.
        let host = unsafe { std::slice::from_raw_parts_mut(b.host, 2 * words) };
        host[..words].copy_from_slice(send);
        let stream = inner.stream;
        b.flight = Flight::Unmarked;
        // SAFETY: the first `words` pinned words stay untouched until the exchange completes
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
        comm.enqueue(|handle| {
            // `at` is `words` u64s of this device's memory, kept until `Drop`; the stream is
            // the device's runtime stream (not capturing: checked above); the handle is live
            // and used by this thread alone (`enqueue`).
            dn::all_reduce_sum(handle, at, words, sys::ncclDataType_t::ncclUint64, stream)
        })?;
        comm.settle_or_abort(start, deadline)?;
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

    /// Polls the exchange until its event completes: the communicator's errors and the
    /// deadline end the wait (and abort the communicator).
    fn wait(
        &self,
        comm: &NcclComm,
        b: &mut Buffers,
        start: Instant,
        deadline: Instant,
    ) -> Result<(), GroupError> {
        let rank = comm.rank;
        let failed = |source| {
            comm.abort_after_failure();
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
            match comm.async_state() {
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
                comm.abort_after_failure();
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

impl Drop for Gather {
    /// Releases the exchange's memory and event. If the last exchange never completed (it
    /// timed out or failed, and the communicator was aborted) and its copies may still run,
    /// the memory is kept (leaked, a few words) rather than freed under them.
    fn drop(&mut self) {
        let inner = self.queue.inner.clone();
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
                "the last exchange over NCCL (a vote, or the one-shot all-reduce's setup) may still run: its few words of memory are kept, not freed"
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
