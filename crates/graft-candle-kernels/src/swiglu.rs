//! `swiglu(gate, up) = silu(gate) * up`, elementwise in one kernel (silu(x) = x / (1 + e^-x)),
//! computed in f32 and rounded once to the inputs' dtype; differentiable, its backward one
//! kernel too, both gradients packed in one tensor (gate's, then up's) and handed out as views.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

use crate::cpu::float_dispatch;
use crate::{KernelError, check};

const OP: &str = "swiglu";

/// `silu(gate) * up` elementwise: same shape and dtype (f32, bf16 or f16) as the inputs, which
/// must be contiguous (a start offset is fine) and of one shape, dtype and device.
/// Differentiable in both.
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
    gate.apply_op2(up, Swiglu)
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
        let out = float_dispatch!(OP, "gate", (gate, up), |g, u| cpu(g, gl, u, ul))?;
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

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dgate, dup) = swiglu_backward(gate, up, dy)?;
        Ok((Some(dgate), Some(dup)))
    }
}

/// The gradients of [`swiglu`]'s gate and up from its output's gradient `dy`, outside
/// candle's autograd (the kernel of `swiglu`'s own backward pass): `(dgate, dup)`, views of
/// one packed tensor.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    for (name, t) in [("up", up), ("dy", dy)] {
        check::like(OP, name, t, "gate", gate)?;
        if t.dims() != gate.dims() {
            return Err(check::shape(OP, name, t, "gate's shape"));
        }
    }
    let (gate, up, dy) = (gate.contiguous()?, up.contiguous()?, dy.contiguous()?);
    let n = gate.elem_count();
    if n == 0 {
        return Ok((gate.zeros_like()?, up.zeros_like()?));
    }
    let packed = gate.apply_op3_no_bwd(&up, &dy, &SwigluBackward)?;
    let dgate = packed.narrow(0, 0, n)?.reshape(gate.shape())?;
    let dup = packed.narrow(0, n, n)?.reshape(gate.shape())?;
    Ok((dgate, dup))
}

/// The backward op over (gate, up, dy): `[2 * n]`, the gate's gradient
/// `dy * up * s * (1 + g * (1 - s))` (s the sigmoid of g), then the up's `dy * silu(g)`.
struct SwigluBackward;

impl CustomOp3 for SwigluBackward {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gl: &Layout,
        up: &CpuStorage,
        ul: &Layout,
        dy: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(OP, "gate", (gate, up, dy), |g, u, d| {
            cpu_backward(g, gl, u, ul, d, dl)
        })?;
        Ok((out, Shape::from(2 * gl.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        gl: &Layout,
        up: &candle_core::CudaStorage,
        ul: &Layout,
        dy: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::backward(gate, gl, up, ul, dy, dl)
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

fn cpu_backward<T: WithDType>(
    gate: &[T],
    gl: &Layout,
    up: &[T],
    ul: &Layout,
    dy: &[T],
    dl: &Layout,
) -> Result<CpuStorage> {
    let gate = check::cpu_slice(OP, "gate", gate, gl)?;
    let up = check::cpu_slice(OP, "up", up, ul)?;
    let dy = check::cpu_slice(OP, "dy", dy, dl)?;
    let mut dgate = Vec::with_capacity(2 * gate.len());
    let mut dup = Vec::with_capacity(gate.len());
    for ((&g, &u), &d) in gate.iter().zip(up).zip(dy) {
        let (g, u, d) = (check::f32_of(g), check::f32_of(u), check::f32_of(d));
        let s = 1.0 / (1.0 + (-g).exp());
        dgate.push(T::from_f64(f64::from(d * u * s * (1.0 + g * (1.0 - s)))));
        dup.push(T::from_f64(f64::from(d * g * s)));
    }
    dgate.extend(dup);
    Ok(T::to_cpu_storage_owned(dgate))
}
