//! The training ops' bodies: each op's forward and backward (through candle's autograd)
//! against the unfused candle composition's, on the same device, the reference in f32.

use candle_core::{DType, Device, Result, Tensor, Var};
use graft_candle_kernels::{
    RopeStyle, classifier_with_grad, cross_entropy, cross_entropy_with_grad, dense, dense_sum,
    dense_weight_grad, dense_weight_grad_add, embedding, rms_norm, rms_norm_backward, rotary,
    swiglu,
};
use proptest::prelude::*;

use super::{random, values};

/// Shapes of one training-op case: `[batch, seq, width]` rows and a seed.
#[derive(Debug, Clone)]
pub struct TrainCase {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub seed: u64,
}

pub fn train_cases() -> impl Strategy<Value = TrainCase> {
    (
        1usize..=3,
        1usize..=19,
        1usize..=3,
        prop_oneof![Just(2usize), Just(6), Just(64)],
        any::<u64>(),
    )
        .prop_map(|(batch, seq, heads, head_dim, seed)| TrainCase {
            batch,
            seq,
            heads,
            head_dim,
            seed,
        })
}

/// `|got - want| <= tol * (1 + max |want|)` elementwise, tol by dtype (the reference is f32).
pub fn assert_near(what: &str, got: &Tensor, want: &Tensor, dtype: DType) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let tol = match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 3e-2,
    };
    let got = got.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let want = want.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}: element {i} is {g}, expected {w} (tolerance {tol} x {scale})"
        );
    }
    Ok(())
}

/// Runs `fused` on vars of `inputs` (in `dtype`) and `reference` on f32 copies, seeds a
/// random upstream gradient, and compares outputs and every input's gradient.
pub fn check_grads(
    what: &str,
    inputs: &[Tensor],
    dtype: DType,
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    seed: u64,
) -> Result<()> {
    let ours: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype)?))
        .collect::<Result<_>>()?;
    let theirs: Vec<Var> = ours
        .iter()
        .map(|v| Var::from_tensor(&v.to_dtype(DType::F32)?))
        .collect::<Result<_>>()?;
    let out = fused(
        &ours
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect::<Vec<_>>(),
    )?;
    let want = reference(
        &theirs
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect::<Vec<_>>(),
    )?;
    assert_near(&format!("{what} forward"), &out, &want, dtype)?;
    let r = random(seed ^ 0x5eed, out.dims(), 1.0, DType::F32, out.device())?;
    let grads = (out.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;
    let want_grads = (want * &r)?.sum_all()?.backward()?;
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        match (grads.get(a.as_tensor()), want_grads.get(b.as_tensor())) {
            (Some(g), Some(w)) => assert_near(&format!("{what} gradient {i}"), g, w, dtype)?,
            (None, None) => {}
            (g, w) => panic!(
                "{what}: gradient {i} present {} vs {}",
                g.is_some(),
                w.is_some()
            ),
        }
    }
    Ok(())
}

/// The functions a hand-written backward pass calls beyond the ops' own backward passes:
/// `rms_norm_backward` with the residual stream's gradient added, against the autograd of
/// the unfused norm plus that gradient, and `dense_sum` of two and three terms against the
/// sum of matmuls, each in `dtype` against an f32 reference.
pub fn check_backward_functions(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let width = c.heads * c.head_dim;
    let x = random(c.seed, &[c.batch, c.seq, width], 2.0, DType::F32, device)?;
    let w = random(c.seed + 1, &[width], 1.0, DType::F32, device)?;
    let rows = [c.batch, c.seq, width];
    let dy = random(c.seed + 2, &rows, 1.0, DType::F32, device)?;
    let res = random(c.seed + 3, &rows, 1.0, DType::F32, device)?;
    let cast = |t: &Tensor| t.to_dtype(dtype);
    let (dx, dw) = rms_norm_backward(
        &cast(&x)?,
        &cast(&w)?,
        &cast(&dy)?,
        1e-5,
        Some(&cast(&res)?),
    )?;
    let (xv, wv) = (
        Var::from_tensor(&cast(&x)?.to_dtype(DType::F32)?)?,
        Var::from_tensor(&cast(&w)?.to_dtype(DType::F32)?)?,
    );
    let dy32 = cast(&dy)?.to_dtype(DType::F32)?;
    let grads = (unfused_rms_norm(&xv, &wv, 1e-5)? * &dy32)?
        .sum_all()?
        .backward()?;
    let (Some(want_dx), Some(want_dw)) = (grads.get(&xv), grads.get(&wv)) else {
        panic!("the reference norm has no gradient");
    };
    let want_dx = (want_dx + cast(&res)?.to_dtype(DType::F32)?)?;
    assert_near("rms_norm_backward dx + residual", &dx, &want_dx, dtype)?;
    assert_near("rms_norm_backward dweight", &dw, want_dw, dtype)?;
    assert!(rms_norm_backward(&x, &w, &dy, 1e-5, Some(&w)).is_err());

    let k = c.head_dim + 1;
    let mut terms = Vec::new();
    for (i, n) in [width, c.head_dim, 3].into_iter().enumerate() {
        let seed = c.seed + 10 + 2 * i as u64;
        let a = random(seed, &[c.batch, c.seq, n], 1.0, DType::F32, device)?;
        let m = random(seed + 1, &[n, k], 1.0, DType::F32, device)?;
        terms.push((cast(&a)?, cast(&m)?));
    }
    for count in [1, 2, 3] {
        let pairs: Vec<(&Tensor, &Tensor)> = terms[..count].iter().map(|(a, m)| (a, m)).collect();
        let got = dense_sum(&pairs)?;
        let mut want = Tensor::zeros((c.batch, c.seq, k), DType::F32, device)?;
        for (a, m) in &pairs {
            want = (want
                + a.to_dtype(DType::F32)?
                    .broadcast_matmul(&m.to_dtype(DType::F32)?)?)?;
        }
        assert_near(&format!("dense_sum of {count}"), &got, &want, dtype)?;
    }
    Ok(())
}

fn unfused_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let r = (x.sqr()?.mean_keepdim(candle_core::D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&r)?.broadcast_mul(w)
}

pub fn check_rms_norm(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let width = c.heads * c.head_dim;
    let x = random(c.seed, &[c.batch, c.seq, width], 2.0, DType::F32, device)?;
    let w = random(c.seed + 1, &[width], 1.0, DType::F32, device)?;
    check_grads(
        "rms_norm",
        &[x, w],
        dtype,
        |t| rms_norm(&t[0], &t[1], 1e-5),
        |t| unfused_rms_norm(&t[0], &t[1], 1e-5),
        c.seed,
    )
}

pub fn check_dense(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let k = c.heads * c.head_dim;
    let n = c.head_dim + 3;
    let x = random(c.seed, &[c.batch, c.seq, k], 1.0, DType::F32, device)?;
    let w = random(c.seed + 1, &[n, k], 1.0, DType::F32, device)?;
    check_grads(
        "dense",
        &[x, w],
        dtype,
        |t| dense(&t[0], &t[1]),
        |t| t[0].broadcast_matmul(&t[1].t()?),
        c.seed,
    )
}

pub fn check_swiglu_grads(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let shape = [c.batch, c.seq, c.head_dim];
    let g = random(c.seed, &shape, 4.0, DType::F32, device)?;
    let u = random(c.seed + 1, &shape, 2.0, DType::F32, device)?;
    check_grads(
        "swiglu",
        &[g, u],
        dtype,
        |t| swiglu(&t[0], &t[1]),
        |t| candle_nn::ops::silu(&t[0])? * &t[1],
        c.seed,
    )
}

/// Rotary tables `[positions, half]` of angles `position / 10000^(2i / head_dim)`.
pub fn rope_tables(positions: usize, head_dim: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let angles: Vec<f32> = (0..positions * half)
        .map(|j| {
            let (p, i) = (j / half, j % half);
            p as f32 / 10000f32.powf(2.0 * i as f32 / head_dim as f32)
        })
        .collect();
    let a = Tensor::from_vec(angles, (positions, half), device)?;
    Ok((a.cos()?, a.sin()?))
}

pub fn check_rotary(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let width = c.heads * c.head_dim;
    let x = random(c.seed, &[c.batch, c.seq, width], 1.0, DType::F32, device)?;
    let (cos, sin) = rope_tables(c.seq + 3, c.head_dim, device)?;
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let (cos_d, sin_d) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let (cs, ss) = (cos.narrow(0, 0, c.seq)?, sin.narrow(0, 0, c.seq)?);
        check_grads(
            "rotary",
            std::slice::from_ref(&x),
            dtype,
            |t| rotary(&t[0], &cos_d, &sin_d, c.heads, style),
            |t| {
                let h = t[0]
                    .reshape((c.batch, c.seq, c.heads, c.head_dim))?
                    .transpose(1, 2)?
                    .contiguous()?;
                let y = match style {
                    RopeStyle::Half => candle_nn::rotary_emb::rope_slow(&h, &cs, &ss)?,
                    RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i_slow(&h, &cs, &ss)?,
                };
                y.transpose(1, 2)?.reshape((c.batch, c.seq, width))
            },
            c.seed,
        )?;
    }
    Ok(())
}

pub fn check_embedding(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let vocab = c.seq + 2;
    let table = random(c.seed, &[vocab, c.head_dim], 1.0, DType::F32, device)?;
    // Repeated ids (tokens share rows) and an unused row or two.
    let ids: Vec<u32> = (0..c.batch * c.seq)
        .map(|i| ((i * 7 + c.seed as usize) % c.seq) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (c.batch, c.seq), device)?;
    check_grads(
        "embedding",
        &[table],
        dtype,
        |t| embedding(&ids, &t[0]),
        |t| {
            t[0].index_select(&ids.flatten_all()?, 0)?
                .reshape((c.batch, c.seq, c.head_dim))
        },
        c.seed,
    )?;
    // An id past the table: NaN, not another row.
    let bad = Tensor::from_vec(vec![vocab as u32], 1, device)?;
    let row = embedding(
        &bad,
        &random(c.seed, &[vocab, c.head_dim], 1.0, dtype, device)?,
    )?;
    let row = row.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(row.iter().all(|v| v.is_nan()), "a bad id must give NaN");
    Ok(())
}

pub fn check_cross_entropy(device: &Device, c: &TrainCase, dtype: DType) -> Result<()> {
    let vocab = c.head_dim * c.heads + 1;
    let logits = random(c.seed, &[c.batch, c.seq, vocab], 6.0, DType::F32, device)?;
    let targets: Vec<u32> = values(c.seed + 2, c.batch * c.seq, 1.0)
        .into_iter()
        .map(|v| ((v + 1.0) / 2.0 * (vocab - 1) as f32) as u32)
        .collect();
    let targets = Tensor::from_vec(targets, (c.batch, c.seq), device)?;
    check_grads(
        "cross_entropy",
        std::slice::from_ref(&logits),
        dtype,
        |t| cross_entropy(&t[0], &targets),
        |t| {
            candle_nn::loss::cross_entropy(
                &t[0].reshape((c.batch * c.seq, vocab))?,
                &targets.flatten_all()?,
            )?
            .reshape(1)
        },
        c.seed,
    )?;
    // Outside the autograd: the same loss and gradient, bit for bit, as the autograd of
    // `cross_entropy` (the same kernels).
    let ours = Var::from_tensor(&logits.to_dtype(dtype)?)?;
    let loss = cross_entropy(&ours, &targets)?;
    let grads = loss.backward()?;
    let Some(want) = grads.get(&ours) else {
        panic!("cross_entropy gave the logits no gradient");
    };
    let (fused_loss, fused) = cross_entropy_with_grad(ours.as_tensor(), &targets)?;
    let bits =
        |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
    assert_eq!(
        bits(&fused_loss)?,
        bits(&loss)?,
        "cross_entropy_with_grad's loss"
    );
    assert_eq!(
        bits(&fused)?,
        bits(want)?,
        "cross_entropy_with_grad's gradient"
    );
    // The classifier in one chunk: the composition's loss and gradients, bit for bit.
    let rows = c.batch * c.seq;
    let h = random(c.seed + 1, &[c.batch, c.seq, 16], 1.0, dtype, device)?;
    let head = random(c.seed + 2, &[vocab, 16], 0.5, dtype, device)?;
    let (want_loss, dlogits) = cross_entropy_with_grad(&dense(&h, &head)?, &targets)?;
    let dlogits = dlogits.reshape((rows, vocab))?;
    let want_dh = dense_sum(&[(&dlogits, &head)])?.reshape(h.shape())?;
    let want_dhead = dense_weight_grad(&dlogits, &h.reshape((rows, 16))?)?;
    let whole = classifier_with_grad(&h, &head, &targets, rows)?;
    assert_eq!(
        bits(&whole.loss)?,
        bits(&want_loss)?,
        "the classifier's loss"
    );
    assert_eq!(bits(&whole.dh)?, bits(&want_dh)?, "the classifier's dh");
    assert_eq!(
        bits(&whole.dhead)?,
        bits(&want_dhead)?,
        "the classifier's dhead"
    );
    // In chunks of 3 rows (the last one shorter where 3 does not divide the rows): the same
    // values to the dtype's rounding, the head's gradient added chunk by chunk.
    let chunked = classifier_with_grad(&h, &head, &targets, 3)?;
    assert_near(
        "the chunked classifier's loss",
        &chunked.loss,
        &want_loss,
        dtype,
    )?;
    assert_near("the chunked classifier's dh", &chunked.dh, &want_dh, dtype)?;
    assert_near(
        "the chunked classifier's dhead",
        &chunked.dhead,
        &want_dhead,
        dtype,
    )?;
    assert!(
        classifier_with_grad(&h, &head, &targets, 0).is_err(),
        "chunks of no rows are refused"
    );
    // An accumulator of another shape is refused; one that is a view into a larger buffer
    // (a flat gradient buffer's slice) is written where it lies, and nothing around it.
    let (dy, x) = (
        dlogits.narrow(0, 0, 1)?,
        h.reshape((rows, 16))?.narrow(0, 0, 1)?,
    );
    let wide = Tensor::zeros((vocab + 1, 16), dtype, device)?;
    let refused = dense_weight_grad_add(&wide, &dy, &x)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("acc"), "{refused}");
    let buffer = Tensor::ones((vocab + 2, 16), dtype, device)?;
    dense_weight_grad_add(&buffer.narrow(0, 1, vocab)?, &dy, &x)?;
    let want = (dense_weight_grad(&dy, &x)? + 1.0)?;
    assert_near(
        "an accumulator inside a buffer",
        &buffer.narrow(0, 1, vocab)?,
        &want,
        dtype,
    )?;
    for row in [0, vocab + 1] {
        let around = buffer
            .narrow(0, row, 1)?
            .to_dtype(DType::F32)?
            .flatten_all()?;
        assert_eq!(
            around.to_vec1::<f32>()?,
            vec![1.0; 16],
            "row {row} around the view"
        );
    }
    // A target past the vocabulary: NaN, not a silent wrong loss.
    let bad = Tensor::from_vec(
        vec![vocab as u32; c.batch * c.seq],
        (c.batch, c.seq),
        device,
    )?;
    let loss = cross_entropy(
        &random(c.seed, &[c.batch, c.seq, vocab], 1.0, dtype, device)?,
        &bad,
    )?;
    assert!(
        loss.to_vec1::<f32>()?[0].is_nan(),
        "a bad target must give NaN"
    );
    Ok(())
}

/// RMS norm, rotary, SwiGLU and cross-entropy at 32 × 128 rows (d = 512, 8 heads of 64, vocab
/// 8,192): close to the unfused autograd in f32, and every gradient bitwise equal on a rerun.
pub fn check_training_ops_deterministic(device: &Device) -> Result<()> {
    let c = TrainCase {
        batch: 32,
        seq: 128,
        heads: 8,
        head_dim: 64,
        seed: 11,
    };
    check_rms_norm(device, &c, DType::F32)?;
    check_embedding(device, &c, DType::F32)?;
    check_rotary(device, &c, DType::F32)?;
    check_swiglu_grads(device, &c, DType::F32)?;
    check_cross_entropy(device, &c, DType::F32)?;
    let run = || -> Result<Vec<Vec<f32>>> {
        let x = Var::from_tensor(&random(5, &[32, 128, 512], 2.0, DType::F32, device)?)?;
        let w = Var::from_tensor(&random(6, &[512], 1.0, DType::F32, device)?)?;
        let head = Var::from_tensor(&random(7, &[8192, 512], 0.05, DType::F32, device)?)?;
        let (cos, sin) = rope_tables(128, 64, device)?;
        let h = rms_norm(&x, &w, 1e-5)?;
        let r = rotary(&h, &cos, &sin, 8, RopeStyle::Half)?;
        let s = swiglu(&r, &h)?;
        let logits = dense(&s, &head)?;
        let targets = Tensor::arange(0u32, 32 * 128, device)?.reshape((32, 128))?;
        let loss = cross_entropy(&logits, &targets)?;
        let grads = loss.backward()?;
        let mut all = vec![loss.to_vec1::<f32>()?];
        for v in [&x, &w, &head] {
            let g = grads
                .get(v.as_tensor())
                .expect("a gradient for every input");
            all.push(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(all)
    };
    let (a, b) = (run()?, run()?);
    assert!(a == b, "a rerun changed the loss or a gradient");
    Ok(())
}
