//! The CUDA backend (chosen in `lib.rs` by the `cuda` feature; `no_cuda.rs` has the same
//! items without CUDA): the candle device set up for capture, graft's engine over candle's
//! stream, the graph memory figures, tensor parallelism over NCCL on candle's stream
//! ([`TpComm`], with the `nccl` feature), and raw access to candle tensors' device memory for the benchmarks'
//! hand-made graph (these three exist only in the CUDA build: their types are candle's CUDA
//! types).

pub(crate) mod copy;
mod deferred;
pub(crate) mod engine;
pub(crate) mod looping;
mod memory;
#[cfg(feature = "nccl")]
mod tp;

#[cfg(not(feature = "nccl"))]
pub use crate::no_nccl::TpComm;
pub use copy::{tensor_range, uninit_tensor};
pub(crate) use engine::CudaEngine as GraphEngine;
pub use memory::{eager_memory, free_memory, graph_memory, reset_eager_high, trim_graph_memory};
#[cfg(feature = "nccl")]
pub use tp::TpComm;

pub use crate::memory::{EagerMemory, GraphMemory};

use std::ffi::c_void;

use candle_core::Device;
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::DriverError;

use crate::error::Error;

/// A CUDA device on a stream of its own, with candle's event tracking off (see
/// [`crate::device`]).
pub(crate) fn device(ordinal: usize) -> candle_core::Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    prepare(device.as_cuda_device()?);
    Ok(device)
}

/// The raw CUDA stream (`CUstream`) `device` issues all of its work on (kernels, cuBLAS,
/// copies): the stream graft captures.
pub fn capture_stream(device: &CudaDevice) -> *mut c_void {
    device.cuda_stream().cu_stream().cast()
}

/// Turns off candle's event tracking for the tensors `device` creates from now on. Those
/// events are recorded after each use and waited on before each free; inside a capture they
/// would be recorded into the graph and waited on from outside it.
pub(crate) fn prepare(device: &CudaDevice) {
    // SAFETY: candle's conditions are about several streams using one tensor; every
    // tensor of a device made by `crate::device` lives on that device's single stream,
    // which orders all of its allocations, uses and frees.
    unsafe { device.disable_event_tracking() };
}

/// graft-candle's error for a CUDA driver call of its own that failed while doing `what`.
pub fn driver(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |source| Error::Driver {
        what,
        code: source.0 as u32,
        name: format!("{:?}", source.0),
    }
}
