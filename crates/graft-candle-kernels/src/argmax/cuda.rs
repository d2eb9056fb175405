//! The argmax kernel: one block of 1,024 threads per row; each thread keeps the first largest
//! of its strided elements, then warps and the block reduce (value, index) pairs, the smaller
//! index winning ties.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, Map1Any};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::OP;
use crate::check;
use crate::nvrtc::{Args, Kernels, view};

/// Threads per block.
const THREADS: u32 = 1024;

static KERNELS: Kernels = Kernels::new("graft_kernels_argmax", include_str!("argmax.cu"));

/// The `[rows]` u32 output on CUDA.
pub(super) fn forward(n: usize, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let device = s.device.clone();
    let slice = Argmax { n }.map(&s.slice, &device, l)?;
    let rows = l.shape().elem_count() / n;
    Ok((CudaStorage { slice, device }, Shape::from_dims(&[rows])))
}

struct Argmax {
    n: usize,
}

impl Map1Any for Argmax {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits, W: Fn(CudaSlice<T>) -> CudaStorageSlice>(
        &self,
        x: &CudaSlice<T>,
        device: &CudaDevice,
        l: &Layout,
        _wrap: W,
    ) -> Result<CudaStorageSlice> {
        let x = view(OP, "x", x, l)?;
        let rows = l.shape().elem_count() / self.n;
        // SAFETY: the kernel writes all `rows` indices (one block per row, lane 0 of its
        // first warp) before anything reads them: it is launched below on the device's stream.
        let out = unsafe { device.alloc::<u32>(rows)? };
        let name = format!("graft_argmax_{}", T::DTYPE.as_str());
        let grid = check::u32_of(OP, "the row count", rows)?;
        let n = check::u32_of(OP, "the row length", self.n)?;
        let stream = device.cuda_stream();
        let x_ptr = x.device_ptr(&stream).0;
        let out_ptr = out.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&x_ptr).arg(&out_ptr).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_argmax_<dtype>(const T*, unsigned int*, unsigned
        // int)` with T the storage's dtype: `x` holds rows * n elements (contiguous), `out`
        // rows u32; block r reads only row r's n elements; the block is 32 whole warps (32
        // warp results in shared memory); all live until the launch is enqueued.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(CudaStorageSlice::U32(out))
    }
}
