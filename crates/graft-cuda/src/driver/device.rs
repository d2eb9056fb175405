//! Devices and their primary contexts: looking a device up, its name and compute capability, retaining, making current and releasing its primary context, the driver's version, trimming graph memory, and the memory figures of its graph memory and default pool.

use std::ffi::{CStr, c_char, c_int, c_void};
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

/// The device's compute capability, major and minor (`cuDeviceGetAttribute`).
pub(crate) fn compute_capability(
    op: DeviceOp,
    device: sys::CUdevice,
) -> Result<(u32, u32), DeviceError> {
    use sys::CUdevice_attribute as A;
    let get = |attribute: A| -> Result<u32, DeviceError> {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer; `device` a device of the ready driver.
        check(op, unsafe {
            sys::cuDeviceGetAttribute(&mut value, attribute, device)
        })?;
        Ok(u32::try_from(value).unwrap_or(0))
    };
    Ok((
        get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
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

/// The graph memory figures (`cuDeviceGetGraphMemAttribute`), in the order of
/// [`crate::MemoryFigures`]'s fields: used now, used at the high-water mark, reserved now,
/// reserved at the high-water mark.
pub(crate) fn graph_memory(op: DeviceOp, device: sys::CUdevice) -> Result<[u64; 4], DeviceError> {
    use sys::CUgraphMem_attribute as A;
    let mut figures = [0u64; 4];
    let attrs = [
        A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
        A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
        A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
        A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
    ];
    for (value, attr) in figures.iter_mut().zip(attrs) {
        // SAFETY: `device` is a valid device whose primary context the caller holds; the four
        // attributes are each a cuuint64_t, which `value` is.
        check(op, unsafe {
            sys::cuDeviceGetGraphMemAttribute(device, attr, (value as *mut u64).cast::<c_void>())
        })?;
    }
    Ok(figures)
}

/// Resets the graph memory's two high-water marks (`cuDeviceSetGraphMemAttribute`).
pub(crate) fn reset_graph_memory_high(
    op: DeviceOp,
    device: sys::CUdevice,
) -> Result<(), DeviceError> {
    use sys::CUgraphMem_attribute as A;
    for attr in [
        A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
        A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: the high-water attributes are cuuint64_t and may only be set to 0, which
        // `zero` is; `device` is a valid device whose primary context the caller holds.
        check(op, unsafe {
            sys::cuDeviceSetGraphMemAttribute(device, attr, (&raw mut zero).cast::<c_void>())
        })?;
    }
    Ok(())
}

/// The device's default memory pool (`cuDeviceGetDefaultMemPool`): where stream-ordered
/// allocations outside graphs come from.
pub(crate) fn default_pool(
    op: DeviceOp,
    device: sys::CUdevice,
) -> Result<sys::CUmemoryPool, DeviceError> {
    let mut pool: sys::CUmemoryPool = ptr::null_mut();
    // SAFETY: `device` is a valid device whose primary context the caller holds; `pool` is a
    // valid out-pointer.
    check(op, unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, device)
    })?;
    Ok(pool)
}

/// A memory pool's figures (`cuMemPoolGetAttribute`), in the order of
/// [`crate::MemoryFigures`]'s fields.
pub(crate) fn pool_memory(op: DeviceOp, pool: sys::CUmemoryPool) -> Result<[u64; 4], DeviceError> {
    use sys::CUmemPool_attribute as A;
    let mut figures = [0u64; 4];
    let attrs = [
        A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ];
    for (value, attr) in figures.iter_mut().zip(attrs) {
        // SAFETY: `pool` is a live pool (a device's default pool lives as long as its
        // context); the four attributes are each a cuuint64_t, which `value` is.
        check(op, unsafe {
            sys::cuMemPoolGetAttribute(pool, attr, (value as *mut u64).cast::<c_void>())
        })?;
    }
    Ok(figures)
}

/// Resets a memory pool's two high-water marks to what is in use now
/// (`cuMemPoolSetAttribute`).
pub(crate) fn reset_pool_high(op: DeviceOp, pool: sys::CUmemoryPool) -> Result<(), DeviceError> {
    use sys::CUmemPool_attribute as A;
    for attr in [
        A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: the high-water attributes are cuuint64_t that may only be set to 0, which
        // `zero` is; `pool` is a live pool.
        check(op, unsafe {
            sys::cuMemPoolSetAttribute(pool, attr, (&raw mut zero).cast::<c_void>())
        })?;
    }
    Ok(())
}
