//! CUDA's graph memory pool, where candle's allocations inside a recorded step live: what it
//! holds (`cuDeviceGetGraphMemAttribute`) and giving its unused memory back (graft-cuda's
//! `CudaDevice::trim_graph_memory`); and the default pool of candle's eager allocations.

use std::ffi::c_void;

use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::sys;
use graft_cuda::CudaDevice as GraftCuda;

use super::driver;
use crate::error::Error;
use crate::memory::{EagerMemory, GraphMemory};

/// The graph memory figures of `device`'s GPU.
pub fn graph_memory(device: &CudaDevice) -> Result<GraphMemory, Error> {
    let stream = device.cuda_stream();
    let cu_device = stream.context().cu_device();
    let get = |attr: sys::CUgraphMem_attribute| -> Result<u64, Error> {
        let mut value: u64 = 0;
        // SAFETY: `cu_device` is the device of a live context; the four attributes queried
        // here are each a cuuint64_t, which `value` is.
        unsafe {
            sys::cuDeviceGetGraphMemAttribute(cu_device, attr, (&raw mut value).cast::<c_void>())
        }
        .result()
        .map_err(driver(
            "reading the graph memory figures (cuDeviceGetGraphMemAttribute)",
        ))?;
        Ok(value)
    };
    use sys::CUgraphMem_attribute as A;
    Ok(GraphMemory {
        used_current: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
        used_high: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
        mapped_current: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
        mapped_high: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
    })
}

/// Synchronizes candle's stream, then gives the graph memory no graph uses back to the OS
/// (graft-cuda's `CudaDevice::trim_graph_memory`) and resets the two high-water marks, so the next figures
/// describe what the live graphs hold.
pub fn trim_graph_memory(device: &CudaDevice) -> Result<(), Error> {
    let stream = device.cuda_stream();
    stream
        .synchronize()
        .map_err(driver("synchronizing candle's stream"))?;
    let cu_device = stream.context().cu_device();
    GraftCuda::from_stream(stream)
        .and_then(|graft| graft.trim_graph_memory())
        .map_err(|source| Error::Device {
            what: "trimming graph memory (cuDeviceGraphMemTrim through graft-cuda)",
            source,
        })?;
    use sys::CUgraphMem_attribute as A;
    for attr in [
        A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
        A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: the high-water attributes are cuuint64_t and may only be set to 0, which
        // `zero` is.
        unsafe {
            sys::cuDeviceSetGraphMemAttribute(cu_device, attr, (&raw mut zero).cast::<c_void>())
        }
        .result()
        .map_err(driver(
            "resetting the graph memory high-water marks (cuDeviceSetGraphMemAttribute)",
        ))?;
    }
    Ok(())
}

/// The device memory free and in total, in bytes (`cuMemGetInfo`), after synchronizing
/// candle's stream (so memory freed by finished work is back).
pub fn free_memory(device: &CudaDevice) -> Result<(u64, u64), Error> {
    let stream = device.cuda_stream();
    stream
        .synchronize()
        .map_err(driver("synchronizing candle's stream"))?;
    stream
        .context()
        .bind_to_thread()
        .map_err(driver("binding candle's context"))?;
    let (free, total) = candle_core::cuda_backend::cudarc::driver::result::mem_get_info()
        .map_err(driver("reading the free memory (cuMemGetInfo)"))?;
    Ok((free as u64, total as u64))
}

fn default_pool(device: &CudaDevice) -> Result<sys::CUmemoryPool, Error> {
    let cu_device = device.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `cu_device` is the device of a live context and `pool` a valid out-pointer.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device) }
        .result()
        .map_err(driver(
            "finding the device's default memory pool (cuDeviceGetDefaultMemPool)",
        ))?;
    Ok(pool)
}

/// The default pool's figures of `device`'s GPU.
pub fn eager_memory(device: &CudaDevice) -> Result<EagerMemory, Error> {
    let pool = default_pool(device)?;
    let get = |attr: sys::CUmemPool_attribute| -> Result<u64, Error> {
        let mut value: u64 = 0;
        // SAFETY: `pool` is the live default pool of the device; both attributes queried
        // here are cuuint64_t, which `value` is.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast::<c_void>()) }
            .result()
            .map_err(driver(
                "reading the default memory pool's figures (cuMemPoolGetAttribute)",
            ))?;
        Ok(value)
    };
    use sys::CUmemPool_attribute as A;
    Ok(EagerMemory {
        used_current: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        used_high: get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    })
}

/// Synchronizes candle's stream and resets the default pool's high-water mark to what is in
/// use now.
pub fn reset_eager_high(device: &CudaDevice) -> Result<(), Error> {
    device
        .cuda_stream()
        .synchronize()
        .map_err(driver("synchronizing candle's stream"))?;
    let pool = default_pool(device)?;
    let mut zero: u64 = 0;
    // SAFETY: the high-water attribute is a cuuint64_t that may only be set to 0, which
    // `zero` is; `pool` is the device's live default pool.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&raw mut zero).cast::<c_void>(),
        )
    }
    .result()
    .map_err(driver(
        "resetting the default memory pool's high-water mark (cuMemPoolSetAttribute)",
    ))
}
