//! The CUDA side: the candle device set up for capture, graft's engine over candle's stream,
//! the graph memory figures, and the raw copies of candle tensors' device memory.

pub(crate) mod copy;
pub(crate) mod engine;
pub(crate) mod looping;
mod memory;

pub use copy::{copy, tensor_range, uninit_tensor};
pub use engine::OutputMeta;
pub use memory::{
    EagerMemory, GraphMemory, eager_memory, free_memory, graph_memory, reset_eager_high,
    trim_graph_memory,
};

use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::sys::CUstream;

/// The raw CUDA stream `device` issues all of its work on (kernels, cuBLAS, copies): the
/// stream graft captures.
pub fn capture_stream(device: &CudaDevice) -> CUstream {
    device.cuda_stream().cu_stream()
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
