//! The cross-entropy kernels: a block of 256 threads per row (one pass: each thread's running
//! max and sum of exponentials, merged over the block in a fixed order), one block summing the
//! row losses, and a block per row for the gradient; rows read and written 16 bytes at a time
//! where the tensors' alignment allows.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, Layout, Result, Tensor, WithDType};

use super::OP;
use crate::nvrtc::{Args, Kernels, address, view};
use crate::{KernelError, check};

/// Threads per block.
const THREADS: u32 = 256;

static KERNELS: Kernels = Kernels::new(
    "graft_kernels_cross_entropy",
    include_str!("cross_entropy.cu"),
);

fn blocks(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (check::u32_of(OP, "the row count", n)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn targets_of<'a>(targets: &'a CudaStorage, tl: &Layout) -> Result<CudaView<'a, u32>> {
    match &targets.slice {
        CudaStorageSlice::U32(t) => view(OP, "targets", t, tl),
        _ => Err(KernelError::IndexDType {
            op: OP,
            input: "targets",
            got: candle_core::backend::BackendStorage::dtype(targets),
        }
        .into()),
    }
}

/// The mean (`[1]` f32) and the saved rows (`[2 * rows]` f32: losses, then log-sum-exps).
pub(super) fn forward(
    rows: usize,
    vocab: usize,
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
) -> Result<(CudaStorage, CudaStorage)> {
    let device = logits.device.clone();
    let t = targets_of(targets, tl)?;
    // SAFETY: block `row` of the row kernel writes saved[row] and saved[rows + row] and the
    // grid has a block per row; the mean kernel, after it on the device's stream, writes
    // out[0]; nothing reads either before those launches.
    let saved = unsafe { device.alloc::<f32>(2 * rows)? };
    // SAFETY: as above.
    let mean = unsafe { device.alloc::<f32>(1)? };
    let (rows_u, vocab_u) = (rows as u32, vocab as u32);
    match &logits.slice {
        CudaStorageSlice::F32(l) => launch_rows(&device, l, ll, &t, &saved, rows_u, vocab_u)?,
        CudaStorageSlice::BF16(l) => launch_rows(&device, l, ll, &t, &saved, rows_u, vocab_u)?,
        CudaStorageSlice::F16(l) => launch_rows(&device, l, ll, &t, &saved, rows_u, vocab_u)?,
        _ => return Err(dtype_error(logits)),
    }
    let stream = device.cuda_stream();
    let saved_ptr = saved.device_ptr(&stream).0;
    let mean_ptr = mean.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&saved_ptr).arg(&mean_ptr).arg(&rows_u);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_cross_entropy_mean(const float*, float*, unsigned
    // int)`: `saved` holds at least `rows` losses, `mean` one float; one block of 8 whole
    // warps; all live until the launch is enqueued.
    unsafe {
        KERNELS.launch(
            &device,
            &stream,
            "graft_cross_entropy_mean",
            cfg,
            false,
            &mut args,
        )
    }?;
    Ok((
        CudaStorage {
            slice: CudaStorageSlice::F32(mean),
            device: device.clone(),
        },
        CudaStorage {
            slice: CudaStorageSlice::F32(saved),
            device,
        },
    ))
}

fn dtype_error(logits: &CudaStorage) -> candle_core::Error {
    KernelError::UnsupportedDType {
        op: OP,
        input: "logits",
        got: candle_core::backend::BackendStorage::dtype(logits),
    }
    .into()
}

fn launch_rows<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    logits: &CudaSlice<T>,
    ll: &Layout,
    targets: &CudaView<'_, u32>,
    saved: &CudaSlice<f32>,
    rows: u32,
    vocab: u32,
) -> Result<()> {
    let logits = view(OP, "logits", logits, ll)?;
    let name = format!("graft_cross_entropy_rows_{}", T::DTYPE.as_str());
    let stream = device.cuda_stream();
    let logits = logits.device_ptr(&stream).0;
    let targets = targets.device_ptr(&stream).0;
    let saved = saved.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&logits)
        .arg(&targets)
        .arg(&saved)
        .arg(&rows)
        .arg(&vocab);
    let cfg = blocks(rows as usize)?;
    // SAFETY: the arguments match `graft_cross_entropy_rows_<dtype>(const T*, const unsigned
    // int*, float*, unsigned int, unsigned int)`: `logits` holds rows * vocab elements,
    // `targets` rows, `saved` 2 * rows (checked by the wrapper and the caller); a target is
    // read only as an index below vocab; 8 whole warps a block; all live until the launch is
    // enqueued.
    unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
    Ok(())
}

/// The logits' gradient, in their dtype.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    rows: usize,
    vocab: usize,
    dloss: &Tensor,
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
    saved: &CudaStorage,
    sl: &Layout,
) -> Result<CudaStorage> {
    let device = logits.device.clone();
    let (t, saved, dloss) = backward_inputs(dloss, &device, targets, tl, saved, sl)?;
    let (rows, vocab) = (rows as u32, vocab as u32);
    let slice = match &logits.slice {
        CudaStorageSlice::F32(l) => {
            CudaStorageSlice::F32(into_new(&device, l, ll, &t, &saved, dloss, rows, vocab)?)
        }
        CudaStorageSlice::BF16(l) => {
            CudaStorageSlice::BF16(into_new(&device, l, ll, &t, &saved, dloss, rows, vocab)?)
        }
        CudaStorageSlice::F16(l) => {
            CudaStorageSlice::F16(into_new(&device, l, ll, &t, &saved, dloss, rows, vocab)?)
        }
        _ => return Err(dtype_error(logits)),
    };
    Ok(CudaStorage { slice, device })
}

/// The logits' gradient written over the logits (whole and contiguous: checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_in_place(
    rows: usize,
    vocab: usize,
    dloss: &Tensor,
    logits: &mut CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
    saved: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let device = logits.device.clone();
    let (t, saved, dloss) = backward_inputs(dloss, &device, targets, tl, saved, sl)?;
    let (rows, vocab) = (rows as u32, vocab as u32);
    let stream = device.cuda_stream();
    // The kernel reads each element before it writes it, in the same thread.
    match &logits.slice {
        CudaStorageSlice::F32(l) => {
            let at = l.device_ptr(&stream).0;
            launch_backward(&device, l, ll, &t, &saved, dloss, at, rows, vocab)
        }
        CudaStorageSlice::BF16(l) => {
            let at = l.device_ptr(&stream).0;
            launch_backward(&device, l, ll, &t, &saved, dloss, at, rows, vocab)
        }
        CudaStorageSlice::F16(l) => {
            let at = l.device_ptr(&stream).0;
            launch_backward(&device, l, ll, &t, &saved, dloss, at, rows, vocab)
        }
        _ => Err(dtype_error(logits)),
    }
}

/// The backward pass's targets, saved rows and the address of the loss's gradient.
fn backward_inputs<'a>(
    dloss: &Tensor,
    device: &CudaDevice,
    targets: &'a CudaStorage,
    tl: &Layout,
    saved: &'a CudaStorage,
    sl: &Layout,
) -> Result<(CudaView<'a, u32>, CudaView<'a, f32>, u64)> {
    let t = targets_of(targets, tl)?;
    let CudaStorageSlice::F32(saved) = &saved.slice else {
        return Err(dtype_error(saved));
    };
    let saved = view(OP, "saved", saved, sl)?;
    let dloss = address(OP, dloss, "dloss", device)?;
    Ok((t, saved, dloss))
}

/// The gradient of `logits` in a new allocation.
#[allow(clippy::too_many_arguments)]
fn into_new<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    logits: &CudaSlice<T>,
    ll: &Layout,
    targets: &CudaView<'_, u32>,
    saved: &CudaView<'_, f32>,
    dloss: u64,
    rows: u32,
    vocab: u32,
) -> Result<CudaSlice<T>> {
    // SAFETY: block `row` writes the `vocab` elements of its row and the grid has a block per
    // row, so all `rows * vocab` are written by the kernel launched below on the device's
    // stream before anything reads them.
    let out = unsafe { device.alloc::<T>(ll.shape().elem_count())? };
    let at = out.device_ptr(&device.cuda_stream()).0;
    launch_backward(device, logits, ll, targets, saved, dloss, at, rows, vocab)?;
    Ok(out)
}

/// Launches the gradient kernel from `logits` into `out`: `rows * vocab` elements of T at
/// `out`, every one written by the kernel (`out` may be the logits' own address).
#[allow(clippy::too_many_arguments)]
fn launch_backward<T: DeviceRepr + WithDType>(
    device: &CudaDevice,
    logits: &CudaSlice<T>,
    ll: &Layout,
    targets: &CudaView<'_, u32>,
    saved: &CudaView<'_, f32>,
    dloss: u64,
    out: u64,
    rows: u32,
    vocab: u32,
) -> Result<()> {
    let logits = view(OP, "logits", logits, ll)?;
    let name = format!("graft_cross_entropy_backward_{}", T::DTYPE.as_str());
    let stream = device.cuda_stream();
    let logits = logits.device_ptr(&stream).0;
    let targets = targets.device_ptr(&stream).0;
    let saved = saved.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&logits)
        .arg(&targets)
        .arg(&saved)
        .arg(&dloss)
        .arg(&out)
        .arg(&rows)
        .arg(&vocab);
    let cfg = blocks(rows as usize)?;
    // SAFETY: the arguments match `graft_cross_entropy_backward_<dtype>(const T*, const
    // unsigned int*, const float*, const float*, T*, unsigned int, unsigned int)`: `logits`
    // and `out` hold rows * vocab elements (the same ones, or disjoint: each element is read
    // and then written by one thread), `targets` rows, `saved` 2 * rows, `dloss` is the
    // address of the `[1]` f32 gradient the op holds (alive until the launch is enqueued); a
    // target is read only as an index below vocab; 8 whole warps a block.
    unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }
}
