//! Device and pinned host memory, copies on a stream, and virtual memory management (reserving address ranges, creating, mapping, unmapping and releasing physical granules).

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, check_alloc};

/// `cuMemAlloc` of `bytes` in the current context; the caller owns the memory and frees it
/// once with [`free`].
pub(crate) fn alloc(op: DeviceOp, bytes: usize) -> Result<u64, DeviceError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: the caller made the context current; `ptr` is a valid out-pointer.
    check_alloc(op, unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, bytes)?;
    Ok(ptr)
}

/// `cuMemFree` of memory from [`alloc`].
pub(crate) fn free(op: DeviceOp, ptr: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller passes memory from `alloc` that it owns alone and no pending work
    // uses; the driver validates the address and reports anything it did not allocate.
    check(op, unsafe { sys::cuMemFree_v2(ptr) })
}

/// `cuMemAllocHost` of `bytes` of pinned host memory in the current context; the caller owns
/// it and frees it once with [`free_host`].
#[cfg(feature = "nccl")]
pub(crate) fn alloc_host(op: DeviceOp, bytes: usize) -> Result<*mut c_void, DeviceError> {
    let mut host: *mut c_void = ptr::null_mut();
    // SAFETY: the caller made the context current; `host` is a valid out-pointer.
    let r = unsafe { sys::cuMemAllocHost_v2(&mut host, bytes) };
    check_alloc(op, r, bytes)?;
    Ok(host)
}

/// `cuMemFreeHost` of memory from [`alloc_host`].
#[cfg(feature = "nccl")]
pub(crate) fn free_host(op: DeviceOp, host: *mut c_void) -> Result<(), DeviceError> {
    // SAFETY: the caller passes pinned memory from `alloc_host` that it owns alone, with no
    // copy in flight; the driver validates the address.
    check(op, unsafe { sys::cuMemFreeHost(host) })
}

/// `cuMemcpyDtoDAsync` of `bytes` on `stream`.
pub(crate) fn copy_dtod_async(
    op: DeviceOp,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: both ends are device addresses, which the host never dereferences: an invalid
    // or overlapping one is an error the driver reports (callers reject overlaps first), not
    // host UB; the stream is a live stream of the current context.
    check(op, unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// `cuMemcpyHtoDAsync` of `bytes` from host memory at `src` on `stream`.
///
/// # Safety
/// `src` must be `bytes` readable bytes that stay valid and unchanged until the stream has
/// run the copy (a stream synchronize, or an event recorded after it, has completed).
pub(crate) unsafe fn copy_htod_async(
    op: DeviceOp,
    dst: u64,
    src: *const c_void,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps `src` valid until the copy ran; `dst` is a device address (an
    // invalid one is a driver error, not host UB); the stream is live.
    check(op, unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// `cuMemcpyDtoHAsync` of `bytes` into host memory at `dst` on `stream`.
///
/// # Safety
/// `dst` must be `bytes` writable bytes that nothing else reads or writes until the stream
/// has run the copy.
pub(crate) unsafe fn copy_dtoh_async(
    op: DeviceOp,
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps `dst` valid and untouched until the copy ran; `src` is a device
    // address (an invalid one is a driver error, not host UB); the stream is live.
    check(op, unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream)
    })
}

/// Writes `src` to device memory at `dst` on `stream` (nothing when empty), then synchronizes
/// the stream: the copy has finished when this returns.
pub(crate) fn write_sync(
    op: DeviceOp,
    dst: u64,
    src: &[u8],
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    if !src.is_empty() {
        // SAFETY: `src` is a live host slice of `src.len()` bytes, borrowed until the stream
        // synchronize below returns (so the driver's read of it has finished).
        unsafe { copy_htod_async(op, dst, src.as_ptr().cast(), src.len(), stream) }?;
    }
    super::stream::synchronize(op, stream)
}

/// Reads device memory at `src` into `dst` on `stream` (nothing when empty), then synchronizes
/// the stream: the copy has finished when this returns.
pub(crate) fn read_sync(
    op: DeviceOp,
    src: u64,
    dst: &mut [u8],
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    if !dst.is_empty() {
        // SAFETY: `dst` is a live, exclusively borrowed host buffer of `dst.len()` bytes,
        // borrowed until the stream synchronize below returns (so the driver's write to it
        // has finished).
        unsafe { copy_dtoh_async(op, dst.as_mut_ptr().cast(), src, dst.len(), stream) }?;
    }
    super::stream::synchronize(op, stream)
}

/// The properties of graft's physical allocations on device `device`: pinned device memory,
/// no exportable handle.
fn alloc_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The driver's recommended granularity (`cuMemGetAllocationGranularity`) for graft's
/// physical allocations on `device`.
pub(crate) fn granularity(op: DeviceOp, device: sys::CUdevice) -> Result<usize, DeviceError> {
    let prop = alloc_prop(device);
    let mut granularity: usize = 0;
    // SAFETY: `granularity` is a valid out-pointer; `prop` is a fully initialized property
    // struct for this device that outlives the call.
    check(op, unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(granularity)
}

/// Reserves `bytes` of address space aligned to `align` (`cuMemAddressReserve`, any address,
/// no flags); freed once with [`address_free`].
pub(crate) fn address_reserve(
    op: DeviceOp,
    bytes: usize,
    align: usize,
) -> Result<u64, DeviceError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: the context is current; `ptr` is a valid out-pointer; a zero requested address
    // and flags ask for any suitably aligned range.
    let r = unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, align, 0, 0) };
    check_alloc(op, r, bytes)?;
    Ok(ptr)
}

/// Frees a whole reservation from [`address_reserve`] (`cuMemAddressFree`).
pub(crate) fn address_free(op: DeviceOp, base: u64, bytes: usize) -> Result<(), DeviceError> {
    // SAFETY: `base`/`bytes` are exactly a reservation the caller made and still owns, with
    // nothing mapped in it, freed once; the driver validates the range.
    check(op, unsafe { sys::cuMemAddressFree(base, bytes) })
}

/// Creates a physical allocation of `bytes` on `device` (`cuMemCreate`, graft's properties,
/// flags 0); released once with [`release`]. Out of memory reports `report_bytes`.
pub(crate) fn create(
    op: DeviceOp,
    device: sys::CUdevice,
    bytes: usize,
    report_bytes: usize,
) -> Result<sys::CUmemGenericAllocationHandle, DeviceError> {
    let prop = alloc_prop(device);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer; `prop` is a fully initialized property struct
    // that outlives the call; flags must be 0.
    let created = unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) };
    check_alloc(op, created, report_bytes)?;
    Ok(handle)
}

/// Maps the whole allocation `handle` (`bytes` long) at `addr` (`cuMemMap`, offset and flags
/// 0).
pub(crate) fn map(
    op: DeviceOp,
    addr: u64,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DeviceError> {
    // SAFETY: `addr` is an aligned, unmapped range inside a live reservation of the caller's
    // (checked by the caller; the driver refuses anything else) and `handle` a live
    // allocation of `bytes`; offset and flags 0.
    check(op, unsafe { sys::cuMemMap(addr, bytes, 0, handle, 0) })
}

/// Gives device `device` read and write access to the mapped range `addr..addr+bytes`
/// (`cuMemSetAccess`).
pub(crate) fn set_access(
    op: DeviceOp,
    device: sys::CUdevice,
    addr: u64,
    bytes: usize,
) -> Result<(), DeviceError> {
    let desc = sys::CUmemAccessDesc {
        location: alloc_prop(device).location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `desc` is one valid access descriptor that outlives the call, matching the count
    // of 1; the range is mapped (the driver refuses anything else).
    check(op, unsafe { sys::cuMemSetAccess(addr, bytes, &desc, 1) })
}

/// Unmaps `addr..addr+bytes` (`cuMemUnmap`), exactly one mapping made by [`map`].
pub(crate) fn unmap(op: DeviceOp, addr: u64, bytes: usize) -> Result<(), DeviceError> {
    // SAFETY: the range is exactly one mapping the caller made; work that could use it was
    // synchronized or never ran.
    check(op, unsafe { sys::cuMemUnmap(addr, bytes) })
}

/// Releases a physical allocation from [`create`] (`cuMemRelease`), once, after its mapping
/// is gone.
pub(crate) fn release(
    op: DeviceOp,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DeviceError> {
    // SAFETY: `handle` came from `cuMemCreate`, is owned by the caller alone and released once.
    check(op, unsafe { sys::cuMemRelease(handle) })
}
