//! [`Vmm`], pool memory through CUDA's virtual memory management: the device's granularity, reserving address ranges, mapping and unmapping granules, releasing reservations, and what is left at teardown.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::context::Context;
use crate::driver;
use crate::error::invalid_argument;

/// A device's pool memory: its physical granularity and what it has reserved and mapped.
pub(crate) struct Vmm {
    /// The device the physical allocations are made on.
    cu_device: sys::CUdevice,
    /// The physical mapping granularity (the driver's recommended granularity for this device).
    granularity: usize,
    /// Reservations and mapped granules, for validation and teardown.
    state: Mutex<Mapped>,
}

/// What the device has reserved and mapped for graft's pools.
#[derive(Default)]
struct Mapped {
    /// Base -> size of each live reservation.
    reservations: BTreeMap<u64, usize>,
    /// Address of each mapped granule -> its physical allocation.
    handles: HashMap<u64, sys::CUmemGenericAllocationHandle>,
}

impl Mapped {
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

impl Vmm {
    /// The pool memory of `cu_device`, whose granularity is read from the driver: its
    /// recommended granularity, at least 512 (a power of two, so a multiple of 512, as the
    /// `Device` trait promises).
    pub(crate) fn new(op: DeviceOp, cu_device: sys::CUdevice) -> Result<Vmm, DeviceError> {
        Ok(Vmm {
            cu_device,
            granularity: driver::memory::granularity(op, cu_device)?.max(512),
            state: Mutex::default(),
        })
    }

    /// The physical mapping granularity.
    pub(crate) fn granularity(&self) -> usize {
        self.granularity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mapped> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `cuMemAddressReserve`, aligned to the granularity, in relaxed capture mode (legal during
    /// a capture).
    pub(crate) fn reserve(&self, cx: &Context, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let op = DeviceOp::Reserve;
        if bytes == 0 || !bytes.is_multiple_of(self.granularity) {
            return Err(invalid_argument(
                op,
                "the size is not a positive multiple of the granularity",
            ));
        }
        cx.enter(op)?;
        let mut vmm = self.lock();
        // Freed once, in `release_reservation` or `Vmm::release`.
        let ptr = cx.with_relaxed(op, || {
            driver::memory::address_reserve(op, bytes, self.granularity)
        })?;
        vmm.reservations.insert(ptr, bytes);
        tracing::debug!(addr = %DevicePtr(ptr), bytes, "address range reserved");
        Ok(DevicePtr(ptr))
    }

    /// `cuMemAddressFree` of a whole reservation with nothing mapped in it.
    pub(crate) fn release_reservation(
        &self,
        cx: &Context,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::ReleaseReservation;
        cx.enter(op)?;
        let mut vmm = self.lock();
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
        // Exactly a live reservation with nothing mapped in it (checked above); removed from
        // the list below, so freed once.
        driver::memory::address_free(op, addr.0, bytes)?;
        vmm.reservations.remove(&addr.0);
        tracing::debug!(%addr, bytes, "address range released");
        Ok(())
    }

    /// Per granule `cuMemCreate` and `cuMemMap`, then one `cuMemSetAccess` (read/write for this
    /// device) over the range, all in relaxed capture mode (legal during a capture). On failure
    /// what this call mapped is unmapped and released again.
    pub(crate) fn map(
        &self,
        cx: &Context,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::Map;
        let gran = self.granularity;
        let granules = granules(op, addr, bytes, gran)?;
        let mut vmm = self.lock();
        if !vmm.inside_reservation(addr.0, bytes) {
            return Err(invalid_argument(
                op,
                "the range is not inside one reservation",
            ));
        }
        if granules.iter().any(|g| vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is already mapped"));
        }
        cx.enter(op)?;
        let mut done: Vec<(u64, sys::CUmemGenericAllocationHandle)> =
            Vec::with_capacity(granules.len());
        let result = cx.with_relaxed(op, || {
            for &g in &granules {
                let handle = driver::memory::create(op, self.cu_device, gran, bytes)?;
                // `g` is a granule-aligned, unmapped granule inside a live reservation of this
                // device (checked above, under the lock held across the calls).
                if let Err(e) = driver::memory::map(op, g, gran, handle) {
                    // Just created and never mapped: released once.
                    let _ = driver::memory::release(op, handle);
                    return Err(e);
                }
                done.push((g, handle));
            }
            driver::memory::set_access(op, self.cu_device, addr.0, bytes)
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

    /// Runs `settle` (synchronizes the device's streams: work that may still use the memory),
    /// then `cuMemUnmap` and `cuMemRelease` per granule. Every granule is attempted; the first
    /// error is returned after all of them, and a granule that failed stays mapped.
    pub(crate) fn unmap(
        &self,
        cx: &Context,
        addr: DevicePtr,
        bytes: usize,
        settle: impl FnOnce(DeviceOp) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::Unmap;
        let granules = granules(op, addr, bytes, self.granularity)?;
        let mut vmm = self.lock();
        if granules.iter().any(|g| !vmm.handles.contains_key(g)) {
            return Err(invalid_argument(op, "part of the range is not mapped"));
        }
        cx.enter(op)?;
        settle(op)?;
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
        // `addr` is a granule this device mapped (a key of `Mapped::handles`, whose entry the
        // caller removed), `granularity` bytes long, so the range is exactly one mapping; work
        // that could use it was synchronized or never ran.
        driver::memory::unmap(op, addr, self.granularity)?;
        // Released once, after its only mapping is gone.
        driver::memory::release(op, handle)
    }

    /// Unmaps every granule and frees every reservation still listed (memory pools did not
    /// give back: a runtime leaked, or a test stopped early). Errors are ignored: this only
    /// runs when the device is dropped, after its streams were synchronized.
    pub(crate) fn release(&mut self) {
        let mapped = std::mem::take(self.state.get_mut().unwrap_or_else(PoisonError::into_inner));
        for (addr, handle) in mapped.handles {
            let _ = self.unmap_granule(DeviceOp::Unmap, addr, handle);
        }
        for (base, size) in mapped.reservations {
            // Never released (still listed), with every granule unmapped just above.
            let _ = driver::memory::address_free(DeviceOp::Unmap, base, size);
        }
    }
}
