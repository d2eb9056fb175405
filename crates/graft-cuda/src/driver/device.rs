//! Devices and their primary contexts: looking a device up, its name, retaining, making current and releasing its primary context, the driver's version, and trimming graph memory.

use std::ffi::{CStr, c_char, c_int};
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, invalid_argument};

/// The device of ordinal `ordinal` (`cuDeviceGet`). The driver must be ready
/// ([`super::driver_ready`]).
pub(crate) fn get(op: DeviceOp, ordinal: usize) -> Result<sys::CUdevice, DeviceError> {
    let ordinal = c_int::try_from(ordinal)
        .map_err(|_| invalid_argument(op, "the device ordinal exceeds i32::MAX"))?;
    let mut device: sys::CUdevice = 0;
    // SAFETY: the driver is initialized (the caller ran driver_ready); `device` is a valid
    // out-pointer.
    check(op, unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
    Ok(device)
}

/// The device's name as the driver reports it (`cuDeviceGetName`).
pub(crate) fn name(op: DeviceOp, device: sys::CUdevice) -> Result<String, DeviceError> {
    let mut buf: [c_char; 256] = [0; 256];
    // SAFETY: `buf` has room for the 256 bytes passed as its length.
    check(op, unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device)
    })?;
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf` is NUL-terminated (its last byte was just set to 0).
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// Retains the device's primary context (`cuDevicePrimaryCtxRetain`); the caller releases it
/// once with [`release_primary`].
pub(crate) fn retain_primary(
    op: DeviceOp,
    device: sys::CUdevice,
) -> Result<sys::CUcontext, DeviceError> {
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: `device` is a valid device (from `get`); `ctx` is a valid out-pointer.
    check(op, unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(ctx)
}

/// Releases one reference to the device's primary context (`cuDevicePrimaryCtxRelease`),
/// taken by [`retain_primary`].
pub(crate) fn release_primary(op: DeviceOp, device: sys::CUdevice) -> Result<(), DeviceError> {
    // SAFETY: the caller retained the primary context of `device` once and releases it once;
    // nothing of the caller's uses the context afterwards.
    check(op, unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) })
}

/// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`).
#[inline]
pub(crate) fn set_current(op: DeviceOp, ctx: sys::CUcontext) -> Result<(), DeviceError> {
    // SAFETY: `ctx` is a primary context the caller holds a reference to (retained, not yet
    // released).
    check(op, unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12080), or `None` if it does not say.
pub(crate) fn driver_version() -> Option<c_int> {
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer; the driver is loaded (a device is open).
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(version)
}

/// Gives the device's unused graph memory (what graph allocation nodes keep cached) back to
/// the OS (`cuDeviceGraphMemTrim`).
pub(crate) fn trim_graph_memory(op: DeviceOp, device: sys::CUdevice) -> Result<(), DeviceError> {
    // SAFETY: `device` is a valid device whose primary context the caller holds; the call only
    // releases memory no graph is using.
    check(op, unsafe { sys::cuDeviceGraphMemTrim(device) })
}
