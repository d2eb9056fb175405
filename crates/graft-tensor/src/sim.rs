//! [`Ops`] on the simulator ([`SimOps`]): each op is one [`SimQueue::launch_kernel`] whose
//! closure is a plain host loop over simulated memory.
//!
//! The closures capture only addresses and sizes, and read everything else (operands, the
//! device position) from memory when they run: during a capture they are recorded, and every
//! replay runs them again against the memory as it is then, as a GPU graph would.

use graft_core::{Device, DeviceError, DevicePtr};
use graft_sim::{SimDevice, SimMemory, SimQueue};

use crate::backend::{
    AddNormArgs, ArgmaxArgs, AttentionArgs, AttnDims, Backend, EmbedDims, EmbedNormArgs,
    LinearArgs, LoopArgs, LoopDims, MatmulDims, NormDims, Ops, SampleArgs,
};
use crate::error::Result;
use crate::philox::{self, RNG_WORDS};
use crate::sampling::{self, Sampling};
use crate::tensor::Tensor;

fn f32s(m: &SimMemory, p: DevicePtr, n: usize) -> std::result::Result<Vec<f32>, DeviceError> {
    m.f32s(p, n)
}

fn i32s(m: &SimMemory, p: DevicePtr, n: usize) -> std::result::Result<Vec<i32>, DeviceError> {
    let mut v = vec![0i32; n];
    m.read_i32(p, &mut v)?;
    Ok(v)
}

/// The device position at `pos`, clamped into `0..len` (`len > 0`).
fn position(m: &SimMemory, pos: DevicePtr, len: usize) -> std::result::Result<usize, DeviceError> {
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

/// `x + bias` (`bias` optional, `[cols]`) for `rows` rows.
fn logits(
    m: &SimMemory,
    x: DevicePtr,
    bias: Option<DevicePtr>,
    rows: usize,
    cols: usize,
) -> std::result::Result<Vec<f32>, DeviceError> {
    let mut v = f32s(m, x, rows * cols)?;
    if let Some(b) = bias {
        let bs = f32s(m, b, cols)?;
        for row in v.chunks_exact_mut(cols.max(1)) {
            row.iter_mut().zip(&bs).for_each(|(v, b)| *v += b);
        }
    }
    Ok(v)
}

/// The device position's raw value.
fn position_value(m: &SimMemory, pos: DevicePtr) -> std::result::Result<i32, DeviceError> {
    let mut p = [0i32];
    m.read_i32(pos, &mut p)?;
    Ok(p[0])
}

fn increment_at(
    m: &mut SimMemory,
    pos: DevicePtr,
    limit: i32,
) -> std::result::Result<(), DeviceError> {
    let p = position_value(m, pos)?;
    m.write_i32(pos, &[p.saturating_add(1).min(limit)])
}

/// The decoder's kernels on a simulated device: host loops launched on its queue.
#[derive(Clone, Debug)]
pub struct SimOps {
    queue: SimQueue,
}

impl SimOps {
    /// The kernels on `queue`'s device (nothing to compile).
    pub fn new(queue: &SimQueue) -> SimOps {
        SimOps {
            queue: queue.clone(),
        }
    }

    /// The address of `t`'s first element, checked to be memory of this device that `t`'s
    /// buffer still owns.
    fn at(&self, t: &Tensor) -> Result<DevicePtr> {
        Ok(self.queue.buffer_addr(t.buffer(), t.offset(), t.bytes())?)
    }

    /// The addresses of a token loop's state: out, cur, left, ctl, pos.
    fn loop_ptrs(
        &self,
        a: &LoopArgs<'_>,
    ) -> Result<(DevicePtr, DevicePtr, DevicePtr, DevicePtr, DevicePtr)> {
        Ok((
            self.at(a.out)?,
            self.at(a.cur)?,
            self.at(a.left)?,
            self.at(a.ctl)?,
            self.at(a.pos)?,
        ))
    }

    /// The address of `t`'s first element, if there is a `t`.
    fn opt(&self, t: Option<&Tensor>) -> Result<Option<DevicePtr>> {
        t.map(|t| self.at(t)).transpose()
    }

    /// Launches `f` as kernel `name` with its arguments declared (addresses and shape values,
    /// each a little-endian `u64`, as a CUDA launch passes them), so graft's guards compare
    /// them.
    fn launch<F>(&self, name: &'static str, args: &[u64], f: F) -> Result<()>
    where
        F: Fn(&mut SimMemory) -> std::result::Result<(), DeviceError> + Send + Sync + 'static,
    {
        let bytes: Vec<[u8; 8]> = args.iter().map(|a| a.to_le_bytes()).collect();
        let args: Vec<&[u8]> = bytes.iter().map(|b| &b[..]).collect();
        Ok(self.queue.launch_kernel_with_args(name, &args, f)?)
    }
}

/// A token loop's shape as kernel arguments.
fn loop_dims(d: LoopDims) -> [u64; 4] {
    [d.rows as u64, d.steps as u64, d.ctx as u64, d.eos as u64]
}

/// An optional address as a kernel argument (0 for none).
fn arg(at: Option<DevicePtr>) -> u64 {
    at.map_or(0, |a| a.0)
}

impl Backend for SimDevice {
    type Ops = SimOps;

    fn load_ops(&self) -> std::result::Result<SimOps, DeviceError> {
        Ok(SimOps::new(self.queue()))
    }
}

impl Ops for SimOps {
    fn add(&self, out: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        let n = out.numel();
        let (out, a, b) = (self.at(out)?, self.at(a)?, self.at(b)?);
        self.launch("add", &[out.0, a.0, b.0, n as u64], move |m| {
            m.zip_f32(out, a, b, n, |x, y| x + y)
        })
    }

    fn linear(&self, a: LinearArgs<'_>, d: MatmulDims) -> Result<()> {
        let (out, x, w) = (self.at(a.out)?, self.at(a.x)?, self.at(a.w)?);
        let (bias, residual, gelu) = (self.opt(a.bias)?, self.opt(a.residual)?, a.gelu);
        let args = [out.0, x.0, w.0, arg(bias), arg(residual), u64::from(gelu)];
        let dims = [d.rows as u64, d.k as u64, d.n as u64];
        self.launch("linear", &[&args[..], &dims].concat(), move |m| {
            let xs = f32s(m, x, d.rows * d.k)?;
            let ws = f32s(m, w, d.k * d.n)?;
            let bs = bias.map(|b| f32s(m, b, d.n)).transpose()?;
            let mut o = host_linear(&xs, &ws, bs.as_deref(), d);
            if gelu {
                o.iter_mut().for_each(|v| *v = gelu_tanh(*v));
            }
            if let Some(r) = residual {
                let rs = f32s(m, r, d.rows * d.n)?;
                o.iter_mut().zip(&rs).for_each(|(v, r)| *v += r);
            }
            m.write_f32(out, &o)
        })
    }

    fn embed_norm(&self, a: EmbedNormArgs<'_>, d: EmbedDims) -> Result<()> {
        let (x_out, h_out, ids) = (self.at(a.x)?, self.at(a.h)?, self.at(a.ids)?);
        let (table, pos_table, pos) = (self.at(a.table)?, self.at(a.pos_table)?, self.at(a.pos)?);
        let (gamma, beta) = (self.at(a.gamma)?, self.at(a.beta)?);
        let args = [
            x_out.0,
            h_out.0,
            ids.0,
            table.0,
            pos_table.0,
            pos.0,
            gamma.0,
            beta.0,
        ];
        let dims = [d.rows, d.vocab, d.ctx, d.dim].map(|v| v as u64);
        let eps = u64::from(d.eps.to_bits());
        self.launch(
            "embed_norm",
            &[&args[..], &dims, &[eps]].concat(),
            move |m| {
                if d.ctx == 0 {
                    return Ok(());
                }
                let ids = i32s(m, ids, d.rows)?;
                let p = position(m, pos, d.ctx)?;
                let prow = f32s(m, pos_table.offset(p * d.dim * 4), d.dim)?;
                let mut x = vec![0.0f32; d.rows * d.dim];
                for (r, &id) in ids.iter().enumerate() {
                    let xr = &mut x[r * d.dim..(r + 1) * d.dim];
                    if id >= 0 && (id as usize) < d.vocab {
                        let row = f32s(m, table.offset(id as usize * d.dim * 4), d.dim)?;
                        xr.copy_from_slice(&row);
                    }
                    xr.iter_mut().zip(&prow).for_each(|(v, p)| *v += p);
                }
                m.write_f32(x_out, &x)?;
                let g = f32s(m, gamma, d.dim)?;
                let b = f32s(m, beta, d.dim)?;
                norm_rows(&mut x, &g, &b, d.dim, d.eps);
                m.write_f32(h_out, &x)
            },
        )
    }

    fn add_norm(&self, a: AddNormArgs<'_>, d: NormDims) -> Result<()> {
        let (x_out, h_out) = (self.at(a.x_out)?, self.at(a.h)?);
        let (x, upd, bias) = (self.at(a.x)?, self.at(a.a)?, self.opt(a.bias)?);
        let (gamma, beta) = (self.at(a.gamma)?, self.at(a.beta)?);
        let args = [x_out.0, h_out.0, x.0, upd.0, arg(bias), gamma.0, beta.0];
        let dims = [d.rows as u64, d.dim as u64, u64::from(d.eps.to_bits())];
        self.launch("add_norm", &[&args[..], &dims].concat(), move |m| {
            let n = d.rows * d.dim;
            let xs = f32s(m, x, n)?;
            let mut v = f32s(m, upd, n)?;
            let bs = bias.map(|b| f32s(m, b, d.dim)).transpose()?;
            for (row, xr) in v
                .chunks_exact_mut(d.dim.max(1))
                .zip(xs.chunks_exact(d.dim.max(1)))
            {
                for (c, (v, x)) in row.iter_mut().zip(xr).enumerate() {
                    *v = x + (*v + bs.as_ref().map_or(0.0, |b| b[c]));
                }
            }
            m.write_f32(x_out, &v)?;
            let g = f32s(m, gamma, d.dim)?;
            let b = f32s(m, beta, d.dim)?;
            norm_rows(&mut v, &g, &b, d.dim, d.eps);
            m.write_f32(h_out, &v)
        })
    }

    fn attention_step(&self, a: AttentionArgs<'_>, d: AttnDims) -> Result<()> {
        let (out, qkv, bias) = (self.at(a.out)?, self.at(a.qkv)?, self.opt(a.bias)?);
        let (k_cache, v_cache, pos) = (self.at(a.k_cache)?, self.at(a.v_cache)?, self.at(a.pos)?);
        let args = [out.0, qkv.0, arg(bias), k_cache.0, v_cache.0, pos.0];
        let dims = [d.batch, d.heads, d.head_dim, d.ctx].map(|v| v as u64);
        let scale = u64::from(d.scale.to_bits());
        self.launch(
            "attention_step",
            &[&args[..], &dims, &[scale]].concat(),
            move |m| {
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
            },
        )
    }

    fn argmax_step(&self, a: ArgmaxArgs<'_>, rows: usize, cols: usize, limit: i32) -> Result<()> {
        let (out, x, bias, pos) = (
            self.at(a.out)?,
            self.at(a.x)?,
            self.opt(a.bias)?,
            self.at(a.pos)?,
        );
        let args = [
            out.0,
            x.0,
            arg(bias),
            pos.0,
            rows as u64,
            cols as u64,
            limit as u64,
        ];
        self.launch("argmax_step", &args, move |m| {
            let v = logits(m, x, bias, rows, cols)?;
            let top: Vec<i32> = v
                .chunks_exact(cols.max(1))
                .take(rows)
                .map(|row| sampling::argmax(row).unwrap_or(0) as i32)
                .collect();
            m.write_i32(out, &top)?;
            increment_at(m, pos, limit)
        })
    }

    fn sample_step(
        &self,
        a: SampleArgs<'_>,
        rows: usize,
        cols: usize,
        limit: i32,
        s: Sampling,
    ) -> Result<()> {
        let (out, x, bias) = (self.at(a.out)?, self.at(a.x)?, self.opt(a.bias)?);
        let (pos, rng) = (self.at(a.pos)?, self.at(a.rng)?);
        let args = [
            out.0,
            x.0,
            arg(bias),
            pos.0,
            rng.0,
            rows as u64,
            cols as u64,
        ];
        let sampling = [
            limit as u64,
            u64::from(s.temperature.to_bits()),
            u64::from(s.top_k),
        ];
        self.launch("sample_step", &[&args[..], &sampling].concat(), move |m| {
            let v = logits(m, x, bias, rows, cols)?;
            let mut words = [0u32; RNG_WORDS];
            m.read_u32(rng, &mut words)?;
            let (seed, offset) = philox::rng_parts(words);
            let picks: Vec<i32> = v
                .chunks_exact(cols.max(1))
                .take(rows)
                .enumerate()
                .map(|(r, row)| sampling::sample_row(row, s, philox::draw(seed, offset, r as u32)))
                .collect();
            m.write_i32(out, &picks)?;
            m.write_u32(rng, &philox::rng_words(seed, offset.wrapping_add(1)))?;
            increment_at(m, pos, limit)
        })
    }

    fn loop_begin(
        &self,
        a: &LoopArgs<'_>,
        tokens: &Tensor,
        limits: &Tensor,
        d: LoopDims,
    ) -> Result<()> {
        let (out, cur, left, ctl, pos) = self.loop_ptrs(a)?;
        let (tokens, limits) = (self.at(tokens)?, self.at(limits)?);
        let args = [out.0, cur.0, left.0, ctl.0, pos.0, tokens.0, limits.0];
        self.launch(
            "loop_begin",
            &[&args[..], &loop_dims(d)].concat(),
            move |m| {
                let lim = i32s(m, limits, d.rows)?;
                let toks = i32s(m, tokens, d.rows)?;
                m.write_i32(out, &vec![crate::PAD; d.steps * d.rows])?;
                m.write_i32(cur, &toks)?;
                m.write_i32(left, &lim)?;
                let run =
                    d.steps > 0 && position_value(m, pos)? < d.ctx && lim.iter().any(|&l| l > 0);
                m.write_u32(ctl, &[u32::from(run), 0])
            },
        )
    }

    fn loop_record(&self, a: &LoopArgs<'_>, next: &Tensor, d: LoopDims) -> Result<()> {
        let (out, cur, left, ctl, pos) = self.loop_ptrs(a)?;
        let next = self.at(next)?;
        let args = [out.0, cur.0, left.0, ctl.0, pos.0, next.0];
        self.launch(
            "loop_record",
            &[&args[..], &loop_dims(d)].concat(),
            move |m| {
                let mut c = [0u32; 2];
                m.read_u32(ctl, &mut c)?;
                let i = c[1] as usize;
                let tokens = i32s(m, next, d.rows)?;
                let mut lefts = i32s(m, left, d.rows)?;
                for (r, (&t, l)) in tokens.iter().zip(lefts.iter_mut()).enumerate() {
                    if *l > 0 && i < d.steps {
                        m.write_i32(out.offset((i * d.rows + r) * 4), &[t])?;
                        *l = if t == d.eos { 0 } else { *l - 1 };
                    }
                }
                m.write_i32(left, &lefts)?;
                m.write_i32(cur, &tokens)?;
                let run = i + 1 < d.steps
                    && position_value(m, pos)? < d.ctx
                    && lefts.iter().any(|&l| l > 0);
                m.write_u32(ctl, &[u32::from(run), c[1].wrapping_add(1)])
            },
        )
    }
}
