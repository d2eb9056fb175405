//! Device addresses of candle tensors (what graft-core gets as external memory) and fresh
//! uninitialized candle tensors.

use std::sync::Arc;

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDevice as CandleCuda, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{DType, Shape, Storage, Tensor};

use crate::error::Error;

/// The device address of `t`'s first element (its storage plus its layout's start offset)
/// and the bytes of its elements; `None` when `t` is not a CUDA tensor or its dtype is one of
/// candle's raw-byte dummy types. For a contiguous tensor the range is exactly its data.
pub fn tensor_range(t: &Tensor, stream: &Arc<CudaStream>) -> Option<(u64, usize)> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return None;
    };
    // With event tracking off (crate::device) `device_ptr` records nothing on the stream.
    let base = match &cuda.slice {
        CudaStorageSlice::U8(s) => s.device_ptr(stream).0,
        CudaStorageSlice::U32(s) => s.device_ptr(stream).0,
        CudaStorageSlice::I16(s) => s.device_ptr(stream).0,
        CudaStorageSlice::I32(s) => s.device_ptr(stream).0,
        CudaStorageSlice::I64(s) => s.device_ptr(stream).0,
        CudaStorageSlice::BF16(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F16(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F32(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F64(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F8E4M3(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F6E2M3(_)
        | CudaStorageSlice::F6E3M2(_)
        | CudaStorageSlice::F4(_)
        | CudaStorageSlice::F8E8M0(_) => return None,
    };
    let size = t.dtype().size_in_bytes();
    let start = (layout.start_offset() * size) as u64;
    Some((base + start, t.elem_count() * size))
}

/// [`tensor_range`], or the error naming the tensor (`role` `position` of `step`) when `t`
/// has none.
pub(crate) fn checked_range(
    t: &Tensor,
    stream: &Arc<CudaStream>,
    step: &Arc<str>,
    role: &'static str,
    position: usize,
) -> Result<(u64, usize), Error> {
    tensor_range(t, stream).ok_or_else(|| Error::UnsupportedDtype {
        step: step.clone(),
        role,
        position,
        dtype: t.dtype(),
    })
}

/// A contiguous tensor of `dtype` and `shape` on `device`, uninitialized: the caller fills
/// all of it before anything reads it (with a copy of its own, or as the destination graft
/// writes an output into). Allocated on candle's stream like every candle tensor (inside a capture: a
/// graph allocation, freed when it drops).
pub fn uninit_tensor(
    device: &CandleCuda,
    dtype: DType,
    shape: &Shape,
) -> candle_core::Result<Tensor> {
    // SAFETY: candle's contract for `alloc_uninit` is that the memory is written before it
    // is read; every caller has a full tensor's bytes copied into it first, on the same
    // stream (its own copy, or graft's copy of the output this tensor receives), and hands
    // it out only after that copy is enqueued.
    let storage = unsafe { device.alloc_uninit(shape, dtype) }?;
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape.clone(),
        BackpropOp::none(),
        false,
    ))
}
