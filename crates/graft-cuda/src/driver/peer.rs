//! Peer memory (feature `nccl`, for the one-shot all-reduce): whether one device can reach another's memory, enabling that access between two contexts, a device's UUID, CUDA IPC handles of `cuMemAlloc` memory (getting one, opening a peer process's, closing it), and pinned host memory mapped into the device's address space.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, check_alloc};

/// The bytes of a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// Whether `device` can map `peer`'s memory (`cuDeviceCanAccessPeer`).
pub(crate) fn can_access_peer(
    op: DeviceOp,
    device: sys::CUdevice,
    peer: sys::CUdevice,
) -> Result<bool, DeviceError> {
    let mut can: c_int = 0;
    // SAFETY: `can` is a valid out-pointer; both devices are devices of the ready driver (the
    // caller got them from `cuDeviceGet`).
    check(op, unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, device, peer)
    })?;
    Ok(can != 0)
}

/// Lets the current context map the memory of `peer` (`cuCtxEnablePeerAccess`, flags 0);
/// access enabled before (by graft or by NCCL) is no error.
pub(crate) fn enable_peer_access(op: DeviceOp, peer: sys::CUcontext) -> Result<(), DeviceError> {
    // SAFETY: `peer` is a primary context the caller holds (retained, not released); the
    // caller made its own context current; 0 is the only valid flag value.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer, 0) };
    if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check(op, r)
}

/// The device's UUID (`cuDeviceGetUuid_v2`): the same in every process of the host, and
/// unlike any other GPU's anywhere.
pub(crate) fn uuid(op: DeviceOp, device: sys::CUdevice) -> Result<[u8; 16], DeviceError> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid out-pointer to a whole `CUuuid`; `device` is a device of the
    // ready driver.
    check(op, unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The IPC handle of `cuMemAlloc` memory starting at `at` (`cuIpcGetMemHandle`), for another
/// process to open with [`ipc_open`].
pub(crate) fn ipc_handle(op: DeviceOp, at: u64) -> Result<[u8; IPC_HANDLE_BYTES], DeviceError> {
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: `handle` is a valid out-pointer to a whole handle; `at` is a device address (the
    // driver reports one it did not allocate with `cuMemAlloc`).
    check(op, unsafe { sys::cuIpcGetMemHandle(&mut handle, at) })?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// Maps the memory another process exported as `handle` into the current context
/// (`cuIpcOpenMemHandle`, enabling peer access to its device as needed): its address here,
/// which the caller closes once with [`ipc_close`].
pub(crate) fn ipc_open(op: DeviceOp, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, DeviceError> {
    let raw = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut at: sys::CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
    // SAFETY: `at` is a valid out-pointer; the handle is passed by value (the driver rejects
    // one that names no live exported allocation, or one of this process); the caller made
    // its context current.
    check(op, unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut at, raw, flags)
    })?;
    Ok(at)
}

/// Unmaps memory from [`ipc_open`] (`cuIpcCloseMemHandle`).
pub(crate) fn ipc_close(op: DeviceOp, at: u64) -> Result<(), DeviceError> {
    // SAFETY: `at` came from `ipc_open`, is closed once, and no work that uses it is pending
    // (the caller waited for its stream); the driver rejects any other address.
    check(op, unsafe { sys::cuIpcCloseMemHandle(at) })
}

/// `bytes` of pinned host memory mapped into the device's address space (`cuMemHostAlloc`
/// with `CU_MEMHOSTALLOC_DEVICEMAP`) in the current context: the host pointer, which the
/// caller frees once with `memory::free_host`.
pub(crate) fn alloc_host_mapped(op: DeviceOp, bytes: usize) -> Result<*mut c_void, DeviceError> {
    let mut host: *mut c_void = ptr::null_mut();
    // SAFETY: `host` is a valid out-pointer; the caller made the context current; the flag is
    // one `cuMemHostAlloc` defines.
    let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) };
    check_alloc(op, r, bytes)?;
    Ok(host)
}

/// The device address of mapped host memory from [`alloc_host_mapped`]
/// (`cuMemHostGetDevicePointer`, flags 0).
pub(crate) fn host_device_pointer(op: DeviceOp, host: *mut c_void) -> Result<u64, DeviceError> {
    let mut at: sys::CUdeviceptr = 0;
    // SAFETY: `at` is a valid out-pointer; `host` is memory from `cuMemHostAlloc` with the
    // device-map flag (the driver rejects anything else); 0 is the only valid flag value.
    check(op, unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut at, host, 0)
    })?;
    Ok(at)
}
