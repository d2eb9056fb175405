//! The test bodies shared by the CPU tests (tests/cpu.rs, CI) and the GPU tests (tests/gpu.rs):
//! each fused op against the unfused candle composition on the same device, with seeded data
//! so a failure reproduces from its case.
#![allow(dead_code, unreachable_pub)]

use candle_core::{D, DType, Device, Result, Tensor};
use graft_candle_kernels::{QkNorm, RopeStyle, add_rms_norm, decode_attention, rope_store, swiglu};
use proptest::prelude::*;

mod argmax;
mod causal;
mod linear;
mod moe;
mod optim;
mod paged;
mod prefill;
mod sample;
mod step;
mod train;
pub use argmax::*;
pub use causal::*;
pub use linear::*;
pub use moe::*;
pub use optim::*;
pub use paged::*;
pub use prefill::*;
pub use sample::*;
pub use step::*;
pub use train::*;

/// `n` values uniform in `[-scale, scale)` from `seed` (SplitMix64).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A tensor of `shape` with seeded values, in `dtype` on `device`.
pub fn random(
    seed: u64,
    shape: &[usize],
    scale: f32,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n, scale), shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// Absolute and relative tolerance of a comparison in `dtype`.
pub fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (4e-3, 4e-3),
        _ => (3e-2, 3e-2),
    }
}

/// The bits of `t` as f32 (exact for every float dtype the ops take), for bit-for-bit checks.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise (and the shapes equal).
pub fn assert_close(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    (atol, rtol): (f32, f32),
) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let got = got.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let want = want.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i} is {g}, expected {w} (atol {atol}, rtol {rtol})"
        );
    }
    Ok(())
}

/// One decode-attention case: the cache is a view of rows `offset .. offset + batch` of a
/// cache of `batch + extra` rows; with `indexed`, the whole cache with each query's row given
/// (`rows`), all of them reading the same row (a prefill chunk's queries).
#[derive(Debug, Clone)]
pub struct AttentionCase {
    pub batch: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub max_seq: usize,
    pub positions: Vec<u32>,
    pub window: Option<usize>,
    pub extra: usize,
    pub offset: usize,
    pub indexed: bool,
    pub seed: u64,
}

pub fn attention_cases() -> impl Strategy<Value = AttentionCase> {
    (
        1usize..=5,
        1usize..=3,
        // 12: more query heads than the kernel takes at once (8).
        prop_oneof![Just(1usize), Just(2), Just(4), Just(8), Just(12)],
        // 36: not a multiple of 8.
        prop_oneof![Just(36usize), Just(40), Just(64), Just(128), Just(256)],
        // Over 1,024: many chunks a row to merge.
        prop_oneof![1usize..=10, 60usize..=70, 120usize..=200, 1000usize..=2100],
        0usize..=2,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(
            |(batch, kv_heads, group, head_dim, max_seq, extra, indexed, seed)| {
                let position = prop_oneof![Just(0u32), Just(max_seq as u32 - 1), 0..max_seq as u32];
                let window = prop_oneof![Just(None), (0..max_seq + 3).prop_map(Some)];
                (
                    proptest::collection::vec(position, batch),
                    window,
                    0..=extra,
                )
                    .prop_map(move |(positions, window, offset)| AttentionCase {
                        batch,
                        kv_heads,
                        group,
                        head_dim,
                        max_seq,
                        positions,
                        window,
                        extra,
                        offset,
                        indexed,
                        seed,
                    })
            },
        )
}

/// The case's cache rows: with `indexed`, every query reads row `offset` of the whole cache.
pub fn case_rows(case: &AttentionCase) -> Option<Vec<u32>> {
    case.indexed.then(|| vec![case.offset as u32; case.batch])
}

/// Whether cache position `j` is visible from `pos`.
pub fn visible(j: usize, pos: usize, window: Option<usize>) -> bool {
    j <= pos && window.is_none_or(|w| j + w >= pos)
}

/// The unfused attention of graft-candle-models' decoder: `softmax(q·kᵀ·scale + mask)·v`
/// per KV head, the mask built from the positions.
pub fn reference_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &[u32],
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let (batch, heads, _, hd) = q.dims4()?;
    let (kv, max_seq) = (k.dim(1)?, k.dim(2)?);
    let mask: Vec<f32> = positions
        .iter()
        .flat_map(|&p| {
            (0..max_seq).map(move |j| {
                if visible(j, p as usize, window) {
                    0.0
                } else {
                    -1e9
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (batch, 1, 1, max_seq), q.device())?;
    let q = q.reshape((batch, kv, heads / kv, hd))?;
    let scores =
        (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * f64::from(scale))?.broadcast_add(&mask)?;
    let e = scores
        .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
        .exp()?;
    let p = e
        .broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(q.dtype())?;
    p.matmul(v)?.reshape((batch, 1, heads * hd))
}

/// The case's q, k view and v view (k and v with `poison` NaN at the positions each row must
/// not read, when set): rows `offset .. offset + batch`, or the whole cache when `indexed`.
pub fn attention_inputs(
    case: &AttentionCase,
    dtype: DType,
    device: &Device,
    poison: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let c = case;
    let heads = c.kv_heads * c.group;
    let q = random(c.seed, &[c.batch, heads, 1, c.head_dim], 2.0, dtype, device)?;
    let rows = c.batch + c.extra;
    let cache = |seed: u64| -> Result<Tensor> {
        let mut data = values(seed, rows * c.kv_heads * c.max_seq * c.head_dim, 1.0);
        if poison {
            for (b, &pos) in c.positions.iter().enumerate() {
                let row = if c.indexed { c.offset } else { c.offset + b };
                for h in 0..c.kv_heads {
                    for j in (0..c.max_seq).filter(|&j| !visible(j, pos as usize, c.window)) {
                        // An indexed row is read up to each query's position: poison only
                        // what no query sees.
                        let seen = c.indexed
                            && c.positions
                                .iter()
                                .any(|&p| visible(j, p as usize, c.window));
                        if !seen {
                            let at = ((row * c.kv_heads + h) * c.max_seq + j) * c.head_dim;
                            data[at..at + c.head_dim].fill(f32::NAN);
                        }
                    }
                }
            }
        }
        let cache = Tensor::from_vec(
            data,
            (rows, c.kv_heads, c.max_seq, c.head_dim),
            &Device::Cpu,
        )?
        .to_dtype(dtype)?
        .to_device(device)?;
        if c.indexed {
            Ok(cache)
        } else {
            cache.narrow(0, c.offset, c.batch)
        }
    };
    Ok((q, cache(c.seed ^ 1)?, cache(c.seed ^ 2)?))
}

/// decode_attention against the unfused reference on `device`.
pub fn check_attention(device: &Device, case: &AttentionCase, dtype: DType) -> Result<()> {
    let (q, k, v) = attention_inputs(case, dtype, device, false)?;
    let positions = Tensor::new(case.positions.as_slice(), device)?;
    let scale = 1.0 / (case.head_dim as f32).sqrt();
    let rows = case_rows(case)
        .map(|r| Tensor::new(r, device))
        .transpose()?;
    let got = decode_attention(&q, &k, &v, &positions, rows.as_ref(), scale, case.window)?;
    assert_eq!(got.dtype(), dtype);
    // The reference reads each query's row as its own.
    let (k, v) = match &rows {
        Some(r) => (k.index_select(r, 0)?, v.index_select(r, 0)?),
        None => (k, v),
    };
    let want = reference_attention(&q, &k, &v, &case.positions, scale, case.window)?;
    assert_close("decode_attention", &got, &want, tolerance(dtype))
}

/// decode_attention reads no cache position a row cannot see: NaN there changes nothing.
pub fn check_attention_reads_only_visible(device: &Device, dtype: DType) -> Result<()> {
    for window in [None, Some(20)] {
        let case = AttentionCase {
            batch: 4,
            kv_heads: 2,
            group: 4,
            head_dim: 64,
            max_seq: 150,
            positions: vec![0, 70, 100, 149],
            window,
            extra: 1,
            offset: 1,
            indexed: false,
            seed: 7,
        };
        let positions = Tensor::new(case.positions.as_slice(), device)?;
        let (q, k, v) = attention_inputs(&case, dtype, device, false)?;
        let (_, k_nan, v_nan) = attention_inputs(&case, dtype, device, true)?;
        let clean = decode_attention(&q, &k, &v, &positions, None, 0.125, window)?;
        let poisoned = decode_attention(&q, &k_nan, &v_nan, &positions, None, 0.125, window)?;
        let poisoned_values = poisoned
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        assert!(
            poisoned_values.iter().all(|x| x.is_finite()),
            "NaN read with window {window:?}"
        );
        assert_close("poisoned cache", &poisoned, &clean, (0.0, 0.0))?;
        let want = reference_attention(&q, &k, &v, &case.positions, 0.125, window)?;
        assert_close("clean cache", &clean, &want, tolerance(dtype))?;
    }
    Ok(())
}

/// One add + RMS norm case: `x` of `lead ++ [hidden]`.
pub fn norm_cases() -> impl Strategy<Value = (Vec<usize>, usize, u64)> {
    (
        proptest::collection::vec(1usize..=5, 0..=2),
        prop_oneof![
            1usize..=70,
            Just(333usize),
            Just(1024),
            Just(1500),
            Just(4096),
            Just(9000)
        ],
        any::<u64>(),
    )
}

/// add_rms_norm against `x + residual` (exactly) and the RMS norm of that sum computed in f32.
pub fn check_add_rms_norm(
    device: &Device,
    lead: &[usize],
    hidden: usize,
    seed: u64,
    dtype: DType,
) -> Result<()> {
    let mut shape = lead.to_vec();
    shape.push(hidden);
    let x = random(seed, &shape, 3.0, dtype, device)?;
    let residual = random(seed ^ 1, &shape, 3.0, dtype, device)?;
    let weight = random(seed ^ 2, &[hidden], 1.5, dtype, device)?;
    let eps = 1e-5;
    let (sum, normed) = add_rms_norm(&x, &residual, &weight, eps)?;
    let want_sum = (&x + &residual)?;
    assert_close("add_rms_norm sum", &sum, &want_sum, (0.0, 0.0))?;
    let s = want_sum.to_dtype(DType::F32)?;
    let rms = (s.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?;
    let want = s
        .broadcast_div(&rms)?
        .broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .to_dtype(dtype)?;
    let (atol, rtol) = tolerance(dtype);
    // The f32 sums of squares differ in order only; one rounding to the dtype either side.
    assert_close(
        "add_rms_norm normed",
        &normed,
        &want,
        (atol.max(1e-5) * 4.0, rtol.max(1e-5)),
    )
}

/// swiglu against `silu(gate) * up` computed in f32 and rounded once.
pub fn check_swiglu(device: &Device, shape: &[usize], seed: u64, dtype: DType) -> Result<()> {
    let gate = random(seed, shape, 6.0, dtype, device)?;
    let up = random(seed ^ 1, shape, 2.0, dtype, device)?;
    let got = swiglu(&gate, &up)?;
    let want = (gate.to_dtype(DType::F32)?.silu()? * up.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
    let (atol, rtol) = tolerance(dtype);
    assert_close("swiglu", &got, &want, (atol, rtol))
}

/// One rope_store case.
#[derive(Debug, Clone)]
pub struct RopeCase {
    pub batch: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub max_seq: usize,
    pub positions: Vec<u32>,
    pub interleaved: bool,
    pub norm: bool,
    /// Write every token into this row of a cache of `batch + 2` rows (at distinct
    /// positions, as a prefill chunk does) instead of its own row.
    pub row: Option<usize>,
    pub seed: u64,
}

pub fn rope_cases() -> impl Strategy<Value = RopeCase> {
    (
        1usize..=4,
        1usize..=3,
        prop_oneof![Just(1usize), Just(2), Just(4)],
        prop_oneof![Just(2usize), Just(40), Just(64), Just(128), Just(96)],
        1usize..=40,
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(0usize..=5),
        any::<u64>(),
    )
        .prop_flat_map(
            |(batch, kv_heads, group, head_dim, max_seq, interleaved, norm, row, seed)| {
                let max_seq = max_seq.max(batch);
                (
                    proptest::collection::vec(0..max_seq as u32, batch),
                    0..max_seq as u32,
                )
                    .prop_map(move |(mut positions, start)| {
                        if row.is_some() {
                            // Distinct positions in the one row.
                            for (i, p) in positions.iter_mut().enumerate() {
                                *p = (start + i as u32) % max_seq as u32;
                            }
                        }
                        RopeCase {
                            batch,
                            kv_heads,
                            group,
                            head_dim,
                            max_seq,
                            positions,
                            interleaved,
                            norm,
                            row: row.map(|r| r % (batch + 2)),
                            seed,
                        }
                    })
            },
        )
}

/// rope_store against the unfused decoder step: candle-nn's rms_norm and rope (or rope_i) at
/// the positions' table rows, and the cache rows written with scatter_set.
pub fn check_rope_store(device: &Device, c: &RopeCase, dtype: DType) -> Result<()> {
    let (b, kv, hd) = (c.batch, c.kv_heads, c.head_dim);
    let heads = kv * c.group;
    let table = c.max_seq + 3;
    let qkv = random(c.seed, &[b, (heads + 2 * kv) * hd], 2.0, dtype, device)?;
    let cos = random(c.seed ^ 1, &[table, hd / 2], 1.0, dtype, device)?;
    let sin = random(c.seed ^ 2, &[table, hd / 2], 1.0, dtype, device)?;
    let qn = random(c.seed ^ 3, &[hd], 1.5, dtype, device)?;
    let kn = random(c.seed ^ 4, &[hd], 1.5, dtype, device)?;
    let cache_rows = if c.row.is_some() { b + 2 } else { b };
    let cache = |seed| random(seed, &[cache_rows, kv, c.max_seq, hd], 1.0, dtype, device);
    let rows = c
        .row
        .map(|r| Tensor::new(vec![r as u32; b], device))
        .transpose()?;
    let (k_cache, v_cache) = (cache(c.seed ^ 5)?, cache(c.seed ^ 6)?);
    let (k_want, v_want) = (k_cache.copy()?, v_cache.copy()?);
    let positions = Tensor::new(c.positions.as_slice(), device)?;
    let style = if c.interleaved {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Half
    };
    let eps = 1e-6;
    let norm = c.norm.then_some(QkNorm {
        q: &qn,
        k: &kn,
        eps,
    });
    let q = rope_store(
        &qkv,
        &cos,
        &sin,
        &positions,
        rows.as_ref(),
        (&k_cache, &v_cache),
        heads,
        style,
        norm,
    )?;
    // The unfused step.
    let split = qkv.reshape((b, heads + 2 * kv, 1, hd))?;
    let part = |from, n| -> Result<Tensor> { split.narrow(1, from, n)?.contiguous() };
    let normed = |t: Tensor, w: &Tensor, n: usize| -> Result<Tensor> {
        if c.norm {
            candle_nn_free_rms_norm(&t, w, eps)?.reshape((b, n, 1, hd))
        } else {
            Ok(t)
        }
    };
    let (cos_at, sin_at) = (
        cos.index_select(&positions, 0)?.unsqueeze(1)?,
        sin.index_select(&positions, 0)?.unsqueeze(1)?,
    );
    let rotate = |t: &Tensor| -> Result<Tensor> {
        let t = t.to_dtype(DType::F32)?;
        let (c32, s32) = (cos_at.to_dtype(DType::F32)?, sin_at.to_dtype(DType::F32)?);
        let (x1, x2) = if c.interleaved {
            let pairs = t.reshape((b, (), 1, hd / 2, 2))?;
            (
                pairs.narrow(4, 0, 1)?.squeeze(4)?,
                pairs.narrow(4, 1, 1)?.squeeze(4)?,
            )
        } else {
            (t.narrow(3, 0, hd / 2)?, t.narrow(3, hd / 2, hd / 2)?)
        };
        let (c32, s32) = (c32.unsqueeze(1)?, s32.unsqueeze(1)?);
        let o1 = (x1.broadcast_mul(&c32)? - x2.broadcast_mul(&s32)?)?;
        let o2 = (x1.broadcast_mul(&s32)? + x2.broadcast_mul(&c32)?)?;
        let out = if c.interleaved {
            Tensor::stack(&[o1, o2], 4)?.reshape(t.dims())?
        } else {
            Tensor::cat(&[o1, o2], 3)?
        };
        out.to_dtype(dtype)
    };
    let q_want = rotate(&normed(part(0, heads)?, &qn, heads)?)?;
    let k_new = rotate(&normed(part(heads, kv)?, &kn, kv)?)?;
    let v_new = part(heads + kv, kv)?;
    // Each token's row and position, written one at a time.
    for (i, &p) in c.positions.iter().enumerate() {
        let row = c.row.unwrap_or(i);
        for (want, new) in [(&k_want, &k_new), (&v_want, &v_new)] {
            let src = new.narrow(0, i, 1)?.reshape((1, kv, 1, hd))?.contiguous()?;
            want.narrow(0, row, 1)?.slice_set(&src, 2, p as usize)?;
        }
    }
    let tol = tolerance(dtype);
    // One rounding apart at most (the reference rounds the rotation's products in f32).
    let tol = (tol.0.max(1e-5) * 2.0, tol.1);
    assert_close("rope_store queries", &q, &q_want, tol)?;
    assert_close("rope_store keys", &k_cache, &k_want, tol)?;
    assert_close("rope_store values", &v_cache, &v_want, (0.0, 0.0))
}

/// The per-head RMS norm of the last dim in f32, rounded to the dtype (candle-nn's
/// `rms_norm`, which this crate does not depend on).
fn candle_nn_free_rms_norm(t: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let x = t.to_dtype(DType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?.sqrt()?;
    x.broadcast_div(&rms)?
        .broadcast_mul(&w.to_dtype(DType::F32)?)?
        .to_dtype(t.dtype())
}
