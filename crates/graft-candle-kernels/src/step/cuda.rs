//! `decode_step` on CUDA: one scratch allocation, then every kernel of the step back to back
//! on the device's stream, each after the first a programmatic dependent of the one before
//! (a rank's sums over the ranks between them).

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map1};
use candle_core::{CudaStorage, Layout, Result, Shape, Tensor, WithDType};

use super::{OP, Step, part};
use crate::attention::cuda::AttentionLaunch;
use crate::linear::cuda::MatvecLaunch;
use crate::nvrtc::{Args, Kernels, address, view};
use crate::rope::cuda::RopeLaunch;
use crate::{MATVEC_ROWS, MAX_PARTS, check};

static KERNELS: Kernels = Kernels::native("graft_kernels_step", include_str!("step.cu"));

/// Alignment of each scratch buffer (what the 16-byte loads need, and more).
const ALIGN: usize = 256;

pub(super) fn forward(
    op: &Step,
    embed: &CudaStorage,
    layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = embed.device.clone();
    let slice = op.map(&embed.slice, &device, layout)?;
    Ok((CudaStorage { slice, device }, op.out_shape()))
}

impl Map1 for Step {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        embed: &CudaSlice<T>,
        device: &CudaDevice,
        layout: &Layout,
    ) -> Result<CudaSlice<T>> {
        let stream = device.cuda_stream();
        let embed = view(OP, "embed", embed, layout)?.device_ptr(&stream).0;
        run::<T>(self, embed, device, &stream)
    }
}

fn run<T: WithDType + DeviceRepr + ValidAsZeroBits>(
    op: &Step,
    embed: u64,
    device: &CudaDevice,
    stream: &std::sync::Arc<CudaStream>,
) -> Result<CudaSlice<T>> {
    let m = &op.model;
    let d = op.dims;
    let (b, heads, kv, hd) = (d.batch, m.heads, m.kv_heads, m.head_dim);
    let attention = crate::attention::Dims::for_step(b, d.index, heads, kv, hd);
    let splits = attention.splits();
    let t = size_of::<T>();
    let mut at = 0usize;
    let mut next = |bytes: usize| {
        let start = at;
        at = (at + bytes).next_multiple_of(ALIGN);
        start
    };
    // The scratch buffers' byte offsets, each ALIGNed, in one allocation.
    let offsets = [
        next(b * d.hidden * t),
        next(b * (heads + 2 * kv) * hd * t),
        next(b * heads * hd * t),
        next(b * heads * hd * t),
        next(b * d.ffn * t),
        next(b * heads * splits * hd * 4),
        next(b * heads * splits * 2 * 4),
        next(b * d.hidden * t),
    ];
    // SAFETY: every byte a kernel uses is written first: the embedding writes h, each
    // projection its output, rope_store q (and the caches), the split kernel the partials
    // the combine kernel uses (see `AttentionLaunch`), the combine attn, the norm kernel
    // `normed` (more rows than the matrix-vector kernel takes) before its projection reads it.
    let scratch = unsafe { device.alloc::<u8>(at)? };
    // SAFETY: the head's projection writes every logit before anything reads them.
    let logits = unsafe { device.alloc::<T>(b * d.vocab)? };
    let base = scratch.device_ptr(stream).0;
    let buf = |offset: usize| base + offset as u64;
    let [h, qkv, q, attn, act, part_o, part_ml, normed] = offsets.map(buf);
    let addr = |t: &Tensor, name| address(OP, t, name, device);
    // The residual stream: a rank's own tensor, or the scratch's first buffer.
    let h = match &op.residual {
        Some(x) => addr(x, "the residual stream")?,
        None => h,
    };
    // A rank's residual stream after a block's attention or MLP: its partial output (plus
    // the residual stream on the rank that adds it) summed over the ranks, in place.
    let adds_residual = m.shard.as_ref().is_none_or(|s| s.adds_residual);
    let reduce = || -> Result<()> {
        let (Some(shard), Some(x)) = (&m.shard, &op.residual) else {
            return Ok(());
        };
        let sum = (shard.reduce)(x.clone())?;
        if addr(&sum, "the sum over the ranks")? != h {
            x.slice_set(&sum, 0, 0)?;
        }
        Ok(())
    };
    let positions = addr(&op.positions, "positions")?;
    let table = match &op.table {
        Some(t) => addr(t, "the block table")?,
        None => 0,
    };

    // The embedding: the first kernel, after the allocations (no programmatic edge); with
    // a split vocabulary the rank's rows, summed over the ranks at once.
    let hidden = d.hidden as u32;
    let vocab = d.vocab as u32;
    let vocab_first = m.shard.as_ref().and_then(|s| s.vocab_first);
    let (split, first) = match vocab_first {
        Some(first) => (1u32, check::u32_of(OP, "the first vocabulary row", first)?),
        None => (0u32, 0u32),
    };
    let tokens = addr(&op.tokens, "tokens")?;
    let mut args = Args::new();
    args.arg(&tokens)
        .arg(&embed)
        .arg(&h)
        .arg(&hidden)
        .arg(&vocab)
        .arg(&first)
        .arg(&split);
    let config = LaunchConfig {
        grid_dim: (b as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let name = format!("graft_step_embed_{}", T::DTYPE.as_str());
    // SAFETY: the arguments match `graft_step_embed_<dtype>(const unsigned int*, const T*, T*,
    // unsigned int, unsigned int, unsigned int, unsigned int)`: tokens holds batch u32
    // (checked), the table vocab * hidden (checked), h batch * hidden (the scratch or the
    // rank's residual stream); the kernel reads only rows below vocab.
    unsafe { KERNELS.launch(device, stream, &name, config, false, &mut args) }?;
    if vocab_first.is_some() {
        reduce()?;
    }

    // The RMS norm of the step's rows of `x` by `weight` into `out` (hidden each).
    let launch_norm = |x: u64, weight: u64, out: u64| -> Result<()> {
        let mut args = Args::new();
        args.arg(&x).arg(&weight).arg(&m.eps).arg(&out).arg(&hidden);
        let config = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = format!("graft_step_norm_{}", T::DTYPE.as_str());
        // SAFETY: the arguments match `graft_step_norm_<dtype>(const T*, const T*, float, T*,
        // unsigned int)` (bf16 or f16: more rows than MATVEC_ROWS only in those, by
        // `decode_step_fits`): x and out are scratch buffers of batch * hidden elements (each
        // ALIGNed, hidden a multiple of 8 as `Dims::of` checked for these rows), the weight a
        // norm of hidden, 16-byte aligned (checked there too); the kernel waits before it
        // reads x.
        unsafe { KERNELS.launch(device, stream, &name, config, true, &mut args) }
    };
    let project = |x: u64,
                   parts: &[(&Tensor, Option<&Tensor>)],
                   norm: Option<&Tensor>,
                   y: u64,
                   k: usize,
                   pair: bool,
                   residual: bool|
     -> Result<()> {
        let mut w = [0u64; MAX_PARTS];
        let mut bias = [0u64; MAX_PARTS];
        let mut ns = [0usize; MAX_PARTS];
        let mut bias_mask = 0u32;
        for (i, (wi, bi)) in parts.iter().enumerate() {
            w[i] = addr(wi, "weight")?;
            ns[i] = wi.dims()[0];
            if let Some(bi) = bi {
                bias[i] = addr(bi, "bias")?;
                bias_mask |= 1 << i;
            }
        }
        for i in 0..MAX_PARTS {
            if i >= parts.len() {
                w[i] = w[0];
            }
            if bias_mask & (1 << i) == 0 {
                bias[i] = w[0];
            }
        }
        // The matrix-vector kernel folds the norm in; with more rows the norm kernel writes
        // the normed rows first and the tensor-core kernel projects them.
        let (x, norm) = match norm {
            Some(n) if b > MATVEC_ROWS => {
                launch_norm(x, addr(n, "norm")?, normed)?;
                (normed, 0)
            }
            Some(n) => (x, addr(n, "norm")?),
            None => (x, 0),
        };
        let launch = MatvecLaunch {
            x,
            w,
            b: bias,
            bias_mask,
            gate: 0,
            norm,
            eps: m.eps,
            y,
            rows: b,
            k,
            ns,
            pair,
            residual,
        };
        // SAFETY: `Dims::of` checked every weight, bias and norm against the model's sizes
        // (contiguous, of T; the op holds clones, so all live); x and y are scratch buffers
        // (or the logits) of rows * k and rows * n elements; rows <= MATVEC_ROWS, or
        // <= TENSOR_ROWS in bf16 or f16 with every weight aligned and no norm
        // (`decode_step_fits`, `Dims::of`); with residual, y holds the residual stream the embedding and
        // the projections before wrote.
        unsafe { launch.launch::<T>(device, stream, true) }
    };
    for (l, (kc, vc)) in m.layers.iter().zip(&op.caches) {
        project(
            h,
            &[part(&l.q), part(&l.k), part(&l.v)],
            Some(&l.attn_norm),
            qkv,
            d.hidden,
            false,
            false,
        )?;
        let caches = (addr(kc, "k_cache")?, addr(vc, "v_cache")?);
        let norms = match &l.qk_norm {
            Some((qn, kn)) => Some((addr(qn, "q norm")?, addr(kn, "k norm")?, m.eps)),
            None => None,
        };
        let rope = RopeLaunch {
            qkv,
            cos: addr(&m.cos, "cos")?,
            sin: addr(&m.sin, "sin")?,
            positions,
            table,
            norms,
            q_out: q,
            caches,
            dims: crate::rope::Dims::for_step(b, d.index, heads, kv, hd, d.table),
            style: m.style,
        };
        // SAFETY: qkv holds batch * (heads + 2 kv) * head_dim elements (just projected), the
        // tables, positions, rows, norms and caches were checked by `Dims::of`, q is scratch of
        // batch * heads * head_dim.
        unsafe { rope.launch::<T>(device, stream, true) }?;
        let attention = AttentionLaunch {
            q,
            k: caches.0,
            v: caches.1,
            positions,
            table,
            part_o,
            part_ml,
            out: attn,
            dims: attention,
            reach: m
                .window
                .map_or(d.index.max_seq(), |w| w.min(d.index.max_seq())),
            scale: 1.0 / (hd as f32).sqrt(),
            tiled: None,
        };
        // SAFETY: q was just written; the caches, positions and rows were checked; the
        // partials' scratch and attn were sized for these dims above.
        unsafe { attention.launch::<T>(device, stream, true) }?;
        project(
            attn,
            &[part(&l.o)],
            None,
            h,
            heads * hd,
            false,
            adds_residual,
        )?;
        reduce()?;
        project(
            h,
            &[(&l.gate, None), (&l.up, None)],
            Some(&l.mlp_norm),
            act,
            d.hidden,
            true,
            false,
        )?;
        project(
            act,
            &[(&l.down, None)],
            None,
            h,
            d.ffn,
            false,
            adds_residual,
        )?;
        reduce()?;
    }
    let out = logits.device_ptr(stream).0;
    project(
        h,
        &[(&m.head, None)],
        Some(&m.norm),
        out,
        d.hidden,
        false,
        false,
    )?;
    // The scratch is freed (stream-ordered) after the last kernel that reads it.
    drop(scratch);
    Ok(logits)
}
