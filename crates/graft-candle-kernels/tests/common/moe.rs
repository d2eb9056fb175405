//! The mixture-of-experts ops' test bodies: `route` against a host softmax and top-k, and
//! `Experts::forward` against candle matmuls of each token through the experts the routing
//! chose.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::{Experts, MAX_EXPERTS, route};
use proptest::prelude::*;

use super::{assert_close, random, tolerance};

/// One mixture-of-experts case.
#[derive(Debug, Clone)]
pub struct MoeCase {
    pub tokens: usize,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
    pub seed: u64,
}

pub fn moe_cases() -> impl Strategy<Value = MoeCase> {
    (
        0usize..=9,
        prop_oneof![1usize..=40, Just(64), Just(128)],
        prop_oneof![1usize..=40, Just(48), Just(256)],
        prop_oneof![1usize..=12, Just(64), Just(MAX_EXPERTS)],
        1usize..=8,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(tokens, hidden, inter, experts, k, normalize, seed)| MoeCase {
                tokens,
                hidden,
                inter,
                experts,
                top_k: k.min(experts),
                normalize,
                seed,
            },
        )
}

/// The softmax of every row of `logits` on the host, in f32.
fn softmax_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = r.iter().map(|&v| (v - max).exp()).collect();
            let s: f32 = e.iter().sum();
            e.iter().map(|&v| v / s).collect()
        })
        .collect())
}

/// `route` chooses, for every token, k distinct experts none of whose probabilities is below
/// an unchosen one's (up to rounding), in decreasing order, weighted by their probabilities
/// (renormalized when asked).
pub fn check_route(device: &Device, c: &MoeCase, dtype: DType) -> Result<()> {
    let logits = random(c.seed, &[c.tokens, c.experts], 4.0, dtype, device)?;
    let routing = route(&logits, c.top_k, c.normalize)?;
    assert_eq!(routing.top_k(), c.top_k);
    assert_eq!(routing.tokens(), c.tokens);
    if c.tokens == 0 {
        // (candle's own CUDA ops fail on empty tensors: nothing more to read.)
        return Ok(());
    }
    let ids = routing.experts()?.to_vec2::<u32>()?;
    let weights = routing.weights()?.to_vec2::<f32>()?;
    let eps = 1e-6;
    for (t, p) in softmax_rows(&logits)?.iter().enumerate() {
        let chosen = &ids[t];
        let mut seen = chosen.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            c.top_k,
            "token {t}: experts {chosen:?} not distinct"
        );
        let lowest = chosen
            .iter()
            .map(|&e| p[e as usize])
            .fold(f32::INFINITY, f32::min);
        for (e, &pe) in p.iter().enumerate() {
            if !chosen.contains(&(e as u32)) {
                assert!(
                    pe <= lowest + eps,
                    "token {t}: expert {e} ({pe}) left out for {chosen:?} ({lowest})"
                );
            }
        }
        let total: f32 = chosen.iter().map(|&e| p[e as usize]).sum();
        let scale = if c.normalize { total } else { 1.0 };
        for (j, &e) in chosen.iter().enumerate() {
            let want = p[e as usize] / scale;
            assert!(
                (weights[t][j] - want).abs() <= 1e-5,
                "token {t}: weight {j} is {}, expected {want}",
                weights[t][j]
            );
            if j > 0 {
                assert!(
                    weights[t][j] <= weights[t][j - 1] + eps,
                    "token {t}: weights {:?} not decreasing",
                    weights[t]
                );
            }
        }
    }
    Ok(())
}

/// `Experts::forward` with `route`'s choices against candle's matmuls of each token through
/// each chosen expert, in f32, the SwiGLU output rounded to the dtype as the op rounds it.
pub fn check_experts(device: &Device, c: &MoeCase, dtype: DType) -> Result<()> {
    let (d, f) = (c.hidden, c.inter);
    let scale_in = 2.0 / (d as f32).sqrt();
    let scale_out = 2.0 / (f as f32).sqrt();
    let weight = |seed: u64, shape: &[usize], scale: f32| random(seed, shape, scale, dtype, device);
    let mut gate = Vec::new();
    let mut up = Vec::new();
    let mut down = Vec::new();
    for e in 0..c.experts as u64 {
        let s = c.seed ^ (e + 1) << 12;
        gate.push(weight(s, &[f, d], 1.0)?);
        up.push(weight(s ^ 1, &[f, d], 1.0)?);
        down.push(weight(s ^ 2, &[d, f], scale_out)?);
    }
    let experts = Experts::new(gate.clone(), up.clone(), down.clone())?;
    assert_eq!(
        (experts.len(), experts.hidden(), experts.intermediate()),
        (c.experts, d, f)
    );
    let x = random(c.seed ^ 5, &[c.tokens, d], scale_in, dtype, device)?;
    let logits = random(c.seed ^ 6, &[c.tokens, c.experts], 4.0, dtype, device)?;
    let routing = route(&logits, c.top_k, c.normalize)?;
    let got = experts.forward(&x, &routing)?;
    assert_eq!(got.dims(), x.dims());
    if c.tokens == 0 {
        return Ok(());
    }
    let ids = routing.experts()?.to_vec2::<u32>()?;
    let weights = routing.weights()?.to_vec2::<f32>()?;
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let mut rows = Vec::new();
    for t in 0..c.tokens {
        let xt = f32_of(&x.narrow(0, t, 1)?)?;
        let mut y = Tensor::zeros((1, d), DType::F32, device)?;
        for (j, &e) in ids[t].iter().enumerate() {
            let e = e as usize;
            let g = xt.matmul(&f32_of(&gate[e])?.t()?)?;
            let u = xt.matmul(&f32_of(&up[e])?.t()?)?;
            let h = f32_of(&(g.silu()? * u)?.to_dtype(dtype)?)?;
            let o = h.matmul(&f32_of(&down[e])?.t()?)?;
            y = (y + (o * f64::from(weights[t][j]))?)?;
        }
        rows.push(y);
    }
    let want = Tensor::cat(&rows, 0)?.to_dtype(dtype)?;
    let (atol, rtol) = tolerance(dtype);
    assert_close("experts", &got, &want, (atol * 8.0, rtol * 8.0))
}

/// `SharedExpert::forward`, and `beside` on a side stream of `device` with routed experts as
/// the overlapping work, against candle's matmuls: `sigmoid(h · gate_w) * down · (silu(h ·
/// gate) * (h · up))`, and the routed experts' output unchanged by the overlap.
pub fn check_shared_expert(device: &Device, c: &MoeCase, dtype: DType) -> Result<()> {
    use graft_candle_kernels::{SharedExpert, SideStream};
    let (d, f) = (c.hidden, c.inter);
    let w = |seed: u64, shape: &[usize], scale: f32| random(seed, shape, scale, dtype, device);
    let (gate, up) = (w(c.seed ^ 11, &[f, d], 1.0)?, w(c.seed ^ 12, &[f, d], 1.0)?);
    let down = w(c.seed ^ 13, &[d, f], 2.0 / (f as f32).sqrt())?;
    let gate_w = w(c.seed ^ 14, &[1, d], 1.0)?;
    let shared = SharedExpert::new(gate.clone(), up.clone(), down.clone(), gate_w.clone())?;
    let h = random(
        c.seed ^ 15,
        &[c.tokens, 1, d],
        2.0 / (d as f32).sqrt(),
        dtype,
        device,
    )?;
    if c.tokens == 0 {
        // (candle's own CUDA ops fail on empty tensors: nothing more to compare.)
        assert_eq!(shared.forward(&h)?.dims(), h.dims());
        return Ok(());
    }
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let h2 = f32_of(&h.reshape((c.tokens, d))?)?;
    let s = ((h2.matmul(&f32_of(&gate)?.t()?)?.silu()?) * h2.matmul(&f32_of(&up)?.t()?)?)?;
    let s = f32_of(&s.to_dtype(dtype)?)?;
    let g = f32_of(&h2.matmul(&f32_of(&gate_w)?.t()?)?.to_dtype(dtype)?)?;
    let sigmoid = (g.neg()?.exp()? + 1.0)?.recip()?;
    let want = s
        .matmul(&f32_of(&down)?.t()?)?
        .broadcast_mul(&sigmoid)?
        .reshape((c.tokens, 1, d))?
        .to_dtype(dtype)?;
    let (atol, rtol) = tolerance(dtype);
    let tol = (atol * 8.0, rtol * 8.0);
    assert_close("shared expert", &shared.forward(&h)?, &want, tol)?;
    // Beside the routed experts, on a side stream where the device has one.
    let mut gates = Vec::new();
    let mut ups = Vec::new();
    let mut downs = Vec::new();
    for e in 0..c.experts as u64 {
        gates.push(w(c.seed ^ e << 20, &[f, d], 1.0)?);
        ups.push(w(c.seed ^ e << 21, &[f, d], 1.0)?);
        downs.push(w(c.seed ^ e << 22, &[d, f], 1.0)?);
    }
    let experts = Experts::new(gates, ups, downs)?;
    let logits = random(c.seed ^ 16, &[c.tokens, c.experts], 4.0, dtype, device)?;
    let routed = |h: &Tensor| experts.forward(h, &route(&logits, c.top_k, c.normalize)?);
    let alone = routed(&h)?;
    let side = SideStream::new(device)?;
    let (got, beside) = shared.beside(&h, &side, || routed(&h))?;
    assert_close("shared expert beside", &got, &want, tol)?;
    assert_close("routed experts beside", &beside, &alone, (0.0, 0.0))
}
