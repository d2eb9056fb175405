//! The CPU decode attention: loops over each sequence's visible cache positions only.

use candle_core::{CpuStorage, Layout, Result, WithDType};

use super::{DecodeAttention, OP};
use crate::{KernelError, check};

/// The output `[batch, 1, heads * head_dim]` of `op` over contiguous q, k and v.
pub(super) fn forward<T: WithDType>(
    op: &DecodeAttention,
    q: &[T],
    ql: &Layout,
    k: &[T],
    kl: &Layout,
    v: &[T],
    vl: &Layout,
) -> Result<CpuStorage> {
    let q = check::cpu_slice(OP, "q", q, ql)?;
    let k = check::cpu_slice(OP, "k_cache", k, kl)?;
    let v = check::cpu_slice(OP, "v_cache", v, vl)?;
    let positions = op.positions.to_vec1::<u32>()?;
    let table = op
        .table
        .as_ref()
        .map(|t| t.flatten_all()?.to_vec1::<u32>())
        .transpose()?;
    let d = op.dims;
    let (hd, group) = (d.head_dim, d.group());
    let mut out = Vec::with_capacity(d.batch * d.heads * hd);
    let max_seq = d.index.max_seq();
    let mut weights = Vec::with_capacity(max_seq);
    let mut acc = vec![0f32; hd];
    for (b, &position) in positions.iter().enumerate() {
        let pos = position as usize;
        if pos >= max_seq {
            return Err(KernelError::PositionPastCache {
                sequence: b,
                position,
                max_seq,
            }
            .into());
        }
        let visible = pos.saturating_sub(op.reach)..pos + 1;
        // Each visible position's cache row, the same for every head of a KV head.
        let place =
            |j: usize, kvh: usize| d.index.place(OP, table.as_deref(), b, j, d.kv_heads, kvh);
        for h in 0..d.heads {
            let qh = &q[(b * d.heads + h) * hd..][..hd];
            weights.clear();
            for j in visible.clone() {
                let kj = &k[place(j, h / group)? * hd..][..hd];
                let dot: f32 = qh
                    .iter()
                    .zip(kj)
                    .map(|(&a, &b)| check::f32_of(a) * check::f32_of(b))
                    .sum();
                weights.push(dot * op.scale);
            }
            let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for w in &mut weights {
                *w = (*w - max).exp();
                sum += *w;
            }
            acc.fill(0.0);
            for (j, &w) in visible.clone().zip(&weights) {
                let vj = &v[place(j, h / group)? * hd..][..hd];
                for (a, &x) in acc.iter_mut().zip(vj) {
                    *a += w * check::f32_of(x);
                }
            }
            out.extend(acc.iter().map(|&a| T::from_f64(f64::from(a / sum))));
        }
    }
    Ok(T::to_cpu_storage_owned(out))
}
