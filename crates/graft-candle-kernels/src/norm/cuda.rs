//! The add + RMS norm kernel: one block per row, enough whole warps for 8 elements a thread (at
//! most 1,024 threads), each holding its elements in registers (striding over longer rows); a
//! warp-then-block reduction of the squares; every load of a thread is issued before its first
//! store.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map3};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::{OP, packed_shape};
use crate::check;
use crate::nvrtc::{Args, Kernels, view};

/// The most threads a block of this kernel has.
const MAX_THREADS: usize = 1024;

static KERNELS: Kernels = Kernels::new(
    "graft_kernels_add_rms_norm",
    include_str!("add_rms_norm.cu"),
);

/// The op's packed output `[2, ...x's shape]` on CUDA.
pub(super) fn forward(
    eps: f32,
    x: &CudaStorage,
    xl: &Layout,
    r: &CudaStorage,
    rl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = AddRmsNorm { eps }.map(&x.slice, xl, &r.slice, rl, &w.slice, wl, &device)?;
    Ok((CudaStorage { slice, device }, packed_shape(xl)))
}

/// The kernel's launch over candle's dtype dispatch.
struct AddRmsNorm {
    eps: f32,
}

impl Map3 for AddRmsNorm {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        xl: &Layout,
        r: &CudaSlice<T>,
        rl: &Layout,
        w: &CudaSlice<T>,
        wl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let total = xl.shape().elem_count();
        let cols = wl.shape().elem_count();
        let x = view(OP, "x", x, xl)?;
        let r = view(OP, "residual", r, rl)?;
        let w = view(OP, "weight", w, wl)?;
        let rows = check::u32_of(OP, "the row count", total / cols)?;
        // Up to 8 elements a thread (held in registers), in whole warps.
        let threads = check::u32_of(
            OP,
            "the block size",
            cols.div_ceil(8).next_multiple_of(32).min(MAX_THREADS),
        )?;
        // SAFETY: the kernel writes all `2 * total` elements (block `row` writes the sum and
        // the normed sum of its `cols` elements, the grid has one block per row) before
        // anything reads them: it is launched below on the device's stream, which orders every
        // later use of the output.
        let out = unsafe { device.alloc::<T>(2 * total)? };
        let name = format!("graft_add_rms_norm_{}", T::DTYPE.as_str());
        let cols = check::u32_of(OP, "the row length", cols)?;
        let total = total as u64;
        let stream = device.cuda_stream();
        let [x, r, w, out_ptr] = [
            x.device_ptr(&stream).0,
            r.device_ptr(&stream).0,
            w.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
        ];
        let mut args = Args::new();
        args.arg(&x)
            .arg(&r)
            .arg(&w)
            .arg(&out_ptr)
            .arg(&cols)
            .arg(&total)
            .arg(&self.eps);
        let cfg = LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_add_rms_norm_<dtype>(const T*, const T*, const
        // T*, T*, unsigned int, unsigned long long, float)` with T the storage's dtype: `x` and
        // `residual` hold `total` = rows * cols elements, `weight` `cols` (checked by the
        // wrapper), `out` `2 * total`; the block is a whole number of warps (the shuffles use
        // all 32 lanes) and at most 1024 threads (32 warp sums); all live until the launch is
        // enqueued on the device's stream.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(out)
    }
}
