//! The RMS norm kernels: one block of 256 threads per row, striding over it 16 bytes at a time
//! (an element at a time where the row length or a pointer does not allow it), a fixed-order
//! block sum; the backward's weight gradient summed over rows in two more passes, each in a
//! fixed order: partial sums over chunks of [`SUM_CHUNK`] rows (a block of 8 warps per 32
//! columns and chunk), then a thread per column adding its chunks' sums. (One pass of a block
//! per 32 columns over all rows left most of the GPU idle: 32 blocks for 4,096 rows of 1,024
//! took 18.5 µs on an H200.)

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map2, Map3};
use candle_core::{CudaStorage, Layout, Result, Shape, Tensor, WithDType};

use super::OP;
use crate::check;
use crate::nvrtc::{Args, Kernels, address, view};

/// Threads per block of the row kernels.
const THREADS: u32 = 256;
/// Threads per block of the column partials: 8 warps (their `[8][32]` shared sums).
const SUM_THREADS: u32 = 256;
/// Rows a column partial sums.
const SUM_CHUNK: usize = 256;

static KERNELS: Kernels = Kernels::new("graft_kernels_rms_norm", include_str!("rms_norm.cu"));

fn grid(blocks: usize, threads: u32) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (check::u32_of(OP, "the grid", blocks)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn forward(
    eps: f32,
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = Forward { eps }.map(&x.slice, xl, &w.slice, wl, &device)?;
    Ok((CudaStorage { slice, device }, xl.shape().clone()))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    eps: f32,
    res: Option<&Tensor>,
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    dy: &CudaStorage,
    dyl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = Backward { eps, res }.map(&x.slice, xl, &w.slice, wl, &dy.slice, dyl, &device)?;
    let len = xl.shape().elem_count() + wl.shape().elem_count();
    Ok((CudaStorage { slice, device }, Shape::from(len)))
}

struct Forward {
    eps: f32,
}

impl Map2 for Forward {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        xl: &Layout,
        w: &CudaSlice<T>,
        wl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let total = xl.shape().elem_count();
        let cols = wl.shape().elem_count();
        let x = view(OP, "x", x, xl)?;
        let w = view(OP, "weight", w, wl)?;
        // SAFETY: block `row` writes the `cols` elements of its row and the grid has one block
        // per row, so all `total` are written by the kernel launched below on the device's
        // stream, which orders every later use of the output.
        let y = unsafe { device.alloc::<T>(total)? };
        let name = format!("graft_rms_norm_{}", T::DTYPE.as_str());
        let cfg = grid(total / cols, THREADS)?;
        let cols = check::u32_of(OP, "the row length", cols)?;
        let stream = device.cuda_stream();
        let [x, w, y_ptr] = [
            x.device_ptr(&stream).0,
            w.device_ptr(&stream).0,
            y.device_ptr(&stream).0,
        ];
        let mut args = Args::new();
        args.arg(&x).arg(&w).arg(&y_ptr).arg(&cols).arg(&self.eps);
        // SAFETY: the arguments match `graft_rms_norm_<dtype>(const T*, const T*, T*, unsigned
        // int, float)` with T the storage's dtype: `x` and `y` hold rows * cols elements,
        // `w` cols (checked by the wrapper); the block is 8 whole warps (the block sum's
        // shuffles use all lanes); all live until the launch is enqueued.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(y)
    }
}

struct Backward<'a> {
    eps: f32,
    /// The residual stream's gradient added into dx (contiguous, x's shape and dtype).
    res: Option<&'a Tensor>,
}

impl Map3 for Backward<'_> {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        xl: &Layout,
        w: &CudaSlice<T>,
        wl: &Layout,
        dy: &CudaSlice<T>,
        dyl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let total = xl.shape().elem_count();
        let cols = wl.shape().elem_count();
        let rows = total / cols;
        let x = view(OP, "x", x, xl)?;
        let w = view(OP, "weight", w, wl)?;
        let dy = view(OP, "dy", dy, dyl)?;
        // SAFETY: the row kernel writes out[0 .. total] and every share (a block per row,
        // each thread its strided columns), the column sum out[total .. total + cols] (a
        // thread per column); they are launched below on the device's stream, in that order,
        // before anything reads either buffer.
        let out = unsafe { device.alloc::<T>(total + cols)? };
        // SAFETY: as above: every share is written by the row kernel before the column
        // partials, later on the same stream, read it.
        let shares = unsafe { device.alloc::<f32>(total)? };
        let parts = rows.div_ceil(SUM_CHUNK).max(1);
        // SAFETY: the partials kernel writes every (chunk, column) pair (a block per 32
        // columns and chunk, lane = column) before the column sum, later on the same stream,
        // reads them.
        let partials = unsafe { device.alloc::<f32>(parts * cols)? };
        let suffix = T::DTYPE.as_str();
        let row_cfg = grid(rows, THREADS)?;
        let parts_cfg = LaunchConfig {
            grid_dim: (
                check::u32_of(OP, "the column blocks", cols.div_ceil(32))?,
                check::u32_of(OP, "the row chunks", parts)?,
                1,
            ),
            block_dim: (SUM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let sum_cfg = grid(cols.div_ceil(THREADS as usize), THREADS)?;
        let chunk = SUM_CHUNK as u32;
        let parts = parts as u32;
        let rows = check::u32_of(OP, "the row count", rows)?;
        let cols_u = check::u32_of(OP, "the row length", cols)?;
        let stream = device.cuda_stream();
        let [x, w, dy, out_ptr, shares_ptr] = [
            x.device_ptr(&stream).0,
            w.device_ptr(&stream).0,
            dy.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
            shares.device_ptr(&stream).0,
        ];
        let res_ptr = match self.res {
            Some(r) => address(OP, r, "the residual gradient", device)?,
            None => 0,
        };
        let mut args = Args::new();
        args.arg(&x)
            .arg(&w)
            .arg(&dy)
            .arg(&res_ptr)
            .arg(&out_ptr)
            .arg(&shares_ptr)
            .arg(&cols_u)
            .arg(&self.eps);
        let name = format!("graft_rms_norm_backward_{suffix}");
        // SAFETY: the arguments match `graft_rms_norm_backward_<dtype>(const T*, const T*,
        // const T*, const T*, T*, float*, unsigned int, float)`: `x`, `dy`, `shares` and the
        // residual (or null, which the kernel never reads) hold rows * cols elements, `w`
        // cols, `out` rows * cols + cols; 8 whole warps a block; all live until the launch is
        // enqueued.
        unsafe { KERNELS.launch(device, &stream, &name, row_cfg, false, &mut args) }?;
        let partials_ptr = partials.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&shares_ptr)
            .arg(&partials_ptr)
            .arg(&rows)
            .arg(&cols_u)
            .arg(&chunk);
        // SAFETY: the arguments match `graft_column_partials(const float*, float*, unsigned
        // int x3)`: `shares` holds rows * cols elements, `partials` parts * cols, the grid's y
        // is parts = ceil(rows / chunk) and its x covers cols in 32s; the block is 8 warps of
        // 32 (the kernel's [8][32] shared sums); all live until the launch is enqueued, and
        // `shares` is freed after it in stream order.
        unsafe {
            KERNELS.launch(
                device,
                &stream,
                "graft_column_partials",
                parts_cfg,
                false,
                &mut args,
            )
        }?;
        let dw = out.slice(total..).device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&partials_ptr).arg(&dw).arg(&parts).arg(&cols_u);
        let name = format!("graft_column_sum_{suffix}");
        // SAFETY: the arguments match `graft_column_sum_<dtype>(const float*, T*, unsigned
        // int, unsigned int)`: `partials` holds parts * cols elements, `dw` cols, and thread
        // i < cols reads column i of each part; all live until the launch is enqueued, and
        // `partials` is freed after it in stream order.
        unsafe { KERNELS.launch(device, &stream, &name, sum_cfg, false, &mut args) }?;
        Ok(out)
    }
}
