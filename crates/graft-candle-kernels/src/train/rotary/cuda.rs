//! The rotary kernel: one thread per rotated pair, 256 threads a block.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map3};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::{Dims, OP, Rotary};
use crate::RopeStyle;
use crate::check;
use crate::nvrtc::{Args, Kernels, view};

/// Threads per block.
const THREADS: u32 = 256;

static KERNELS: Kernels = Kernels::new("graft_kernels_rotary", include_str!("rotary.cu"));

#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    op: &Rotary,
    dims: Dims,
    x: &CudaStorage,
    xl: &Layout,
    cos: &CudaStorage,
    cl: &Layout,
    sin: &CudaStorage,
    sl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let launch = Launch {
        dims,
        interleaved: u32::from(matches!(op.style, RopeStyle::Interleaved)),
        sign: if op.inverse { -1.0 } else { 1.0 },
    };
    let slice = launch.map(&x.slice, xl, &cos.slice, cl, &sin.slice, sl, &device)?;
    Ok((CudaStorage { slice, device }, xl.shape().clone()))
}

struct Launch {
    dims: Dims,
    interleaved: u32,
    sign: f32,
}

impl Map3 for Launch {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        xl: &Layout,
        cos: &CudaSlice<T>,
        cl: &Layout,
        sin: &CudaSlice<T>,
        sl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let n = xl.shape().elem_count();
        let x = view(OP, "x", x, xl)?;
        let cos = view(OP, "cos", cos, cl)?;
        let sin = view(OP, "sin", sin, sl)?;
        // SAFETY: each thread writes both dims of its pair, the pairs cover every element and
        // the grid covers every pair, so all `n` are written by the kernel launched below on
        // the device's stream before anything reads them.
        let y = unsafe { device.alloc::<T>(n)? };
        let name = format!("graft_rotary_{}", T::DTYPE.as_str());
        let pairs = n / 2;
        let blocks = check::u32_of(OP, "the pair count / 256", pairs.div_ceil(THREADS as usize))?;
        let pairs = pairs as u64;
        let d = self.dims;
        let seq = check::u32_of(OP, "the sequence length", d.seq)?;
        let heads = check::u32_of(OP, "the head count", d.heads)?;
        let half = check::u32_of(OP, "the head dim", d.half)?;
        let stream = device.cuda_stream();
        let [x, cos, sin, y_ptr] = [
            x.device_ptr(&stream).0,
            cos.device_ptr(&stream).0,
            sin.device_ptr(&stream).0,
            y.device_ptr(&stream).0,
        ];
        let mut args = Args::new();
        args.arg(&x)
            .arg(&cos)
            .arg(&sin)
            .arg(&y_ptr)
            .arg(&pairs)
            .arg(&seq)
            .arg(&heads)
            .arg(&half)
            .arg(&self.interleaved)
            .arg(&self.sign);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_rotary_<dtype>(const T*, const T*, const T*, T*,
        // unsigned long long, unsigned int x4, float)`: `x` and `y` hold `2 * pairs` elements,
        // `cos` and `sin` at least seq * half (checked by the wrapper), and no thread reads
        // past them; all live until the launch is enqueued.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(y)
    }
}
