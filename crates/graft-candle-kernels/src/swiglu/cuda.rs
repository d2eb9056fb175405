//! The SwiGLU kernels, forward and backward: one thread per 16 bytes of elements (4 in f32, 8
//! in bf16 and f16), 256 threads a block.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map2, Map3};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::OP;
use crate::check;
use crate::nvrtc::{Args, Kernels, view};

/// Threads per block.
const THREADS: u32 = 256;

/// Blocks covering `n` elements of T, 16 bytes of them a thread (the kernels' E).
fn blocks<T>(n: usize) -> Result<u32> {
    let per_thread = 16 / std::mem::size_of::<T>();
    check::u32_of(
        OP,
        "the element count / 256 threads' elements",
        n.div_ceil(per_thread * THREADS as usize),
    )
}

static KERNELS: Kernels = Kernels::new("graft_kernels_swiglu", include_str!("swiglu.cu"));

pub(super) fn forward(
    gate: &CudaStorage,
    gl: &Layout,
    up: &CudaStorage,
    ul: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = gate.device.clone();
    let slice = Swiglu.map(&gate.slice, gl, &up.slice, ul, &device)?;
    Ok((CudaStorage { slice, device }, gl.shape().clone()))
}

struct Swiglu;

impl Map2 for Swiglu {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        gate: &CudaSlice<T>,
        gl: &Layout,
        up: &CudaSlice<T>,
        ul: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let n = gl.shape().elem_count();
        let gate = view(OP, "gate", gate, gl)?;
        let up = view(OP, "up", up, ul)?;
        // SAFETY: the kernel writes all `n` elements (E consecutive a thread, the grid covers
        // `n`, `blocks`) before anything reads them: it is launched below on the device's
        // stream, which orders every later use of the output.
        let out = unsafe { device.alloc::<T>(n)? };
        let name = format!("graft_swiglu_{}", T::DTYPE.as_str());
        let blocks = blocks::<T>(n)?;
        let n = n as u64;
        let stream = device.cuda_stream();
        let [gate, up, out_ptr] = [
            gate.device_ptr(&stream).0,
            up.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
        ];
        let mut args = Args::new();
        args.arg(&gate).arg(&up).arg(&out_ptr).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_swiglu_<dtype>(const T*, const T*, T*, unsigned
        // long long)` with T the storage's dtype: `gate` and `up` hold `n` elements each (one
        // shape, checked by the wrapper), `out` holds `n`, and no thread touches an index at or
        // past `n` (16-byte accesses only where all three are 16-byte aligned and n a multiple
        // of E, checked in the kernel); all live until the launch is enqueued on the device's
        // stream.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(out)
    }
}

pub(super) fn backward(
    gate: &CudaStorage,
    gl: &Layout,
    up: &CudaStorage,
    ul: &Layout,
    dy: &CudaStorage,
    dl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = gate.device.clone();
    let slice = SwigluBackward.map(&gate.slice, gl, &up.slice, ul, &dy.slice, dl, &device)?;
    Ok((
        CudaStorage { slice, device },
        Shape::from(2 * gl.shape().elem_count()),
    ))
}

struct SwigluBackward;

impl Map3 for SwigluBackward {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        gate: &CudaSlice<T>,
        gl: &Layout,
        up: &CudaSlice<T>,
        ul: &Layout,
        dy: &CudaSlice<T>,
        dl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let n = gl.shape().elem_count();
        let gate = view(OP, "gate", gate, gl)?;
        let up = view(OP, "up", up, ul)?;
        let dy = view(OP, "dy", dy, dl)?;
        // SAFETY: thread i writes out[j] and out[n + j] for its E elements j (E i .. E i + E,
        // below n) and the grid covers `n` (`blocks`), so all `2n` are written by the kernel
        // launched below on the device's stream before any read.
        let out = unsafe { device.alloc::<T>(2 * n)? };
        let name = format!("graft_swiglu_backward_{}", T::DTYPE.as_str());
        let blocks = blocks::<T>(n)?;
        let n = n as u64;
        let stream = device.cuda_stream();
        let [gate, up, dy, out_ptr] = [
            gate.device_ptr(&stream).0,
            up.device_ptr(&stream).0,
            dy.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
        ];
        let mut args = Args::new();
        args.arg(&gate).arg(&up).arg(&dy).arg(&out_ptr).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_swiglu_backward_<dtype>(const T*, const T*, const
        // T*, T*, unsigned long long)`: `gate`, `up` and `dy` hold `n` elements (one shape,
        // checked), `out` `2n`; no thread touches an index past them; all live until the
        // launch is enqueued on the device's stream.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(out)
    }
}
