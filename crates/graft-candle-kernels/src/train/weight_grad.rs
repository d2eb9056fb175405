//! A projection's weight gradient for a hand-written backward pass: [`dense_weight_grad`]
//! (`dyᵀ · x`, one GEMM over every row) and [`dense_weight_grad_add`], which adds it into a
//! gradient that already holds the sum over earlier rows (cuBLAS's β = 1 on CUDA), so a pass
//! over chunks of rows accumulates without a zeroed buffer or an add kernel.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, InplaceOp3, Layout, Result, Tensor, WithDType};

use crate::check;
use crate::cpu::float_dispatch;

const OP: &str = "dense_weight_grad_add";

/// The gradient `dyᵀ · x` (`[n, k]`) of the weight of [`crate::dense`]`(x, w)` from its
/// output's gradient `dy` (`[..., n]`) and its input `x` (`[..., k]`, the same leading
/// dims): one GEMM over every row.
pub fn dense_weight_grad(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (rows, n, k) = dims("dense_weight_grad", dy, x)?;
    dy.reshape((rows, n))?.t()?.matmul(&x.reshape((rows, k))?)
}

/// Adds `dyᵀ · x` into `acc` (`[n, k]`, contiguous, in `dy`'s dtype; a view into a larger
/// buffer is written where it lies):
/// the weight gradient of rows past those `acc` already sums, as [`dense_weight_grad`] takes
/// them. One GEMM that reads and writes `acc` (β = 1) on CUDA; computed in f32 and rounded
/// once into `acc`'s dtype on the CPU.
pub fn dense_weight_grad_add(acc: &Tensor, dy: &Tensor, x: &Tensor) -> Result<()> {
    let (rows, n, k) = dims(OP, dy, x)?;
    check::float(OP, "dy", dy)?;
    check::like(OP, "x", x, "dy", dy)?;
    check::like(OP, "acc", acc, "dy", dy)?;
    if acc.dims() != [n, k] {
        return Err(check::shape(OP, "acc", acc, "[n, k]: dy's and x's widths"));
    }
    check::contiguous(OP, "acc", acc)?;
    if rows == 0 {
        return Ok(());
    }
    let dy = dy.contiguous()?.reshape((rows, n))?;
    let x = x.contiguous()?.reshape((rows, k))?;
    acc.inplace_op3(&dy, &x, &WeightGradAdd { rows, n, k })
}

/// `(rows, n, k)` of `dy` `[..., n]` and `x` `[..., k]` with the same leading dims.
fn dims(op: &'static str, dy: &Tensor, x: &Tensor) -> Result<(usize, usize, usize)> {
    let (Some((&n, lead)), Some((&k, x_lead))) = (dy.dims().split_last(), x.dims().split_last())
    else {
        return Err(check::shape(op, "dy", dy, "[..., n]"));
    };
    if lead != x_lead {
        return Err(check::shape(op, "x", x, "[..., k] with dy's leading dims"));
    }
    Ok((lead.iter().product(), n, k))
}

/// The op behind [`dense_weight_grad_add`]: `acc [n, k] += dyᵀ · x`, `dy` `[rows, n]` and `x`
/// `[rows, k]` contiguous.
struct WeightGradAdd {
    rows: usize,
    n: usize,
    k: usize,
}

impl InplaceOp3 for WeightGradAdd {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        al: &Layout,
        dy: &CpuStorage,
        dl: &Layout,
        x: &CpuStorage,
        xl: &Layout,
    ) -> Result<()> {
        let (start, end) = span(al)?;
        float_dispatch!(OP, "acc", (acc, dy, x), |a, d, x| {
            let d = check::cpu_slice(OP, "dy", d, dl)?;
            let x = check::cpu_slice(OP, "x", x, xl)?;
            add_cpu(&mut a[start..end], d, x, self.rows, self.n, self.k);
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        al: &Layout,
        dy: &candle_core::CudaStorage,
        dl: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        let span = span(al)?;
        cuda::add(self, acc, span, cuda::Inputs { dy, dl, x, xl })
    }
}

/// The elements of the accumulator's storage that `al` covers (contiguous, checked by the
/// wrapper; any start offset, so a view into a larger buffer accumulates in place).
fn span(al: &Layout) -> Result<(usize, usize)> {
    al.contiguous_offsets().ok_or_else(|| {
        crate::KernelError::NotContiguous {
            op: OP,
            input: "acc",
        }
        .into()
    })
}

fn add_cpu<T: WithDType>(acc: &mut [T], dy: &[T], x: &[T], rows: usize, n: usize, k: usize) {
    let mut sum = vec![0f32; n * k];
    for r in 0..rows {
        let (d, xr) = (&dy[r * n..(r + 1) * n], &x[r * k..(r + 1) * k]);
        for (i, &di) in d.iter().enumerate() {
            let di = check::f32_of(di);
            for (s, &xj) in sum[i * k..(i + 1) * k].iter_mut().zip(xr) {
                *s += di * check::f32_of(xj);
            }
        }
    }
    for (a, s) in acc.iter_mut().zip(sum) {
        *a = T::from_f64(f64::from(check::f32_of(*a) + s));
    }
}
