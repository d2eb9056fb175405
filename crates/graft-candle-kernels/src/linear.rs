//! `linear`, `linear_cat` and `linear_swiglu`: projections of a decode step's few rows through
//! one weight, through up to three weights side by side (a layer's query, key and value
//! projections), or through a gate and an up weight with SwiGLU of the two.
//!
//! A few rows each call is one kernel that reads every weight once for all rows, in place (the
//! weights are never copied or packed, so weights that are trained in place stay the ones
//! used), sums in f32, and applies the bias or SwiGLU before the single rounding to the dtype:
//! in bf16 and f16, up to [`TENSOR_ROWS`] rows on tensor cores when the columns are a multiple
//! of 8 and every operand starts 16-byte aligned (`rows.cu`: a row gets the same bits at every
//! row count from 3 to 16); otherwise up to [`MATVEC_ROWS`] rows on the matrix-vector kernel
//! (`matvec.cu`, f32 sums on the CUDA cores). On the CPU every dtype takes the one
//! implementation up to [`TENSOR_ROWS`] rows (each output a dot product summed in index order),
//! so a row's bits there never depend on how many rows share the call. Above that they run
//! `dense` (one GEMM over all rows, cuBLAS on CUDA) per weight. Which path runs depends only on the shapes, dtypes and
//! offsets, so eager and graphed calls of one shape run the same kernels. Two or three weights
//! without biases above those rows are one GEMM each written into its columns of the output
//! (`gemms.rs`), not a GEMM each and a concatenation.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod gemms;

use candle_core::{
    CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, WithDType,
};

use crate::cpu::float_dispatch;
use crate::{KernelError, SideStream, check, dense, swiglu};

const OP: &str = "linear";

/// The most rows the matrix-vector kernel takes; more go to [`dense`]. Each row's input
/// is read once per output from L1: at 8 rows that was 8 times the weight's bytes, and the
/// kernel ran at 0.3–1.1 TB/s, below cuBLAS (H200, docs/benchmarks.md).
pub const MATVEC_ROWS: usize = 2;

/// The most rows the tensor-core kernel takes (one m-tile), in bf16 and f16. At 32 rows it was
/// 1.4x slower than cuBLAS on the ~1B Llama's decode step (H200, docs/benchmarks.md).
pub const TENSOR_ROWS: usize = 16;

/// The most weights [`linear_cat`] takes.
pub const MAX_PARTS: usize = 3;

/// `x · wᵀ + bias`: `x` `[..., k]`, `w` `[n, k]`, `bias` `[n]`; returns `[..., n]` in `x`'s
/// dtype (f32, bf16 or f16, shared by all). `w` and `bias` are contiguous. Differentiable:
/// where an operand tracks gradients (a `Var`, or made from one) it runs `dense`, whatever the
/// rows.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_cat(x, &[(w, bias)])
}

/// The projections of `x` through each of `parts` (1 to [`MAX_PARTS`] weights `[n_i, k]`, each
/// with an optional bias `[n_i]`), concatenated along the last dim: `[..., n_0 + n_1 + ...]`.
pub fn linear_cat(x: &Tensor, parts: &[(&Tensor, Option<&Tensor>)]) -> Result<Tensor> {
    project(x, parts, false, None, &SideStream::none())
}

/// `silu(x · gateᵀ) * (x · upᵀ)`: `gate` and `up` `[n, k]`; returns `[..., n]` in `x`'s dtype.
pub fn linear_swiglu(x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    project(
        x,
        &[(gate, None), (up, None)],
        true,
        None,
        &SideStream::none(),
    )
}

/// The projection of `x` through `parts` (SwiGLU of the two with `pair`), each row's outputs
/// scaled by the sigmoid of that row's `gate` (`[..., 1]`) when given, its matrix-vector
/// launch on `side`'s stream when it has one.
pub(crate) fn project(
    x: &Tensor,
    parts: &[(&Tensor, Option<&Tensor>)],
    pair: bool,
    gate: Option<&Tensor>,
    side: &SideStream,
) -> Result<Tensor> {
    let dims = Dims::of(x, parts, pair)?;
    if let Some(g) = gate {
        check::like(OP, "gate", g, "x", x)?;
        if g.dims() != with_last(x, 1) {
            return Err(check::shape(
                OP,
                "gate",
                g,
                "x's shape with a last dim of 1",
            ));
        }
        check::contiguous(OP, "gate", g)?;
    }
    // The one-kernel paths have no backward: an operand that tracks gradients takes `dense`.
    let tracked = std::iter::once(x)
        .chain(parts.iter().flat_map(|&(w, b)| std::iter::once(w).chain(b)))
        .chain(gate)
        .any(Tensor::track_op);
    if dims.rows <= TENSOR_ROWS && !tracked {
        let x = x.contiguous()?;
        let weights = parts.iter().map(|&(w, _)| w);
        // On the CPU one implementation serves every row count: a row's bits never depend on
        // the batch there, so the CPU is an exact oracle for batching.
        if dims.rows <= MATVEC_ROWS
            || x.device().is_cpu()
            || tensor_cores(x.dtype(), dims.k, weights.chain([&x]))?
        {
            return matvec(&x, parts, dims, gate, side);
        }
    }
    let y = if pair {
        swiglu(&dense(x, parts[0].0)?, &dense(x, parts[1].0)?)?
    } else if !tracked && dims.rows > 0 && parts.len() > 1 && parts.iter().all(|(_, b)| b.is_none())
    {
        // No copy for the concatenation: each GEMM writes its columns (no rows: `dense`'s
        // zeros below).
        let op = gemms::Gemms {
            weights: parts.iter().map(|&(w, _)| w.clone()).collect(),
            dims,
        };
        x.contiguous()?
            .apply_op1_no_bwd(&op)?
            .reshape(with_last(x, dims.n()))?
    } else {
        let outs = parts
            .iter()
            .map(|&(w, bias)| {
                let y = dense(x, w)?;
                match bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, candle_core::D::Minus1)?
    };
    match gate {
        // sigmoid(g) = 1 / (1 + exp(-g)).
        Some(g) => y.broadcast_mul(&(g.neg()?.exp()? + 1.0)?.recip()?),
        None => Ok(y),
    }
}

/// Whether a projection of `k` columns in `dtype` through these tensors (its input, weights
/// and norm weight, on one device) takes the tensor-core kernel: bf16 or f16, `k` a multiple
/// of 8, every tensor starting a multiple of 16 bytes into its storage's (16-byte aligned)
/// allocation, and a CUDA device of compute capability 8.0 or later (or the CPU, whose
/// implementation is the same for every row count).
pub(crate) fn tensor_cores<'a>(
    dtype: DType,
    k: usize,
    tensors: impl IntoIterator<Item = &'a Tensor>,
) -> Result<bool> {
    let mut tensors = tensors.into_iter().peekable();
    #[cfg(feature = "cuda")]
    if let Some(candle_core::Device::Cuda(device)) = tensors.peek().map(|t| t.device())
        && !cuda::has_tensor_cores(device)?
    {
        return Ok(false);
    }
    Ok(matches!(dtype, DType::BF16 | DType::F16)
        && k.is_multiple_of(8)
        && tensors.all(|t| (t.layout().start_offset() * dtype.size_in_bytes()).is_multiple_of(16)))
}

/// `x`'s shape with its last dim `n`.
fn with_last(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    dims
}

fn matvec(
    x: &Tensor,
    parts: &[(&Tensor, Option<&Tensor>)],
    dims: Dims,
    gate: Option<&Tensor>,
    side: &SideStream,
) -> Result<Tensor> {
    let out = with_last(x, dims.n());
    if dims.rows == 0 {
        return Tensor::zeros(out, x.dtype(), x.device());
    }
    let op = Matvec {
        parts: parts
            .iter()
            .map(|&(w, b)| (w.clone(), b.cloned()))
            .collect(),
        dims,
        gate: gate.cloned(),
        #[cfg(feature = "cuda")]
        side: side.clone(),
    };
    #[cfg(not(feature = "cuda"))]
    let _ = side;
    x.apply_op1_no_bwd(&op)?.reshape(out)
}

/// The projection's sizes, checked.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    k: usize,
    /// Each weight's rows (0 past the last weight).
    ns: [usize; MAX_PARTS],
    /// SwiGLU of the two weights' outputs.
    pair: bool,
}

impl Dims {
    fn of(x: &Tensor, parts: &[(&Tensor, Option<&Tensor>)], pair: bool) -> Result<Self> {
        check::float(OP, "x", x)?;
        if parts.is_empty() || parts.len() > MAX_PARTS {
            return Err(KernelError::Parts {
                got: parts.len(),
                max: MAX_PARTS,
            }
            .into());
        }
        let k = x.dims().last().copied().unwrap_or(0);
        let mut ns = [0; MAX_PARTS];
        for (i, &(w, bias)) in parts.iter().enumerate() {
            check::like(OP, "w", w, "x", x)?;
            let &[n, wk] = w.dims() else {
                return Err(check::shape(OP, "w", w, "[n, k]"));
            };
            if wk != k || x.rank() == 0 {
                return Err(check::shape(
                    OP,
                    "x",
                    x,
                    "[..., k] with k each weight's columns",
                ));
            }
            check::contiguous(OP, "w", w)?;
            if let Some(b) = bias {
                check::like(OP, "bias", b, "x", x)?;
                if b.dims() != [n] {
                    return Err(check::shape(OP, "bias", b, "[n], its weight's rows"));
                }
                check::contiguous(OP, "bias", b)?;
            }
            ns[i] = n;
        }
        if pair && ns[0] != ns[1] {
            return Err(check::shape(OP, "up", parts[1].0, "gate's shape"));
        }
        let rows = x.elem_count().checked_div(k).unwrap_or(0);
        let dims = Self { rows, k, ns, pair };
        check::u32_of(OP, "the weights' columns", k)?;
        check::u32_of(OP, "the outputs per row", ns.iter().sum())?;
        Ok(dims)
    }

    /// Outputs per row.
    fn n(&self) -> usize {
        if self.pair {
            self.ns[0]
        } else {
            self.ns.iter().sum()
        }
    }

    /// The ops' `[rows, n]` output.
    fn out_shape(&self) -> Shape {
        Shape::from_dims(&[self.rows, self.n()])
    }
}

/// The custom op over `x`, holding clones (the same storage) of the weights, biases and the
/// rows' sigmoid gates; the wrappers have checked everything. Its output is `[rows, n]`. It
/// launches on `side`'s stream when it has one.
struct Matvec {
    parts: Vec<(Tensor, Option<Tensor>)>,
    dims: Dims,
    gate: Option<Tensor>,
    /// Where the CUDA kernel launches (the CPU implementation runs in order anyway).
    #[cfg(feature = "cuda")]
    side: SideStream,
}

impl CustomOp1 for Matvec {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(OP, "x", (x), |x| self.cpu(x, xl))?;
        Ok((out, self.dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, x, xl)
    }
}

impl Matvec {
    /// The CPU projection: each output a dot product summed in f32 in index order.
    fn cpu<T: WithDType>(&self, x: &[T], xl: &Layout) -> Result<CpuStorage> {
        let x = check::cpu_slice(OP, "x", x, xl)?;
        // The weights and biases read in place (their storage read-locked for the call).
        let guards: Vec<_> = self
            .parts
            .iter()
            .map(|(w, b)| {
                (
                    w.storage_and_layout(),
                    b.as_ref().map(Tensor::storage_and_layout),
                )
            })
            .collect();
        let parts = guards
            .iter()
            .map(|((w, wl), b)| {
                let bias = b
                    .as_ref()
                    .map(|(s, l)| in_place(s, l, "bias"))
                    .transpose()?;
                Ok((in_place(w, wl, "w")?, bias))
            })
            .collect::<Result<Vec<_>>>()?;
        let gate = self.gate.as_ref().map(Tensor::storage_and_layout);
        let gate = gate
            .as_ref()
            .map(|(s, l)| in_place::<T>(s, l, "gate"))
            .transpose()?;
        // sigmoid(gate of row r), 1 without gates.
        let scale = |r: usize| gate.map_or(1.0, |g| 1.0 / (1.0 + (-check::f32_of(g[r])).exp()));
        let Dims { rows, k, ns, pair } = self.dims;
        let dot = |r: usize, (w, b): &(&[T], Option<&[T]>), j: usize| -> f32 {
            let sum: f32 = x[r * k..][..k]
                .iter()
                .zip(&w[j * k..][..k])
                .map(|(&a, &b)| check::f32_of(a) * check::f32_of(b))
                .sum();
            sum + b.map_or(0.0, |b| check::f32_of(b[j]))
        };
        let mut out = Vec::with_capacity(rows * self.dims.n());
        for r in 0..rows {
            if pair {
                for j in 0..ns[0] {
                    let (g, u) = (dot(r, &parts[0], j), dot(r, &parts[1], j));
                    out.push(T::from_f64(f64::from(
                        g / (1.0 + (-g).exp()) * u * scale(r),
                    )));
                }
            } else {
                for (part, &n) in parts.iter().zip(&ns) {
                    out.extend((0..n).map(|j| T::from_f64(f64::from(dot(r, part, j) * scale(r)))));
                }
            }
        }
        Ok(T::to_cpu_storage_owned(out))
    }
}

/// A CPU tensor's elements (its storage and layout) in place, as `T`.
fn in_place<'a, T: WithDType>(
    storage: &'a Storage,
    layout: &Layout,
    input: &'static str,
) -> Result<&'a [T]> {
    match storage {
        Storage::Cpu(c) => check::cpu_slice(OP, input, T::cpu_storage_as_slice(c)?, layout),
        _ => Err(KernelError::Device { op: OP, input }.into()),
    }
}
