//! The embedding kernels: the gather, one thread per output element; the backward, each row's
//! id count first (a thread per id), then a block of 8 warps per table row that writes zeros
//! for a row no id names, and otherwise reads the ids 256 at a time until it has found the
//! row's tokens (a ballot per warp) and adds their gradients in token order, up to 2,048
//! columns per pass held in registers (8 a thread). The sum is in token order either way, so
//! the counts change the time and not the bits.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, Layout, Result, WithDType};

use super::OP;
use crate::nvrtc::{Args, Kernels, view};
use crate::{KernelError, check};

/// Threads per block (the backward's 8 warps, whose masks it keeps in shared memory).
const THREADS: u32 = 256;

static KERNELS: Kernels = Kernels::new("graft_kernels_embedding", include_str!("embedding.cu"));

fn ids_of<'a>(ids: &'a CudaStorage, il: &Layout) -> Result<CudaView<'a, u32>> {
    match &ids.slice {
        CudaStorageSlice::U32(s) => view(OP, "ids", s, il),
        _ => Err(KernelError::IndexDType {
            op: OP,
            input: "ids",
            got: candle_core::backend::BackendStorage::dtype(ids),
        }
        .into()),
    }
}

fn dtype_error(s: &CudaStorage) -> candle_core::Error {
    KernelError::UnsupportedDType {
        op: OP,
        input: "table",
        got: candle_core::backend::BackendStorage::dtype(s),
    }
    .into()
}

/// The gathered rows.
pub(super) fn gather(
    table: &CudaStorage,
    tl: &Layout,
    ids: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    let device = table.device.clone();
    let ids = ids_of(ids, il)?;
    let (vocab, d) = tl.shape().dims2()?;
    let slice = match &table.slice {
        CudaStorageSlice::F32(t) => {
            CudaStorageSlice::F32(launch_gather(&device, t, tl, &ids, vocab, d)?)
        }
        CudaStorageSlice::BF16(t) => {
            CudaStorageSlice::BF16(launch_gather(&device, t, tl, &ids, vocab, d)?)
        }
        CudaStorageSlice::F16(t) => {
            CudaStorageSlice::F16(launch_gather(&device, t, tl, &ids, vocab, d)?)
        }
        _ => return Err(dtype_error(table)),
    };
    Ok(CudaStorage { slice, device })
}

fn launch_gather<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    table: &CudaSlice<T>,
    tl: &Layout,
    ids: &CudaView<'_, u32>,
    vocab: usize,
    d: usize,
) -> Result<CudaSlice<T>> {
    let table = view(OP, "table", table, tl)?;
    let total = ids.len() * d;
    // SAFETY: thread i writes out[i] and the grid covers `total`, so every element is
    // written by the kernel launched below on the device's stream before anything reads it.
    let out = unsafe { device.alloc::<T>(total)? };
    let name = format!("graft_embedding_{}", T::DTYPE.as_str());
    let blocks = check::u32_of(OP, "the output / 256", total.div_ceil(THREADS as usize))?;
    let (total, vocab, d) = (total as u64, vocab as u32, d as u32);
    let stream = device.cuda_stream();
    let table = table.device_ptr(&stream).0;
    let ids = ids.device_ptr(&stream).0;
    let out_ptr = out.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&table)
        .arg(&ids)
        .arg(&out_ptr)
        .arg(&total)
        .arg(&vocab)
        .arg(&d);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_embedding_<dtype>(const T*, const unsigned int*, T*,
    // unsigned long long, unsigned int, unsigned int)`: `table` holds vocab * d elements and
    // is read only at an id below vocab, `ids` total / d, `out` total; all live until the
    // launch is enqueued.
    unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
    Ok(out)
}

/// The table's gradient, `[vocab, d]`.
pub(super) fn scatter(
    vocab: usize,
    d: usize,
    dy: &CudaStorage,
    dl: &Layout,
    ids: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    let device = dy.device.clone();
    let ids = ids_of(ids, il)?;
    let slice = match &dy.slice {
        CudaStorageSlice::F32(g) => {
            CudaStorageSlice::F32(launch_scatter(&device, g, dl, &ids, vocab, d)?)
        }
        CudaStorageSlice::BF16(g) => {
            CudaStorageSlice::BF16(launch_scatter(&device, g, dl, &ids, vocab, d)?)
        }
        CudaStorageSlice::F16(g) => {
            CudaStorageSlice::F16(launch_scatter(&device, g, dl, &ids, vocab, d)?)
        }
        _ => return Err(dtype_error(dy)),
    };
    Ok(CudaStorage { slice, device })
}

fn launch_scatter<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    dy: &CudaSlice<T>,
    dl: &Layout,
    ids: &CudaView<'_, u32>,
    vocab: usize,
    d: usize,
) -> Result<CudaSlice<T>> {
    let dy = view(OP, "dy", dy, dl)?;
    let n = check::u32_of(OP, "the id count", ids.len())?;
    let rows = check::u32_of(OP, "the vocabulary", vocab)?;
    let counts = device.alloc_zeros::<u32>(vocab)?;
    let stream = device.cuda_stream();
    let ids = ids.device_ptr(&stream).0;
    let counts_ptr = counts.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&ids).arg(&counts_ptr).arg(&n).arg(&rows);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(THREADS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_embedding_counts(const unsigned int*, unsigned int*,
    // unsigned int, unsigned int)`: `ids` holds n ids, `counts` vocab zeroed u32, and thread
    // t < n adds one to counts[ids[t]] only for an id below vocab; both live until the launch
    // is enqueued.
    unsafe {
        KERNELS.launch(
            device,
            &stream,
            "graft_embedding_counts",
            cfg,
            false,
            &mut args,
        )
    }?;

    // SAFETY: block v writes the d elements of row v (every column, in passes of 2,048) and
    // the grid has a block per row, so all vocab * d are written by the kernel launched
    // below on the device's stream before anything reads them.
    let out = unsafe { device.alloc::<T>(vocab * d)? };
    let name = format!("graft_embedding_backward_{}", T::DTYPE.as_str());
    let d = d as u32;
    let dy = dy.device_ptr(&stream).0;
    let out_ptr = out.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&dy)
        .arg(&ids)
        .arg(&counts_ptr)
        .arg(&out_ptr)
        .arg(&n)
        .arg(&d);
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_embedding_backward_<dtype>(const T*, const unsigned
    // int*, const unsigned int*, T*, unsigned int, unsigned int)`: `dy` holds n * d elements
    // (the forward's output shape), `ids` n, `counts` vocab (each row's number of ids,
    // counted just before on the same stream), `out` vocab * d; the block is exactly 8 warps
    // (the kernel's 8 masks, its full-warp ballots); all live until the launch is enqueued.
    unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
    Ok(out)
}
