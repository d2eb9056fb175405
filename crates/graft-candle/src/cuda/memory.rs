//! CUDA's graph memory pool, where candle's allocations inside a recorded step live: what it
//! holds (`cuDeviceGetGraphMemAttribute`) and giving its unused memory back
//! (`cuDeviceGraphMemTrim`).

use std::ffi::c_void;

use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::sys;

use crate::error::Error;

/// The device's graph memory figures, in bytes (CUDA's `CU_GRAPH_MEM_ATTR_*`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct GraphMemory {
    /// Memory currently associated with graphs (their allocations' physical backing).
    pub used_current: u64,
    /// The highest `used_current` since the last reset.
    pub used_high: u64,
    /// Physical memory the driver currently holds for graph allocations, used or not (CUDA
    /// calls it reserved memory; graft's word for physical memory behind addresses is mapped).
    pub mapped_current: u64,
    /// The highest `mapped_current` since the last reset.
    pub mapped_high: u64,
}

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
        .map_err(|source| Error::Driver {
            what: "reading the graph memory figures (cuDeviceGetGraphMemAttribute)",
            source,
        })?;
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
/// (`cuDeviceGraphMemTrim`) and resets the two high-water marks, so the next figures
/// describe what the live graphs hold.
pub fn trim_graph_memory(device: &CudaDevice) -> Result<(), Error> {
    let stream = device.cuda_stream();
    stream.synchronize().map_err(|source| Error::Driver {
        what: "synchronizing candle's stream",
        source,
    })?;
    let cu_device = stream.context().cu_device();
    // SAFETY: `cu_device` is the device of a live context; trimming only releases memory no
    // graph allocation uses.
    unsafe { sys::cuDeviceGraphMemTrim(cu_device) }
        .result()
        .map_err(|source| Error::Driver {
            what: "trimming graph memory (cuDeviceGraphMemTrim)",
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
        .map_err(|source| Error::Driver {
            what: "resetting the graph memory high-water marks (cuDeviceSetGraphMemAttribute)",
            source,
        })?;
    }
    Ok(())
}

/// The device memory free and in total, in bytes (`cuMemGetInfo`), after synchronizing
/// candle's stream (so memory freed by finished work is back).
pub fn free_memory(device: &CudaDevice) -> Result<(u64, u64), Error> {
    let stream = device.cuda_stream();
    let driver = |what| move |source| Error::Driver { what, source };
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

/// The device's default memory pool (where candle's eager allocations come from, through
/// `cuMemAllocAsync`): the bytes in use now and the most in use since the last
/// [`reset_eager_high`], which is how an eager step's peak is measured.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct EagerMemory {
    /// Bytes of the pool in use now.
    pub used_current: u64,
    /// The highest `used_current` since the last reset.
    pub used_high: u64,
}

fn default_pool(device: &CudaDevice) -> Result<sys::CUmemoryPool, Error> {
    let cu_device = device.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `cu_device` is the device of a live context and `pool` a valid out-pointer.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device) }
        .result()
        .map_err(|source| Error::Driver {
            what: "finding the device's default memory pool (cuDeviceGetDefaultMemPool)",
            source,
        })?;
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
            .map_err(|source| Error::Driver {
                what: "reading the default memory pool's figures (cuMemPoolGetAttribute)",
                source,
            })?;
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
        .map_err(|source| Error::Driver {
            what: "synchronizing candle's stream",
            source,
        })?;
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
    .map_err(|source| Error::Driver {
        what: "resetting the default memory pool's high-water mark (cuMemPoolSetAttribute)",
        source,
    })
}
