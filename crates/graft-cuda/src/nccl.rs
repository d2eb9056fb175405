//! `NcclComm`: NCCL communicators over graft devices, with all-reduces enqueued on each
//! device's runtime stream, so that a body's collective is captured into its graph and
//! replayed with it (feature `nccl`; libnccl is loaded at run time like the rest of CUDA).

use std::ffi::c_int;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::{Mutex, PoisonError};

use cudarc::nccl::sys;
use graft_core::Buffer;
use graft_core::{DeviceError, DeviceOp};

use crate::device::{CudaDevice, CudaQueue};

const OP: DeviceOp = DeviceOp::Collective;

const MISSING: &str = "libnccl cannot be loaded: install NCCL (pip: nvidia-nccl-cu12 or -cu13) and put a libnccl.so (a link to its libnccl.so.2) on LD_LIBRARY_PATH";

const LAZY_CONNECT: &str = "NCCL_RUNTIME_CONNECT is not 0: NCCL would connect ranks at their first collective, which blocks until every rank gets there, so a rank whose recording failed before its collective would leave its peers stuck inside theirs; set NCCL_RUNTIME_CONNECT=0 in the environment before the program starts";

/// One rank's NCCL communicator, bound to one [`CudaDevice`] and its runtime stream.
///
/// Made for all ranks of one process at once by [`NcclComm::init_all`]. Destroy it after the
/// graphs that captured its collectives (drop the rank's `Graft` first). NCCL allows one
/// thread at a time per communicator, which a lock inside guarantees.
pub struct NcclComm {
    comm: Mutex<sys::ncclComm_t>,
    queue: CudaQueue,
    rank: usize,
    world: usize,
}

// SAFETY: an `ncclComm_t` is a heap handle NCCL lets any thread use, one at a time; every use
// here goes through the mutex, and the handle is destroyed once, in `Drop`.
unsafe impl Send for NcclComm {}
// SAFETY: as for `Send`: shared references reach the handle only through the mutex.
unsafe impl Sync for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.queue.inner.id)
            .finish_non_exhaustive()
    }
}

/// NCCL's error as core's [`DeviceError::Library`].
fn check(result: sys::ncclResult_t) -> Result<(), DeviceError> {
    use sys::ncclResult_t as R;
    let name = match result {
        R::ncclSuccess | R::ncclInProgress => return Ok(()),
        R::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        R::ncclSystemError => "ncclSystemError",
        R::ncclInternalError => "ncclInternalError",
        R::ncclInvalidArgument => "ncclInvalidArgument",
        R::ncclInvalidUsage => "ncclInvalidUsage",
        R::ncclRemoteError => "ncclRemoteError",
        R::ncclTimeout => "ncclTimeout",
        R::ncclNumResults => "ncclNumResults",
    };
    Err(DeviceError::Library {
        op: OP,
        library: "NCCL",
        code: result as u32,
        name,
    })
}

/// Whether libnccl can be opened, without panicking when it cannot.
fn nccl_present() -> bool {
    // SAFETY: `is_culib_present` only `dlopen`s the candidate names and drops the handles.
    catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

impl NcclComm {
    /// One communicator per device, rank `i` on `devices[i]` (`ncclCommInitAll`): every
    /// device must be a different GPU of this process.
    ///
    /// Requires `NCCL_RUNTIME_CONNECT=0` in the environment (NCCL then connects the ranks
    /// here, at init, not lazily inside the first collective of each kind): with lazy
    /// connection, enqueuing a collective waits on the host for the other ranks to enqueue
    /// theirs, so one rank failing a recording before its all-reduce would leave the others
    /// stuck in their capture, where no vote can reach them.
    pub fn init_all(devices: &[CudaDevice]) -> Result<Vec<NcclComm>, DeviceError> {
        if !nccl_present() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: MISSING,
            });
        }
        if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none_or(|v| v != "0") {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: LAZY_CONNECT,
            });
        }
        let mut ordinals: Vec<c_int> = Vec::with_capacity(devices.len());
        for d in devices {
            let ordinal =
                c_int::try_from(d.ordinal()).map_err(|_| DeviceError::InvalidArgument {
                    op: OP,
                    what: "a device ordinal exceeds i32::MAX",
                })?;
            if ordinals.contains(&ordinal) {
                return Err(DeviceError::InvalidArgument {
                    op: OP,
                    what: "two ranks on one GPU; give each rank its own device",
                });
            }
            ordinals.push(ordinal);
        }
        let n = c_int::try_from(devices.len()).map_err(|_| DeviceError::InvalidArgument {
            op: OP,
            what: "too many devices",
        })?;
        let mut comms: Vec<sys::ncclComm_t> = vec![ptr::null_mut(); devices.len()];
        let made = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` distinct device
            // ordinals; NCCL writes one handle per device.
            unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), n, ordinals.as_ptr()) }
        }))
        .map_err(|_| DeviceError::Unavailable {
            op: OP,
            what: MISSING,
        })?;
        check(made)?;
        Ok(comms
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (comm, d))| NcclComm {
                comm: Mutex::new(comm),
                queue: (**d).clone(),
                rank,
                world: devices.len(),
            })
            .collect())
    }

    /// The version of the loaded libnccl as (major, minor, patch).
    pub fn version() -> Result<(u32, u32, u32), DeviceError> {
        if !nccl_present() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: MISSING,
            });
        }
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; the library is present (checked above).
        check(unsafe { sys::ncclGetVersion(&mut v) })?;
        let v = u32::try_from(v).unwrap_or(0);
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

    /// Enqueues an in-place all-reduce (sum) of the first `n` `f32`s of `buffer` on the
    /// device's runtime stream (`ncclAllReduce`; captured when the stream is capturing). The
    /// buffer is checked as a kernel argument: this device's, still valid, long enough.
    pub fn all_reduce_sum_f32(&self, buffer: &Buffer, n: usize) -> Result<(), DeviceError> {
        let bytes = n.checked_mul(4).ok_or(DeviceError::InvalidArgument {
            op: OP,
            what: "the element count overflows",
        })?;
        let inner = &self.queue.inner;
        let at = buffer.device_addr(OP, inner.id, 0, bytes)?;
        inner.make_current(OP)?;
        if !inner.conditionals().open_is_empty() {
            // NCCL records event nodes (and, with graph mixing, host-side bookkeeping), which
            // a conditional body cannot hold: refused here, before NCCL enqueues anything.
            return Err(DeviceError::Conditional {
                op: OP,
                rule: graft_core::ConditionalRule::Collective,
            });
        }
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        let at = at.0 as usize as *mut std::ffi::c_void;
        // SAFETY: `at` is `bytes` of live memory on this communicator's device (checked
        // above; graft keeps a buffer's memory while it is held, and the caller holds it until
        // the stream has run the collective), the stream is that device's runtime stream, and
        // the handle is live (destroyed only in `Drop`) and used by one thread (the lock).
        check(unsafe {
            sys::ncclAllReduce(
                at,
                at,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                *comm,
                inner.stream.cast(),
            )
        })
    }

    /// Aborts the communicator (`ncclCommAbort`, which NCCL documents as aborting the
    /// communicator's uncompleted operations). Use it when a peer failed after collectives were
    /// enqueued, then make new communicators. Not exercised by graft's tests.
    pub fn abort(self) -> Result<(), DeviceError> {
        let mut comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        let handle = std::mem::replace(&mut *comm, ptr::null_mut());
        // SAFETY: the handle is live and taken out of the lock, so `Drop` will not destroy it.
        check(unsafe { sys::ncclCommAbort(handle) })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let comm = *self.comm.get_mut().unwrap_or_else(PoisonError::into_inner);
        if comm.is_null() {
            return;
        }
        // SAFETY: the handle is live and this is its only destruction.
        if let Err(e) = check(unsafe { sys::ncclCommDestroy(comm) }) {
            self.queue.inner.record_sticky(e);
        }
    }
}
