//! Pool memory through CUDA's virtual memory management: reserving address ranges, mapping and unmapping granules, releasing reservations, and what is left at teardown.

use std::collections::{BTreeMap, HashMap};
use std::ptr;
use std::sync::PoisonError;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::context::Inner;
use crate::error::{check, check_alloc, invalid_argument};

/// What the device has reserved and mapped for graft's pools.
#[derive(Default)]
pub(crate) struct Vmm {
    /// Base -> size of each live reservation.
    reservations: BTreeMap<u64, usize>,
    /// Address of each mapped granule -> its physical allocation.
    handles: HashMap<u64, sys::CUmemGenericAllocationHandle>,
}

impl Vmm {
    /// Whether `[addr, addr+bytes)` lies inside one reservation.
    fn inside_reservation(&self, addr: u64, bytes: usize) -> bool {
        self.reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &size)| {
                addr.checked_add(bytes as u64)
                    .is_some_and(|end| end <= base + size as u64)
            })
    }

    /// Unmaps every granule and frees every reservation still listed (memory pools did not
    /// give back: a runtime leaked, or a test stopped early). Errors are ignored: this only
    /// runs when `inner` is dropped, after its stream was synchronized.
    pub(crate) fn release(self, inner: &Inner) {
        for (addr, handle) in self.handles {
            let _ = inner.unmap_granule(DeviceOp::Unmap, addr, handle);
        }
        for (base, size) in self.reservations {
            // SAFETY: a reservation made by cuMemAddressReserve in `reserve`, never released
            // (it is still listed), with every granule unmapped just above; freed once.
            let _ = unsafe { sys::cuMemAddressFree(base, size) };
        }
    }
}

/// The properties of graft's physical allocations on device `cu_device`: pinned device memory,
/// no exportable handle.
fn alloc_prop(cu_device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: cu_device,
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

/// The driver's recommended granularity for graft's allocations on `cu_device`, at least 512
/// (a power of two, so a multiple of 512, as the `Device` trait promises).
pub(crate) fn granularity(op: DeviceOp, cu_device: sys::CUdevice) -> Result<usize, DeviceError> {
    let prop = alloc_prop(cu_device);
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
    Ok(granularity.max(512))
}

/// The granules of `addr..addr+bytes`, which must be a non-empty range aligned to `gran`.
fn granules(
    op: DeviceOp,
    addr: DevicePtr,
    bytes: usize,
    gran: usize,
) -> Result<Vec<u64>, DeviceError> {
    if bytes == 0 || !bytes.is_multiple_of(gran) || !addr.0.is_multiple_of(gran as u64) {
        return Err(invalid_argument(
            op,
            "the range is empty or not aligned to the granularity",
        ));
    }
    Ok((0..bytes / gran)
        .map(|i| addr.0 + (i * gran) as u64)
        .collect())
}

impl Inner {
    /// `cuMemAddressReserve`, aligned to the granularity, in relaxed capture mode (legal during
    /// a capture).
    pub(crate) fn reserve(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::Reserve;
        if bytes == 0 || !bytes.is_multiple_of(self.granularity) {
            return Err(invalid_argument(
                op,
                "the size is not a positive multiple of the granularity",
            ));
        }
        self.enter(op)?;
        let mut vmm = self.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        let ptr = self.with_relaxed(op, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: the context is current; `ptr` is a valid out-pointer; a zero requested
            // address and flags ask for any suitably aligned range. Freed once, in
            // `release_reservation` or `Vmm::release`.
            let r = unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, self.granularity, 0, 0) };
            check_alloc(op, r, bytes)?;
            Ok(ptr)
        })?;
        vmm.reservations.insert(ptr, bytes);
        tracing::debug!(addr = %DevicePtr(ptr), bytes, "address range reserved");
        Ok(DevicePtr(ptr))
    }

    /// `cuMemAddressFree` of a whole reservation with nothing mapped in it.
    pub(crate) fn release_reservation(
        &self,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::ReleaseReservation;
        self.enter(op)?;
        let mut vmm = self.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if vmm.reservations.get(&addr.0) != Some(&bytes) {
            return Err(invalid_argument(
                op,
                "the range is not a reservation of this device",
            ));
        }
        let end = addr.0 + bytes as u64;
        if vmm.handles.keys().any(|&g| g >= addr.0 && g < end) {
            return Err(invalid_argument(
                op,
                "part of the reservation is still mapped",
            ));
        }
        // SAFETY: `addr`/`bytes` are exactly a live reservation of this device (checked above)
        // with nothing mapped in it; it is removed from the list below, so freed once.
        check(op, unsafe { sys::cuMemAddressFree(addr.0, bytes) })?;
        vmm.reservations.remove(&addr.0);
        tracing::debug!(%addr, bytes, "address range released");
        Ok(())
    }

    /// Per granule `cuMemCreate` and `cuMemMap`, then one `cuMemSetAccess` (read/write for this
    /// device) over the range, all in relaxed capture mode (legal during a capture). On failure
    /// what this call mapped is unmapped and released again.
    pub(crate) fn map(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Map;
        let gran = self.granularity;
        let granules = granules(op, addr, bytes, gran)?;
        let mut vmm = self.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if !vmm.inside_reservation(addr.0, bytes) {
            return Err(invalid_argument(
                op,
                "the range is not inside one reservation",
            ));
        }
        if granules.iter().any(|g| vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is already mapped"));
        }
        self.enter(op)?;
        let prop = alloc_prop(self.cu_device);
        let mut done: Vec<(u64, sys::CUmemGenericAllocationHandle)> =
            Vec::with_capacity(granules.len());
        let result = self.with_relaxed(op, || {
            for &g in &granules {
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: `handle` is a valid out-pointer; `prop` is a fully initialized
                // property struct that outlives the call; flags must be 0.
                let created = unsafe { sys::cuMemCreate(&mut handle, gran, &prop, 0) };
                check_alloc(op, created, bytes)?;
                // SAFETY: `g` is a granule-aligned, unmapped granule inside a live reservation
                // of this device (checked above, under the lock held across the calls);
                // `handle` is the `gran`-byte allocation just created; offset and flags 0.
                if let Err(e) = check(op, unsafe { sys::cuMemMap(g, gran, 0, handle, 0) }) {
                    // SAFETY: `handle` was just created and never mapped; released once.
                    let _ = unsafe { sys::cuMemRelease(handle) };
                    return Err(e);
                }
                done.push((g, handle));
            }
            let desc = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: every granule of `addr..addr+bytes` was just mapped above; `desc` is one
            // valid access descriptor that outlives the call, matching the count of 1.
            check(op, unsafe { sys::cuMemSetAccess(addr.0, bytes, &desc, 1) })
        });
        match result {
            Ok(()) => {
                vmm.handles.extend(done);
                tracing::debug!(%addr, bytes, "memory mapped");
                Ok(())
            }
            Err(e) => {
                for (g, handle) in done {
                    if let Err(undo) = self.unmap_granule(op, g, handle) {
                        // Keep what could not be undone listed, so teardown retries it.
                        tracing::debug!(error = %undo, granule = %DevicePtr(g), "undoing a map failed");
                        vmm.handles.insert(g, handle);
                    }
                }
                Err(e)
            }
        }
    }

    /// Synchronizes the device's streams (work that may still use the memory), then
    /// `cuMemUnmap` and `cuMemRelease` per granule. Every granule is attempted; the first error
    /// is returned after all of them, and a granule that failed stays mapped.
    pub(crate) fn unmap(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Unmap;
        let granules = granules(op, addr, bytes, self.granularity)?;
        let mut vmm = self.vmm.lock().unwrap_or_else(PoisonError::into_inner);
        if granules.iter().any(|g| !vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is not mapped"));
        }
        self.enter(op)?;
        self.sync(op, self.stream)?;
        #[cfg(feature = "test-support")]
        self.sync(op, self.side.stream)?;
        let mut first = Ok(());
        for g in granules {
            let Some(handle) = vmm.handles.remove(&g) else {
                continue;
            };
            if let Err(e) = self.unmap_granule(op, g, handle) {
                vmm.handles.insert(g, handle);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        tracing::debug!(%addr, bytes, "memory unmapped");
        first
    }

    /// Unmaps granule `addr` and releases its physical allocation `handle`.
    fn unmap_granule(
        &self,
        op: DeviceOp,
        addr: u64,
        handle: sys::CUmemGenericAllocationHandle,
    ) -> Result<(), DeviceError> {
        // SAFETY: `addr` is a granule this device mapped with `cuMemMap` (a key of
        // `Vmm::handles`, whose entry the caller removed), `granularity` bytes long, so the
        // range is exactly one mapping; work that could use it was synchronized or never ran.
        check(op, unsafe { sys::cuMemUnmap(addr, self.granularity) })?;
        // SAFETY: `handle` came from `cuMemCreate` for this granule and is released once, after
        // its only mapping is gone.
        check(op, unsafe { sys::cuMemRelease(handle) })
    }
}
