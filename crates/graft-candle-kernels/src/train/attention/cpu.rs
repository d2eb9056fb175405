//! The CPU causal attention and its gradients: loops over each row's visible keys in f32, the
//! same math as the CUDA kernels (scores scaled by `1 / sqrt(head_dim)`, weights
//! `exp(score - lse)` in the backward pass, `delta = rowsum(dO * O)`).

use candle_core::{CpuStorage, DType, Layout, Result, Tensor, WithDType};

use super::{AttentionDkv, AttentionDq, Dims, OP};
use crate::check;

/// A contiguous CPU input as f32 (its start offset applied).
fn f32s<T: WithDType>(input: &'static str, data: &[T], layout: &Layout) -> Result<Vec<f32>> {
    Ok(check::cpu_slice(OP, input, data, layout)?
        .iter()
        .map(|&x| check::f32_of(x))
        .collect())
}

/// A tensor the op holds, as f32 in its contiguous order.
fn held(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// `acc += w * x` elementwise.
fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(x) {
        *a += w * x;
    }
}

fn store<T: WithDType>(values: impl IntoIterator<Item = f32>) -> CpuStorage {
    T::to_cpu_storage_owned(
        values
            .into_iter()
            .map(|x| T::from_f64(f64::from(x)))
            .collect(),
    )
}

/// The output `[batch, seq, heads * head_dim]` and the row log-sum-exps `[batch, heads, seq]`.
pub(super) fn forward<T: WithDType>(
    d: Dims,
    q: &[T],
    ql: &Layout,
    k: &[T],
    kl: &Layout,
    v: &[T],
    vl: &Layout,
) -> Result<(CpuStorage, Vec<f32>)> {
    let q = f32s("q", q, ql)?;
    let k = f32s("k", k, kl)?;
    let v = f32s("v", v, vl)?;
    let (hd, scale) = (d.head_dim, d.scale());
    let mut out = vec![0f32; d.q_len()];
    let mut lse = vec![0f32; d.batch * d.heads * d.seq];
    let mut w = vec![0f32; d.seq];
    for b in 0..d.batch {
        for h in 0..d.heads {
            let kvh = h / d.group();
            for i in 0..d.seq {
                let qi = &q[d.q_at(b, i, h)..][..hd];
                for (j, wj) in w[..=i].iter_mut().enumerate() {
                    *wj = dot(qi, &k[d.kv_at(b, j, kvh)..][..hd]) * scale;
                }
                let max = w[..=i].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for wj in &mut w[..=i] {
                    *wj = (*wj - max).exp();
                    sum += *wj;
                }
                let o = &mut out[d.q_at(b, i, h)..][..hd];
                for (j, &wj) in w[..=i].iter().enumerate() {
                    axpy(o, wj, &v[d.kv_at(b, j, kvh)..][..hd]);
                }
                for x in o.iter_mut() {
                    *x /= sum;
                }
                lse[d.row_at(b, h, i)] = max + sum.ln();
            }
        }
    }
    Ok((store::<T>(out), lse))
}

/// The query gradient `[batch, seq, heads * head_dim]` and the row deltas `[batch, heads, seq]`.
pub(super) fn dq<T: WithDType>(
    op: &AttentionDq,
    q: &[T],
    ql: &Layout,
    k: &[T],
    kl: &Layout,
    v: &[T],
    vl: &Layout,
) -> Result<(CpuStorage, Vec<f32>)> {
    let q = f32s("q", q, ql)?;
    let k = f32s("k", k, kl)?;
    let v = f32s("v", v, vl)?;
    let (o, g, lse) = (held(&op.out)?, held(&op.grad)?, held(&op.lse)?);
    let d = op.dims;
    let (hd, scale) = (d.head_dim, d.scale());
    let mut dq = vec![0f32; d.q_len()];
    let mut delta = vec![0f32; d.batch * d.heads * d.seq];
    for b in 0..d.batch {
        for h in 0..d.heads {
            let kvh = h / d.group();
            for i in 0..d.seq {
                let at = d.q_at(b, i, h);
                let (qi, gi) = (&q[at..][..hd], &g[at..][..hd]);
                let di = dot(gi, &o[at..][..hd]);
                let li = lse[d.row_at(b, h, i)];
                delta[d.row_at(b, h, i)] = di;
                let acc = &mut dq[at..][..hd];
                for j in 0..=i {
                    let kj = &k[d.kv_at(b, j, kvh)..][..hd];
                    let p = (dot(qi, kj) * scale - li).exp();
                    let ds = p * (dot(gi, &v[d.kv_at(b, j, kvh)..][..hd]) - di);
                    axpy(acc, ds, kj);
                }
                for x in acc.iter_mut() {
                    *x *= scale;
                }
            }
        }
    }
    Ok((store::<T>(dq), delta))
}

/// The key gradient and then the value gradient, `[2, batch, seq, kv_heads * head_dim]`, each
/// summed over its group's query heads in f32 and rounded once.
pub(super) fn dkv<T: WithDType>(
    op: &AttentionDkv,
    q: &[T],
    ql: &Layout,
    k: &[T],
    kl: &Layout,
    v: &[T],
    vl: &Layout,
) -> Result<CpuStorage> {
    let q = f32s("q", q, ql)?;
    let k = f32s("k", k, kl)?;
    let v = f32s("v", v, vl)?;
    let (g, lse, delta) = (held(&op.grad)?, held(&op.lse)?, held(&op.delta)?);
    let d = op.dims;
    let (hd, scale) = (d.head_dim, d.scale());
    let mut dk = vec![0f32; d.kv_len()];
    let mut dv = vec![0f32; d.kv_len()];
    for b in 0..d.batch {
        for h in 0..d.heads {
            let kvh = h / d.group();
            for i in 0..d.seq {
                let at = d.q_at(b, i, h);
                let (qi, gi) = (&q[at..][..hd], &g[at..][..hd]);
                let (li, di) = (lse[d.row_at(b, h, i)], delta[d.row_at(b, h, i)]);
                for j in 0..=i {
                    let kv = d.kv_at(b, j, kvh);
                    let p = (dot(qi, &k[kv..][..hd]) * scale - li).exp();
                    let ds = p * (dot(gi, &v[kv..][..hd]) - di);
                    axpy(&mut dk[kv..][..hd], ds, qi);
                    axpy(&mut dv[kv..][..hd], p, gi);
                }
            }
        }
    }
    Ok(store::<T>(dk.into_iter().map(|x| x * scale).chain(dv)))
}
