//! [`Ops`] on the simulator: each op is one [`SimDevice::launch_kernel`] whose closure is a
//! plain host loop over simulated memory.
//!
//! The closures capture only addresses and sizes, and read everything else (operands, the
//! device position) from memory when they run: during a capture they are recorded, and every
//! replay runs them again against the memory as it is then, as a GPU graph would.

use graft_core::{DeviceError, DevicePtr};
use graft_sim::{SimDevice, SimMemory};

use crate::backend::{
    AttnDims, CacheDims, GatherDims, MatmulDims, NormDims, Ops, PositionDims, SoftmaxDims,
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

impl Ops for SimDevice {
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
            for row in v.chunks_exact_mut(d.dim.max(1)) {
                let mean = row.iter().sum::<f32>() / d.dim as f32;
                let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / d.dim as f32;
                let inv = 1.0 / (var + d.eps).sqrt();
                for ((x, g), b) in row.iter_mut().zip(&g).zip(&b) {
                    *x = (*x - mean) * inv * g + b;
                }
            }
            m.write_f32(out, &v)
        })
    }

    fn matmul(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        bias: Option<DevicePtr>,
        d: MatmulDims,
    ) -> Result<(), DeviceError> {
        self.launch_kernel("matmul", move |m| {
            let xs = f32s(m, x, d.rows * d.k)?;
            let ws = f32s(m, w, d.k * d.n)?;
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
            if let Some(bias) = bias {
                let bs = f32s(m, bias, d.n)?;
                for row in o.chunks_exact_mut(d.n.max(1)) {
                    for (c, b) in row.iter_mut().zip(&bs) {
                        *c += b;
                    }
                }
            }
            m.write_f32(out, &o)
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
            let ids: Vec<i32> = v
                .chunks_exact(cols.max(1))
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
                .collect();
            m.write_i32(out, &ids)
        })
    }

    fn increment(&self, pos: DevicePtr, limit: i32) -> Result<(), DeviceError> {
        self.launch_kernel("increment", move |m| {
            let mut p = [0i32];
            m.read_i32(pos, &mut p)?;
            m.write_i32(pos, &[p[0].saturating_add(1).min(limit)])
        })
    }
}
