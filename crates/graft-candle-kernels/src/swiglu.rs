//! `swiglu(gate, up) = silu(gate) * up`, elementwise in one kernel (silu(x) = x / (1 + e^-x)),
//! computed in f32 and rounded once to the inputs' dtype.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

use crate::{KernelError, check};

const OP: &str = "swiglu";

/// `silu(gate) * up` elementwise: same shape and dtype (f32, bf16 or f16) as the inputs, which
/// must be contiguous (a start offset is fine) and of one shape, dtype and device.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check::float(OP, "gate", gate)?;
    check::like(OP, "up", up, "gate", gate)?;
    if gate.dims() != up.dims() {
        return Err(KernelError::Shape {
            op: OP,
            input: "up",
            got: up.dims().to_vec(),
            expected: "gate's shape",
        }
        .into());
    }
    check::contiguous(OP, "gate", gate)?;
    check::contiguous(OP, "up", up)?;
    if gate.elem_count() == 0 {
        return gate.zeros_like();
    }
    check::u32_of(
        OP,
        "the element count / 256",
        gate.elem_count().div_ceil(256),
    )?;
    gate.apply_op2_no_bwd(up, &Swiglu)
}

/// The custom op; the wrapper has checked shapes, dtypes and contiguity.
struct Swiglu;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gl: &Layout,
        up: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match (gate, up) {
            (CpuStorage::F32(g), CpuStorage::F32(u)) => cpu(g, gl, u, ul)?,
            (CpuStorage::BF16(g), CpuStorage::BF16(u)) => cpu(g, gl, u, ul)?,
            (CpuStorage::F16(g), CpuStorage::F16(u)) => cpu(g, gl, u, ul)?,
            _ => {
                return Err(KernelError::UnsupportedDType {
                    op: OP,
                    input: "gate",
                    got: gate.dtype(),
                }
                .into());
            }
        };
        Ok((out, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        gl: &Layout,
        up: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(gate, gl, up, ul)
    }
}

fn cpu<T: WithDType>(gate: &[T], gl: &Layout, up: &[T], ul: &Layout) -> Result<CpuStorage> {
    let gate = check::cpu_slice(OP, "gate", gate, gl)?;
    let up = check::cpu_slice(OP, "up", up, ul)?;
    let out = gate
        .iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = check::f32_of(g);
            let u = check::f32_of(u);
            T::from_f64(f64::from(g / (1.0 + (-g).exp()) * u))
        })
        .collect();
    Ok(T::to_cpu_storage_owned(out))
}
