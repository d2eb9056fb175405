//! The RMS norm kernels: one block of 256 threads per row, striding over it, a fixed-order
//! block sum; the backward's weight gradient summed over rows by a second kernel, a block per
//! 32 columns whose 32 warps take every 32nd row and add their 32 sums in a fixed order (with
//! 8 warps, 16 blocks summing 4,096 rows of 512 took 63 µs on an H100).

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
/// Threads per block of the column sum: 32 warps (its `[32][32]` shared sums).
const SUM_THREADS: u32 = 1024;

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
        // each thread its strided columns), the column kernel out[total .. total + cols] (a
        // lane per column over ceil(cols / 32) blocks); both are launched below on the
        // device's stream, in that order, before anything reads either buffer.
        let out = unsafe { device.alloc::<T>(total + cols)? };
        // SAFETY: as above: every share is written by the row kernel before the column
        // kernel, later on the same stream, reads it.
        let shares = unsafe { device.alloc::<f32>(total)? };
        let suffix = T::DTYPE.as_str();
        let row_cfg = grid(rows, THREADS)?;
        let sum_cfg = grid(cols.div_ceil(32), SUM_THREADS)?;
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
        let dw = out.slice(total..).device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&shares_ptr).arg(&dw).arg(&rows).arg(&cols_u);
        let name = format!("graft_column_sum_{suffix}");
        // SAFETY: the arguments match `graft_column_sum_<dtype>(const float*, T*, unsigned
        // int, unsigned int)`: `shares` holds rows * cols elements, `dw` cols; the block is
        // 32 warps of 32 (the kernel's [32][32] shared sums); all live until the launch is
        // enqueued, and `shares` is freed after it in stream order.
        unsafe { KERNELS.launch(device, &stream, &name, sum_cfg, false, &mut args) }?;
        Ok(out)
    }
}
