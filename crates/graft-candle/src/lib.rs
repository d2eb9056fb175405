//! graft-candle: CUDA graph trees for candle models (candle 0.11), for now a skeleton: the
//! build plumbing and the two pieces an adapter starts from, proven to compile and link.
//!
//! Two builds, chosen by the `cuda` feature:
//!
//! - Default (the workspace build, CI): candle-core and candle-nn on the CPU only. No CUDA
//!   toolkit is needed; [`device`] returns [`Device::Cpu`], and the unit tests run candle ops.
//! - `cuda`: candle's CUDA backend plus graft-cuda, both with cudarc's `dynamic-linking`
//!   (candle-core requires it). Built in its own invocation, never together with the workspace,
//!   because cargo unifies cudarc's features over one build and the rest of graft loads CUDA
//!   at run time (`dynamic-loading`); the two cannot be mixed. See "Building for candle on
//!   CUDA" in docs/architecture.md:
//!
//!   ```sh
//!   source scripts/cuda-build-env.sh
//!   cargo build -p graft-candle --features cuda
//!   ```
//!
//! With `cuda`, [`device`] returns a CUDA device set up the way graph capture needs it, and
//! [`cuda::capture_stream`] names the stream graft would capture.

pub use candle_core;
use candle_core::{Device, Result};

/// The candle device graft-candle runs a model on: GPU `ordinal`.
///
/// With the `cuda` feature: a CUDA device on a stream of its own (candle's plain
/// `Device::new_cuda` uses the per-thread default stream, which shares its work with every
/// other user of that thread), with candle's cross-stream event tracking turned off, since all of
/// the device's work stays on that one stream and a capture must not record foreign events.
/// Fails if there is no such GPU.
///
/// Without it: [`Device::Cpu`], whatever the ordinal.
pub fn device(ordinal: usize) -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        let device = Device::new_cuda_with_stream(ordinal)?;
        cuda::prepare(device.as_cuda_device()?);
        Ok(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Ok(Device::Cpu)
    }
}

/// The CUDA side: candle's [`CudaDevice`](candle_core::cuda_backend::CudaDevice) as graft
/// sees it.
#[cfg(feature = "cuda")]
pub mod cuda {
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::cuda_backend::cudarc::driver::sys::CUstream;

    /// The raw CUDA stream `device` issues all of its work on (kernels, cuBLAS, copies): the
    /// stream graft begins and ends a capture on.
    pub fn capture_stream(device: &CudaDevice) -> CUstream {
        device.cuda_stream().cu_stream()
    }

    /// Turns off candle's event tracking for the tensors `device` creates from now on.
    /// (Those events are recorded on the stream after each use; graft keeps one stream per
    /// device and orders its work itself.)
    pub(crate) fn prepare(device: &CudaDevice) {
        // SAFETY: candle's conditions are about several streams using one tensor; every
        // tensor of a device made by `crate::device` lives on that device's single stream,
        // which orders all of its allocations, uses and frees.
        unsafe { device.disable_event_tracking() };
    }

    /// Whether graft's own CUDA backend (graft-cuda, linked into the same program as candle's)
    /// finds a usable GPU.
    pub fn graft_cuda_available() -> bool {
        graft_cuda::CudaDevice::is_available()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;

    fn matmul_2x3_3x2(device: &Device) -> Result<Vec<Vec<f32>>> {
        let a = Tensor::arange(0f32, 6., device)?.reshape((2, 3))?;
        let b = Tensor::arange(0f32, 6., device)?.reshape((3, 2))?;
        a.matmul(&b)?.to_dtype(DType::F32)?.to_vec2::<f32>()
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn cpu_build_gives_the_cpu_device() {
        assert!(matches!(device(0).unwrap(), Device::Cpu));
    }

    #[test]
    fn candle_matmul_on_the_cpu() {
        // [[0 1 2] [3 4 5]] x [[0 1] [2 3] [4 5]]
        assert_eq!(
            matmul_2x3_3x2(&Device::Cpu).unwrap(),
            [[10., 13.], [28., 40.]]
        );
    }

    #[test]
    fn candle_nn_linear_on_the_cpu() {
        use candle_core::Module;
        let w = Tensor::new(&[[1f32, 0., 2.], [0., 1., -1.]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[0.5f32, -0.5], &Device::Cpu).unwrap();
        let linear = candle_nn::Linear::new(w, Some(b));
        let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu).unwrap();
        let y = linear.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(y, [[7.5, -1.5]]);
    }

    #[test]
    #[cfg(feature = "cuda")]
    #[ignore = "needs a CUDA GPU"]
    fn candle_matmul_on_the_gpu() {
        let device = device(0).expect("a CUDA device (candle, dynamically linked libcuda)");
        let cuda = device.as_cuda_device().unwrap();
        assert!(!cuda.is_event_tracking());
        assert!(!cuda::capture_stream(cuda).is_null());
        assert!(
            cuda::graft_cuda_available(),
            "graft-cuda sees no GPU where candle does"
        );
        // cuBLAS through candle, read back to the host.
        assert_eq!(matmul_2x3_3x2(&device).unwrap(), [[10., 13.], [28., 40.]]);
        // One of candle's own kernels (nvcc-built PTX): an elementwise op.
        let x = Tensor::new(&[1f32, -2., 3.], &device).unwrap();
        assert_eq!(x.relu().unwrap().to_vec1::<f32>().unwrap(), [1., 0., 3.]);
    }
}
