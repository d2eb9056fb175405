//! Input checks shared by the ops (dtype, device, contiguity, 32-bit sizes) and the CPU
//! implementations' element access.

use candle_core::{DType, Result, Tensor};

use crate::KernelError;

/// Checks that `t` is f32, bf16 or f16.
pub(crate) fn float(op: &'static str, input: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        got => Err(KernelError::UnsupportedDType { op, input, got }.into()),
    }
}

/// Checks that `t` has `reference`'s dtype and device.
pub(crate) fn like(
    op: &'static str,
    input: &'static str,
    t: &Tensor,
    reference_name: &'static str,
    reference: &Tensor,
) -> Result<()> {
    if t.dtype() != reference.dtype() {
        return Err(KernelError::DTypeMismatch {
            op,
            input,
            got: t.dtype(),
            reference: reference_name,
            expected: reference.dtype(),
        }
        .into());
    }
    if !t.device().same_device(reference.device()) {
        return Err(KernelError::Device { op, input }.into());
    }
    Ok(())
}

/// Checks that `t` is u32 on `reference`'s device (positions, rows).
pub(crate) fn indices(
    op: &'static str,
    input: &'static str,
    t: &Tensor,
    reference: &Tensor,
) -> Result<()> {
    if t.dtype() != DType::U32 {
        return Err(KernelError::IndexDType {
            op,
            input,
            got: t.dtype(),
        }
        .into());
    }
    if !t.device().same_device(reference.device()) {
        return Err(KernelError::Device { op, input }.into());
    }
    Ok(())
}

/// The error of input `t` of `op` whose shape is not `expected`.
pub(crate) fn shape(
    op: &'static str,
    input: &'static str,
    t: &Tensor,
    expected: &'static str,
) -> candle_core::Error {
    KernelError::Shape {
        op,
        input,
        got: t.dims().to_vec(),
        expected,
    }
    .into()
}

/// Checks that `t` is contiguous (a start offset is allowed).
pub(crate) fn contiguous(op: &'static str, input: &'static str, t: &Tensor) -> Result<()> {
    if t.is_contiguous() {
        Ok(())
    } else {
        Err(KernelError::NotContiguous { op, input }.into())
    }
}

/// `size` as a u32 for a kernel argument or launch dimension.
pub(crate) fn u32_of(op: &'static str, what: &'static str, size: usize) -> Result<u32> {
    u32::try_from(size).map_err(|_| KernelError::TooLarge { op, what, size }.into())
}

/// The elements of a contiguous CPU tensor (its start offset applied).
pub(crate) fn cpu_slice<'a, T>(
    op: &'static str,
    input: &'static str,
    data: &'a [T],
    layout: &candle_core::Layout,
) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(KernelError::NotContiguous { op, input }.into()),
    }
}

/// An element as f32 (exact for f32, bf16 and f16).
pub(crate) fn f32_of<T: candle_core::WithDType>(v: T) -> f32 {
    v.to_f64() as f32
}
