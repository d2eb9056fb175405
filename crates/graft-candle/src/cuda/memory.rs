//! CUDA's graph memory pool, where candle's allocations inside a recorded step live: what it
//! holds (`cuDeviceGetGraphMemAttribute`) and giving its unused memory back (graft-cuda's
//! `CudaDevice::trim_graph_memory`); and the default pool of candle's eager allocations.

use candle_core::cuda_backend::CudaDevice;
use graft_cuda::CudaDevice as GraftCuda;

use super::driver;
use crate::error::Error;
use crate::memory::{EagerMemory, GraphMemory};

/// graft-cuda's device over candle's stream, whose driver floor reads and resets the figures.
fn graft_device(device: &CudaDevice, what: &'static str) -> Result<GraftCuda, Error> {
    GraftCuda::from_stream(device.cuda_stream()).map_err(|source| Error::Device { what, source })
}

/// The graph memory figures of `device`'s GPU.
pub fn graph_memory(device: &CudaDevice) -> Result<GraphMemory, Error> {
    let what = "reading the graph memory figures (cuDeviceGetGraphMemAttribute)";
    let f = graft_device(device, what)?
        .graph_memory()
        .map_err(|source| Error::Device { what, source })?;
    Ok(GraphMemory {
        used_current: f.used_current,
        used_high: f.used_high,
        mapped_current: f.reserved_current,
        mapped_high: f.reserved_high,
    })
}

/// Synchronizes candle's stream, then gives the graph memory no graph uses back to the OS
/// (graft-cuda's `CudaDevice::trim_graph_memory`) and resets the two high-water marks, so the next figures
/// describe what the live graphs hold.
pub fn trim_graph_memory(device: &CudaDevice) -> Result<(), Error> {
    device
        .cuda_stream()
        .synchronize()
        .map_err(driver("synchronizing candle's stream"))?;
    let what = "trimming graph memory and resetting its high-water marks";
    let graft = graft_device(device, what)?;
    graft
        .trim_graph_memory()
        .and_then(|()| graft.reset_graph_memory_high())
        .map_err(|source| Error::Device { what, source })
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

/// The default pool's figures of `device`'s GPU.
pub fn eager_memory(device: &CudaDevice) -> Result<EagerMemory, Error> {
    let what = "reading the default memory pool's figures (cuMemPoolGetAttribute)";
    let f = graft_device(device, what)?
        .default_pool_memory()
        .map_err(|source| Error::Device { what, source })?;
    Ok(EagerMemory {
        used_current: f.used_current,
        used_high: f.used_high,
    })
}

/// Synchronizes candle's stream and resets the default pool's high-water marks to what is in
/// use now.
pub fn reset_eager_high(device: &CudaDevice) -> Result<(), Error> {
    device
        .cuda_stream()
        .synchronize()
        .map_err(driver("synchronizing candle's stream"))?;
    let what = "resetting the default memory pool's high-water marks (cuMemPoolSetAttribute)";
    graft_device(device, what)?
        .reset_default_pool_high()
        .map_err(|source| Error::Device { what, source })
}
