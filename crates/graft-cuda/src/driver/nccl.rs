//! NCCL (feature `nccl`): whether libnccl loads, its version, unique ids, making, finalizing, aborting and destroying communicators, their asynchronous state, and the sum all-reduce; each result mapped to a typed error, and a panic inside cudarc (a missing symbol) reported as NCCL missing.

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use cudarc::driver::sys as cu;
use cudarc::nccl::sys;
use graft_core::{DeviceError, DeviceOp};

const OP: DeviceOp = DeviceOp::Collective;

/// What a missing libnccl (or a missing NCCL symbol) is reported with.
pub(crate) const MISSING: &str = "libnccl cannot be loaded: install NCCL (pip: nvidia-nccl-cu12 or -cu13) and put a libnccl.so (a link to its libnccl.so.2) on LD_LIBRARY_PATH";

/// NCCL's error as core's [`DeviceError::Library`]; `ncclInProgress` is not an error (a
/// non-blocking communicator's operation under way: see `NcclComm::settle`).
pub(crate) fn check(result: sys::ncclResult_t) -> Result<(), DeviceError> {
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

/// Whether libnccl can be opened, without panicking when it cannot (with `dynamic-linking`
/// the loader already found it).
pub(crate) fn present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: `is_culib_present` only `dlopen`s the candidate names and drops the handles.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    }
    #[cfg(not(feature = "dynamic-loading"))]
    true
}

/// Runs an NCCL call, a panic inside cudarc (a missing symbol) becoming [`MISSING`].
fn guarded(call: impl FnOnce() -> sys::ncclResult_t) -> Result<(), DeviceError> {
    let result = catch_unwind(AssertUnwindSafe(call)).map_err(|_| DeviceError::Unavailable {
        op: OP,
        what: MISSING,
    })?;
    check(result)
}

/// The loaded libnccl's version code (`ncclGetVersion`). The library must be [`present`].
pub(crate) fn version() -> Result<c_int, DeviceError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; the library is present (the caller checked).
    check(unsafe { sys::ncclGetVersion(&mut v) })?;
    Ok(v)
}

/// A new unique id (`ncclGetUniqueId`).
pub(crate) fn unique_id() -> Result<sys::ncclUniqueId, DeviceError> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer to a whole `ncclUniqueId`.
    guarded(|| unsafe { sys::ncclGetUniqueId(&mut id) })?;
    Ok(id)
}

/// One communicator per device of `ordinals` (`ncclCommInitAll`), rank `i` on
/// `ordinals[i]`; the ordinals must be distinct.
pub(crate) fn init_all(ordinals: &[c_int]) -> Result<Vec<sys::ncclComm_t>, DeviceError> {
    let n = c_int::try_from(ordinals.len()).map_err(|_| DeviceError::InvalidArgument {
        op: OP,
        what: "too many devices",
    })?;
    let mut comms: Vec<sys::ncclComm_t> = vec![ptr::null_mut(); ordinals.len()];
    // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` device ordinals
    // (distinct: the caller checked); NCCL writes one handle per device.
    guarded(|| unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), n, ordinals.as_ptr()) })?;
    Ok(comms)
}

/// Starts rank `rank`'s communicator of `world` ranks from `id` with `config`
/// (`ncclCommInitRankConfig`) on the current device: the handle NCCL made (null if none; the
/// caller owns it, even when the call failed) and the call's result.
pub(crate) fn init_rank(
    id: sys::ncclUniqueId,
    rank: c_int,
    world: c_int,
    config: &mut sys::ncclConfig_t,
) -> (sys::ncclComm_t, Result<(), DeviceError>) {
    let mut handle: sys::ncclComm_t = ptr::null_mut();
    // SAFETY: `handle` and `config` are valid pointers for the call (NCCL copies the config,
    // reading at most `config.size` bytes, which its builder sets to its real size); the id is
    // passed by value; the caller checked that rank < world.
    let result =
        guarded(|| unsafe { sys::ncclCommInitRankConfig(&mut handle, world, id, rank, config) });
    (handle, result)
}

/// The communicator's asynchronous state (`ncclCommGetAsyncError`).
pub(crate) fn async_error(comm: sys::ncclComm_t) -> Result<sys::ncclResult_t, DeviceError> {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: the handle is live and used by the caller's thread alone (the communicator's
    // lock); `state` is a valid out-pointer.
    check(unsafe { sys::ncclCommGetAsyncError(comm, &mut state) })?;
    Ok(state)
}

/// Enqueues an in-place sum all-reduce of `count` elements of `dtype` at device address `at`
/// on `stream` (`ncclAllReduce`; captured when the stream is capturing).
pub(crate) fn all_reduce_sum(
    comm: sys::ncclComm_t,
    at: u64,
    count: usize,
    dtype: sys::ncclDataType_t,
    stream: cu::CUstream,
) -> Result<(), DeviceError> {
    let at = at as usize as *mut c_void;
    // SAFETY: `at` is a device address, which the host never dereferences: the caller checks
    // that `count` elements of `dtype` there are live memory of the communicator's device,
    // kept until the stream has run the collective; the stream is that device's; the handle
    // is live and used by the caller's thread alone (the communicator's lock).
    check(unsafe {
        sys::ncclAllReduce(
            at,
            at,
            count,
            dtype,
            sys::ncclRedOp_t::ncclSum,
            comm,
            stream.cast(),
        )
    })
}

/// Starts finalizing a non-blocking communicator (`ncclCommFinalize`).
pub(crate) fn finalize(comm: sys::ncclComm_t) -> Result<(), DeviceError> {
    // SAFETY: the handle is live and used by the caller's thread alone.
    check(unsafe { sys::ncclCommFinalize(comm) })
}

/// Aborts a communicator (`ncclCommAbort`), which frees it.
pub(crate) fn abort(comm: sys::ncclComm_t) -> Result<(), DeviceError> {
    // SAFETY: the handle is live and taken out of the caller's keeping, so nothing uses it
    // again.
    check(unsafe { sys::ncclCommAbort(comm) })
}

/// Destroys a communicator (`ncclCommDestroy`).
pub(crate) fn destroy(comm: sys::ncclComm_t) -> Result<(), DeviceError> {
    // SAFETY: the handle is live (not aborted) and taken out of the caller's keeping: this is
    // its only destruction.
    check(unsafe { sys::ncclCommDestroy(comm) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_progress_is_not_an_error_and_remote_errors_are_named() {
        assert_eq!(check(sys::ncclResult_t::ncclInProgress), Ok(()));
        assert_eq!(
            check(sys::ncclResult_t::ncclRemoteError),
            Err(DeviceError::Library {
                op: OP,
                library: "NCCL",
                code: 6,
                name: "ncclRemoteError"
            })
        );
    }
}
