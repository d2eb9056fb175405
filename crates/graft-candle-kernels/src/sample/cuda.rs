//! The sampling kernel's launch: `sample.cu` after graft-philox's generator, compiled with
//! NVRTC once per process, one block of 1,024 threads per row (NVRTC's PTX under ptxas for
//! sm_90: 52 registers a thread, no spills, 37,168 bytes of static shared memory; one block a
//! multiprocessor).

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::OP;
use crate::nvrtc::{Args, Kernels, view};
use crate::{KernelError, check};

/// Threads per block (the kernel's `__launch_bounds__`).
const THREADS: u32 = 1024;

static KERNELS: Kernels = Kernels::new(
    "graft_kernels_sample",
    concat!(graft_philox::philox_cu!(), include_str!("sample.cu")),
);

/// The `[rows]` u32 tokens on CUDA.
pub(super) fn forward(
    vocab: usize,
    logits: &CudaStorage,
    ll: &Layout,
    params: &CudaStorage,
    pl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = logits.device.clone();
    let CudaStorageSlice::U32(p) = &params.slice else {
        return Err(KernelError::IndexDType {
            op: OP,
            input: "params",
            got: candle_core::backend::BackendStorage::dtype(params),
        }
        .into());
    };
    let params = view(OP, "params", p, pl)?;
    let rows = ll.shape().elem_count() / vocab;
    let out = match &logits.slice {
        CudaStorageSlice::F32(x) => launch(&device, x, ll, &params, rows, vocab)?,
        CudaStorageSlice::BF16(x) => launch(&device, x, ll, &params, rows, vocab)?,
        CudaStorageSlice::F16(x) => launch(&device, x, ll, &params, rows, vocab)?,
        _ => {
            return Err(KernelError::UnsupportedDType {
                op: OP,
                input: "logits",
                got: candle_core::backend::BackendStorage::dtype(logits),
            }
            .into());
        }
    };
    let slice = CudaStorageSlice::U32(out);
    Ok((CudaStorage { slice, device }, Shape::from_dims(&[rows])))
}

fn launch<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    x: &CudaSlice<T>,
    xl: &Layout,
    params: &CudaView<'_, u32>,
    rows: usize,
    vocab: usize,
) -> Result<CudaSlice<u32>> {
    let x = view(OP, "logits", x, xl)?;
    // SAFETY: the kernel writes all `rows` tokens (one block per row, thread 0 of each, on
    // every path) before anything reads them: it is launched below on the device's stream.
    let out = unsafe { device.alloc::<u32>(rows)? };
    let name = format!("graft_sample_{}", T::DTYPE.as_str());
    let grid = check::u32_of(OP, "the row count", rows)?;
    let n = check::u32_of(OP, "the vocabulary", vocab)?;
    let stream = device.cuda_stream();
    let x_ptr = x.device_ptr(&stream).0;
    let params_ptr = params.device_ptr(&stream).0;
    let out_ptr = out.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&x_ptr).arg(&params_ptr).arg(&out_ptr).arg(&n);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_sample_<dtype>(const T*, const unsigned int*,
    // unsigned int*, unsigned int)` with T the logits' dtype: `x` holds rows * n elements
    // (contiguous, checked by the wrapper), `params` rows * 6 u32 and `out` rows u32; block r
    // reads only row r's n logits and 6 words and writes only token r; n < 2^24 (the wrapper's
    // bound, so the kernel's fixed-point sums fit 64 bits and its indices 24 bits); the block
    // is the 1,024 threads the kernel is built for, its shared memory static (under 48 KiB);
    // all live until the launch is enqueued.
    unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
    Ok(out)
}
