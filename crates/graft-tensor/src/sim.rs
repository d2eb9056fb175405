//! [`Ops`] on the simulator: each op is one [`SimQueue::launch_kernel`] whose closure is a
//! plain host loop over simulated memory.
//!
//! The closures capture only addresses and sizes, and read everything else (operands, the
//! device position) from memory when they run: during a capture they are recorded, and every
//! replay runs them again against the memory as it is then, as a GPU graph would.

use graft_core::{DeviceError, DevicePtr};
use graft_sim::{SimMemory, SimQueue};

use crate::backend::{
    AddNormArgs, AttnDims, CacheDims, EmbedDims, EmbedNormArgs, GatherDims, LinearArgs, MatmulDims,
    NormDims, Ops, PositionDims, SoftmaxDims,
};

fn f32s(m: &SimMemory, p: DevicePtr, n: usize) -> Result<Vec<f32>, DeviceError> {
    m.f32s(p, n)
}

fn i32s(m: &SimMemory, p: DevicePtr, n: usize) -> Result<Vec<i32>, DeviceError> {
    let mut v = vec![0i32; n];
    m.read_i32(p, &mut v)?;
    Ok(v)
}

/// The device position at `pos`, clamped into `0..len` (`len > 0`).
fn position(m: &SimMemory, pos: DevicePtr, len: usize) -> Result<usize, DeviceError> {
    let mut p = [0i32];
    m.read_i32(pos, &mut p)?;
    Ok((p[0].max(0) as usize).min(len.saturating_sub(1)))
}

/// GELU with the tanh approximation, as the CUDA kernel computes it.
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (K * (x + 0.044_715 * x * x * x)).tanh())
}

/// Layer norm of each `dim`-wide row of `v`, in place.
fn norm_rows(v: &mut [f32], g: &[f32], b: &[f32], dim: usize, eps: f32) {
    for row in v.chunks_exact_mut(dim.max(1)) {
        let mean = row.iter().sum::<f32>() / dim as f32;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / dim as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((x, g), b) in row.iter_mut().zip(g).zip(b) {
            *x = (*x - mean) * inv * g + b;
        }
    }
}

/// `x · w (+ bias)` on host slices.
fn host_linear(xs: &[f32], ws: &[f32], bias: Option<&[f32]>, d: MatmulDims) -> Vec<f32> {
    let mut o = vec![0.0f32; d.rows * d.n];
    for i in 0..d.rows {
        let orow = &mut o[i * d.n..(i + 1) * d.n];
        for p in 0..d.k {
            let a = xs[i * d.k + p];
            for (c, wv) in orow.iter_mut().zip(&ws[p * d.n..(p + 1) * d.n]) {
                *c += a * wv;
            }
        }
    }
    if let Some(bs) = bias {
        for row in o.chunks_exact_mut(d.n.max(1)) {
            for (c, b) in row.iter_mut().zip(bs) {
                *c += b;
            }
        }
    }
    o
}

/// Index of the largest entry of each row (first on ties, NaNs never win, all-NaN gives 0).
fn argmax_rows(v: &[f32], rows: usize, cols: usize) -> Vec<i32> {
    v.chunks_exact(cols.max(1))
        .take(rows)
        .map(|row| {
            let mut best = 0usize;
            let mut best_v = f32::NEG_INFINITY;
            let mut found = false;
            for (j, &x) in row.iter().enumerate() {
                if !x.is_nan() && (!found || x > best_v) {
                    best = j;
                    best_v = x;
                    found = true;
                }
            }
            best as i32
        })
        .collect()
}

fn increment_at(m: &mut SimMemory, pos: DevicePtr, limit: i32) -> Result<(), DeviceError> {
    let mut p = [0i32];
    m.read_i32(pos, &mut p)?;
    m.write_i32(pos, &[p[0].saturating_add(1).min(limit)])
}

impl Ops for SimQueue {
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        SimQueue::write(self, dst, src)
    }

    fn prepare(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn embedding(
        &self,
        out: DevicePtr,
        ids: DevicePtr,
        table: DevicePtr,
        d: GatherDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("embedding", move |m| {
            let ids = i32s(m, ids, d.rows)?;
            let mut o = vec![0.0f32; d.rows * d.dim];
            for (r, &id) in ids.iter().enumerate() {
                if id >= 0 && (id as usize) < d.vocab {
                    let row = f32s(m, table.offset(id as usize * d.dim * 4), d.dim)?;
                    o[r * d.dim..(r + 1) * d.dim].copy_from_slice(&row);
                }
            }
            m.write_f32(out, &o)
        })
    }

    fn add_position(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        table: DevicePtr,
        pos: DevicePtr,
        d: PositionDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("add_position", move |m| {
            let p = position(m, pos, d.ctx)?;
            let row = f32s(m, table.offset(p * d.dim * 4), d.dim)?;
            let mut v = f32s(m, x, d.rows * d.dim)?;
            for chunk in v.chunks_exact_mut(d.dim.max(1)) {
                for (a, b) in chunk.iter_mut().zip(&row) {
                    *a += b;
                }
            }
            m.write_f32(out, &v)
        })
    }

    fn add(&self, out: DevicePtr, a: DevicePtr, b: DevicePtr, n: usize) -> Result<(), DeviceError> {
        self.launch_kernel("add", move |m| m.zip_f32(out, a, b, n, |x, y| x + y))
    }

    fn layer_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        gamma: DevicePtr,
        beta: DevicePtr,
        d: NormDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("layer_norm", move |m| {
            let g = f32s(m, gamma, d.dim)?;
            let b = f32s(m, beta, d.dim)?;
            let mut v = f32s(m, x, d.rows * d.dim)?;
            norm_rows(&mut v, &g, &b, d.dim, d.eps);
            m.write_f32(out, &v)
        })
    }

    fn gelu(&self, out: DevicePtr, x: DevicePtr, n: usize) -> Result<(), DeviceError> {
        self.launch_kernel("gelu", move |m| m.map_f32(out, x, n, gelu_tanh))
    }

    fn masked_softmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: SoftmaxDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("masked_softmax", move |m| {
            if d.rows == 0 || d.cols == 0 {
                return Ok(());
            }
            let valid = position(m, pos, d.cols)? + 1;
            let mut v = f32s(m, x, d.rows * d.cols)?;
            for row in v.chunks_exact_mut(d.cols) {
                let (live, masked) = row.split_at_mut(valid);
                let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for e in live.iter_mut() {
                    *e = (*e - max).exp();
                    sum += *e;
                }
                for e in live.iter_mut() {
                    *e /= sum;
                }
                masked.fill(0.0);
            }
            m.write_f32(out, &v)
        })
    }

    fn attention_scores(
        &self,
        out: DevicePtr,
        q: DevicePtr,
        k_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("attention_scores", move |m| {
            if d.ctx == 0 {
                return Ok(());
            }
            let dm = d.model_dim();
            let p = position(m, pos, d.ctx)?;
            let qs = f32s(m, q, d.batch * dm)?;
            let mut o = vec![0.0f32; d.batch * d.heads * d.ctx];
            for b in 0..d.batch {
                let ks = f32s(m, k_cache.offset(b * d.ctx * dm * 4), (p + 1) * dm)?;
                for h in 0..d.heads {
                    let qh = &qs[b * dm + h * d.head_dim..][..d.head_dim];
                    for j in 0..=p {
                        let kh = &ks[j * dm + h * d.head_dim..][..d.head_dim];
                        let dot: f32 = qh.iter().zip(kh).map(|(a, b)| a * b).sum();
                        o[(b * d.heads + h) * d.ctx + j] = dot * d.scale;
                    }
                }
            }
            m.write_f32(out, &o)
        })
    }

    fn attention_values(
        &self,
        out: DevicePtr,
        probs: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("attention_values", move |m| {
            if d.ctx == 0 {
                return Ok(());
            }
            let dm = d.model_dim();
            let p = position(m, pos, d.ctx)?;
            let ps = f32s(m, probs, d.batch * d.heads * d.ctx)?;
            let mut o = vec![0.0f32; d.batch * dm];
            for b in 0..d.batch {
                let vs = f32s(m, v_cache.offset(b * d.ctx * dm * 4), (p + 1) * dm)?;
                for h in 0..d.heads {
                    let oh = &mut o[b * dm + h * d.head_dim..][..d.head_dim];
                    for j in 0..=p {
                        let w = ps[(b * d.heads + h) * d.ctx + j];
                        let vh = &vs[j * dm + h * d.head_dim..][..d.head_dim];
                        for (a, v) in oh.iter_mut().zip(vh) {
                            *a += w * v;
                        }
                    }
                }
            }
            m.write_f32(out, &o)
        })
    }

    fn kv_write(
        &self,
        cache: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: CacheDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("kv_write", move |m| {
            if d.ctx == 0 {
                return Ok(());
            }
            let p = position(m, pos, d.ctx)?;
            let xs = f32s(m, x, d.batch * d.dim)?;
            for b in 0..d.batch {
                let dst = cache.offset((b * d.ctx + p) * d.dim * 4);
                m.write_f32(dst, &xs[b * d.dim..(b + 1) * d.dim])?;
            }
            Ok(())
        })
    }

    fn argmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        rows: usize,
        cols: usize,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("argmax", move |m| {
            let v = f32s(m, x, rows * cols)?;
            m.write_i32(out, &argmax_rows(&v, rows, cols))
        })
    }

    fn argmax_step(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        bias: Option<DevicePtr>,
        rows: usize,
        cols: usize,
        pos: DevicePtr,
        limit: i32,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("argmax_step", move |m| {
            let mut v = f32s(m, x, rows * cols)?;
            if let Some(b) = bias {
                let bs = f32s(m, b, cols)?;
                for row in v.chunks_exact_mut(cols.max(1)) {
                    row.iter_mut().zip(&bs).for_each(|(v, b)| *v += b);
                }
            }
            m.write_i32(out, &argmax_rows(&v, rows, cols))?;
            increment_at(m, pos, limit)
        })
    }

    fn linear(&self, a: LinearArgs, d: MatmulDims) -> Result<(), DeviceError> {
        self.launch_kernel("linear", move |m| {
            let xs = f32s(m, a.x, d.rows * d.k)?;
            let ws = f32s(m, a.w, d.k * d.n)?;
            let bs = a.bias.map(|b| f32s(m, b, d.n)).transpose()?;
            let mut o = host_linear(&xs, &ws, bs.as_deref(), d);
            if a.gelu {
                o.iter_mut().for_each(|v| *v = gelu_tanh(*v));
            }
            if let Some(r) = a.residual {
                let rs = f32s(m, r, d.rows * d.n)?;
                o.iter_mut().zip(&rs).for_each(|(v, r)| *v += r);
            }
            m.write_f32(a.out, &o)
        })
    }

    fn embed_norm(&self, a: EmbedNormArgs, d: EmbedDims) -> Result<(), DeviceError> {
        self.launch_kernel("embed_norm", move |m| {
            if d.ctx == 0 {
                return Ok(());
            }
            let ids = i32s(m, a.ids, d.rows)?;
            let p = position(m, a.pos, d.ctx)?;
            let prow = f32s(m, a.pos_table.offset(p * d.dim * 4), d.dim)?;
            let mut x = vec![0.0f32; d.rows * d.dim];
            for (r, &id) in ids.iter().enumerate() {
                let xr = &mut x[r * d.dim..(r + 1) * d.dim];
                if id >= 0 && (id as usize) < d.vocab {
                    let row = f32s(m, a.table.offset(id as usize * d.dim * 4), d.dim)?;
                    xr.copy_from_slice(&row);
                }
                xr.iter_mut().zip(&prow).for_each(|(v, p)| *v += p);
            }
            m.write_f32(a.x, &x)?;
            let g = f32s(m, a.gamma, d.dim)?;
            let b = f32s(m, a.beta, d.dim)?;
            norm_rows(&mut x, &g, &b, d.dim, d.eps);
            m.write_f32(a.h, &x)
        })
    }

    fn add_norm(&self, a: AddNormArgs, d: NormDims) -> Result<(), DeviceError> {
        self.launch_kernel("add_norm", move |m| {
            let n = d.rows * d.dim;
            let xs = f32s(m, a.x, n)?;
            let mut v = f32s(m, a.a, n)?;
            let bs = a.bias.map(|b| f32s(m, b, d.dim)).transpose()?;
            for (row, xr) in v
                .chunks_exact_mut(d.dim.max(1))
                .zip(xs.chunks_exact(d.dim.max(1)))
            {
                for (c, (v, x)) in row.iter_mut().zip(xr).enumerate() {
                    *v = x + (*v + bs.as_ref().map_or(0.0, |b| b[c]));
                }
            }
            m.write_f32(a.x_out, &v)?;
            let g = f32s(m, a.gamma, d.dim)?;
            let b = f32s(m, a.beta, d.dim)?;
            norm_rows(&mut v, &g, &b, d.dim, d.eps);
            m.write_f32(a.h, &v)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_step(
        &self,
        out: DevicePtr,
        qkv: DevicePtr,
        bias: Option<DevicePtr>,
        k_cache: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("attention_step", move |m| {
            if d.ctx == 0 {
                return Ok(());
            }
            let dm = d.model_dim();
            let hd = d.head_dim;
            let p = position(m, pos, d.ctx)?;
            let mut all = f32s(m, qkv, d.batch * 3 * dm)?;
            if let Some(b) = bias {
                let bs = f32s(m, b, 3 * dm)?;
                for row in all.chunks_exact_mut(3 * dm) {
                    row.iter_mut().zip(&bs).for_each(|(v, b)| *v += b);
                }
            }
            let mut o = vec![0.0f32; d.batch * dm];
            for b in 0..d.batch {
                let row = &all[b * 3 * dm..(b + 1) * 3 * dm];
                let at = (b * d.ctx + p) * dm * 4;
                m.write_f32(k_cache.offset(at), &row[dm..2 * dm])?;
                m.write_f32(v_cache.offset(at), &row[2 * dm..])?;
                let ks = f32s(m, k_cache.offset(b * d.ctx * dm * 4), (p + 1) * dm)?;
                let vs = f32s(m, v_cache.offset(b * d.ctx * dm * 4), (p + 1) * dm)?;
                for h in 0..d.heads {
                    let q = &row[h * hd..(h + 1) * hd];
                    let s: Vec<f32> = (0..=p)
                        .map(|j| {
                            let k = &ks[j * dm + h * hd..][..hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * d.scale
                        })
                        .collect();
                    let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = s.iter().map(|v| (v - mx).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    let oh = &mut o[b * dm + h * hd..][..hd];
                    for (j, ej) in e.iter().enumerate() {
                        let vh = &vs[j * dm + h * hd..][..hd];
                        for (a, v) in oh.iter_mut().zip(vh) {
                            *a += ej * v;
                        }
                    }
                    oh.iter_mut().for_each(|a| *a /= sum);
                }
            }
            m.write_f32(out, &o)
        })
    }

    fn increment(&self, pos: DevicePtr, limit: i32) -> Result<(), DeviceError> {
        self.launch_kernel("increment", move |m| increment_at(m, pos, limit))
    }
}
