//! The multi-tensor optimizer updates' test bodies: `adamw_update` and `sgd_update` over
//! random lists of tensors (mixed dtypes and sizes, gradients contiguous, strided or offset)
//! against an elementwise reference (candle ops in f32 from a copy of the same state), over
//! several steps with the learning rate changed between them, a non-finite gradient skipping
//! its step.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::{
    AdamWHyper, OPTIM_SCALARS, OptimSlot, SgdHyper, adamw_update, adamw_update_mixed,
    optim_scalars, sgd_update,
};
use proptest::prelude::*;

use super::values;

/// The rule of a case, with the hyperparameters that vary.
#[derive(Debug, Clone, Copy)]
pub enum OptimRule {
    AdamW { beta1: f64, weight_decay: f64 },
    Sgd { momentum: f64, weight_decay: f64 },
}

/// One optimizer case: its tensors `(elements, dtype, gradient layout)` (dtype 0 f32, 1 bf16,
/// 2 f16; layout 0 contiguous, 1 transposed, 2 at an offset), steps, and the step whose
/// gradient gets an infinity or a NaN `(step, tensor, kind, element)` (tensor and element
/// modulo the counts).
#[derive(Debug, Clone)]
pub struct OptimCase {
    pub tensors: Vec<(usize, usize, usize)>,
    pub rule: OptimRule,
    pub steps: usize,
    pub bad: Option<(usize, usize, usize, usize)>,
    pub seed: u64,
}

pub fn optim_cases() -> impl Strategy<Value = OptimCase> {
    let size = prop_oneof![
        4 => 1usize..=70,
        2 => (35usize..2500).prop_map(|n| 2 * n + 1),
        1 => 20_000usize..=100_000,
    ];
    let tensor = (size, 0usize..3, 0usize..3);
    // Up to 80 tensors (more than one update launch holds), sometimes 170 (more than one
    // check launch holds).
    let count = prop_oneof![6 => 1usize..=80, 1 => Just(170usize)];
    let tensors = count.prop_flat_map(move |n| prop::collection::vec(tensor.clone(), n));
    let rule = prop_oneof![
        (
            prop_oneof![Just(0.9), Just(0.5)],
            prop_oneof![Just(0.0), Just(0.01)]
        )
            .prop_map(|(beta1, weight_decay)| OptimRule::AdamW {
                beta1,
                weight_decay
            }),
        (
            prop_oneof![Just(0.0), Just(0.9)],
            prop_oneof![Just(0.0), Just(0.01)]
        )
            .prop_map(|(momentum, weight_decay)| OptimRule::Sgd {
                momentum,
                weight_decay
            }),
    ];
    let bad = prop::option::of((0usize..4, any::<usize>(), 0usize..3, any::<usize>()));
    (tensors, rule, 2usize..=4, bad, any::<u64>()).prop_map(|(tensors, rule, steps, bad, seed)| {
        OptimCase {
            tensors,
            rule,
            steps,
            bad,
            seed,
        }
    })
}

/// A fixed case whose second of three steps has a NaN gradient, for both rules.
pub fn skipping_cases() -> [OptimCase; 2] {
    let tensors = vec![
        (1, 0, 0),
        (33, 1, 1),
        (4097, 2, 2),
        (300, 0, 1),
        (9000, 0, 0),
    ];
    let case = |rule| OptimCase {
        tensors: tensors.clone(),
        rule,
        steps: 3,
        bad: Some((1, 2, 1, 1234)),
        seed: 5,
    };
    [
        case(OptimRule::AdamW {
            beta1: 0.9,
            weight_decay: 0.01,
        }),
        case(OptimRule::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        }),
    ]
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;

/// A `[3, n / 3]` shape when `n` is a multiple of 3 (so gradients can be transposed), else
/// `[n]`.
fn shape_of(n: usize) -> Vec<usize> {
    if n.is_multiple_of(3) {
        vec![3, n / 3]
    } else {
        vec![n]
    }
}

fn tensor(vals: Vec<f32>, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::from_vec(vals, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// Step `k`'s gradient of tensor `i` in its layout, with `bad` written at element `at`.
fn gradient(
    case: &OptimCase,
    (i, k): (usize, usize),
    bad: Option<(f32, usize)>,
    device: &Device,
) -> Result<Tensor> {
    let (n, dtype, layout) = case.tensors[i];
    let shape = shape_of(n);
    let seed = case.seed ^ ((k as u64) << 40) ^ ((i as u64) << 20);
    let mut vals = values(seed, n + 3, 1.0);
    if let Some((value, at)) = bad {
        vals[3 + at] = value;
    }
    let all = tensor(vals, &[n + 3], DTYPES[dtype], device)?;
    let g = all.narrow(0, 3, n)?;
    match (layout, shape.as_slice()) {
        (1, &[rows, cols]) => g.reshape((cols, rows))?.t(),
        (2, _) => g.reshape(shape.as_slice()),
        _ => g.copy()?.reshape(shape.as_slice()),
    }
}

/// The elementwise reference of one step from copies of the state: the parameters and states
/// after it, computed by candle ops in f32 and rounded to each tensor's dtype.
fn reference(
    rule: OptimRule,
    params: &[Tensor],
    grads: &[Tensor],
    states: &[Vec<Tensor>],
    (lr, applied): (f32, f32),
) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
    let device = params[0].device();
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let lr_t = Tensor::new(&[lr], device)?;
    let mut new_params = Vec::new();
    let mut new_states: Vec<Vec<Tensor>> = states.iter().map(|_| Vec::new()).collect();
    for (i, (p0, g)) in params.iter().zip(grads).enumerate() {
        let dtype = p0.dtype();
        let (p, g) = (f(p0)?, f(g)?);
        match rule {
            OptimRule::AdamW {
                beta1,
                weight_decay,
            } => {
                let t = Tensor::new(&[applied + 1.0], device)?;
                let correction = |beta: f64| (&t * beta.ln())?.exp()?.affine(-1.0, 1.0);
                let (c1, c2) = (correction(beta1)?, correction(BETA2)?);
                let decay = (&lr_t * weight_decay)?.affine(-1.0, 1.0)?;
                let (m, v) = (f(&states[0][i])?, f(&states[1][i])?);
                let m = ((m * beta1)? + (&g * (1.0 - beta1))?)?;
                let v = ((v * BETA2)? + (g.sqr()? * (1.0 - BETA2))?)?;
                let adjusted = (m.broadcast_div(&c1)? / (v.broadcast_div(&c2)?.sqrt()? + EPS)?)?;
                new_params.push(
                    (p.broadcast_mul(&decay)? - adjusted.broadcast_mul(&lr_t)?)?.to_dtype(dtype)?,
                );
                new_states[0].push(m.to_dtype(dtype)?);
                new_states[1].push(v.to_dtype(dtype)?);
            }
            OptimRule::Sgd {
                momentum,
                weight_decay,
            } => {
                let g = if weight_decay == 0.0 {
                    g
                } else {
                    (g + (&p * weight_decay)?)?
                };
                let direction = if momentum == 0.0 {
                    g
                } else {
                    let b = ((f(&states[0][i])? * momentum)? + g)?;
                    new_states[0].push(b.to_dtype(dtype)?);
                    b
                };
                new_params.push((p - direction.broadcast_mul(&lr_t)?)?.to_dtype(dtype)?);
            }
        }
    }
    Ok((new_params, new_states))
}

fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Asserts `got` equals `want` up to f32 rounding (1e-6 of the tensor's largest magnitude) and,
/// in bf16 or f16, one rounding of the dtype.
fn assert_step_close(what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    let (rel, tiny) = match got.dtype() {
        DType::F32 => (0.0, 0.0),
        DType::BF16 => (1.0 / 128.0, 0.0),
        _ => (1.0 / 1024.0, 6e-8),
    };
    let (g, w) = (f32s(got)?, f32s(want)?);
    let scale = w.iter().fold(0f32, |a, x| a.max(x.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= rel * b.abs() + 1e-6 * scale + tiny,
            "{what}: element {i} is {a}, the reference {b} (largest magnitude {scale})"
        );
    }
    Ok(())
}

/// Runs `case` on `device`: every step against the reference from the same state, the counts
/// after each, a skipped step changing nothing.
pub fn check_optim(device: &Device, case: &OptimCase) -> Result<()> {
    let n = case.tensors.len();
    let make = |salt: u64, scale: f32, abs: bool| -> Result<Vec<Tensor>> {
        case.tensors
            .iter()
            .enumerate()
            .map(|(i, &(len, dtype, _))| {
                let seed = case.seed ^ salt ^ (i as u64);
                let mut vals = values(seed, len, scale);
                if abs {
                    vals.iter_mut().for_each(|x| *x = x.abs());
                }
                tensor(vals, &shape_of(len), DTYPES[dtype], device)
            })
            .collect()
    };
    let params = make(1 << 60, 1.0, false)?;
    let states = match case.rule {
        OptimRule::AdamW { .. } => vec![make(2 << 60, 0.1, false)?, make(3 << 60, 0.01, true)?],
        OptimRule::Sgd { momentum: 0.0, .. } => Vec::new(),
        OptimRule::Sgd { .. } => vec![make(4 << 60, 0.5, false)?],
    };
    let scalars = optim_scalars(1e-2, device)?;
    let (mut applied, mut skipped) = (0f32, 0f32);
    let bad = case.bad.map(|(step, tensor, kind, at)| {
        let i = tensor % n;
        let value = [f32::INFINITY, f32::NAN, f32::NEG_INFINITY][kind];
        (step % case.steps, i, (value, at % case.tensors[i].0))
    });
    for k in 0..case.steps {
        let lr = [1e-2f32, 3e-3, 5e-2][k % 3];
        let lr_slot = OptimSlot::LearningRate.index();
        scalars.slice_set(&Tensor::new(&[lr], device)?, 0, lr_slot)?;
        let grads = (0..n)
            .map(|i| {
                let b = bad.filter(|&(s, t, _)| s == k && t == i).map(|(_, _, b)| b);
                gradient(case, (i, k), b, device)
            })
            .collect::<Result<Vec<_>>>()?;
        let copy = |ts: &[Tensor]| ts.iter().map(Tensor::copy).collect::<Result<Vec<_>>>();
        let before = copy(&params)?;
        let states_before = states.iter().map(|s| copy(s)).collect::<Result<Vec<_>>>()?;
        let (want, want_states) =
            reference(case.rule, &before, &grads, &states_before, (lr, applied))?;
        fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
            ts.iter().collect()
        }
        let (p, g) = (refs(&params), refs(&grads));
        match case.rule {
            OptimRule::AdamW {
                beta1,
                weight_decay,
            } => {
                let hyper = AdamWHyper {
                    beta1,
                    beta2: BETA2,
                    eps: EPS,
                    weight_decay,
                };
                let (m, v) = (refs(&states[0]), refs(&states[1]));
                adamw_update(&p, &g, &m, &v, &scalars, &hyper)?;
            }
            OptimRule::Sgd {
                momentum,
                weight_decay,
            } => {
                let hyper = SgdHyper {
                    momentum,
                    weight_decay,
                };
                let b = states.first().map(|s| refs(s));
                sgd_update(&p, &g, b.as_deref(), &scalars, &hyper)?;
            }
        }
        let skip = bad.is_some_and(|(s, _, _)| s == k);
        let all = params.iter().chain(states.iter().flatten());
        let all_before = before.iter().chain(states_before.iter().flatten());
        if skip {
            skipped += 1.0;
            for (i, (got, was)) in all.zip(all_before).enumerate() {
                assert_eq!(f32s(got)?, f32s(was)?, "step {k}: tensor {i} changed");
            }
        } else {
            applied += 1.0;
            let all_want = want.iter().chain(want_states.iter().flatten());
            for (i, (got, want)) in all.zip(all_want).enumerate() {
                assert_step_close(&format!("step {k}, tensor {i}"), got, want)?;
            }
        }
        let mut expected = [0f32; OPTIM_SCALARS];
        expected[lr_slot] = lr;
        expected[OptimSlot::Applied.index()] = applied;
        expected[OptimSlot::Skipped.index()] = skipped;
        assert_eq!(scalars.to_vec1::<f32>()?, expected, "step {k}: scalars");
    }
    Ok(())
}

/// Mixed-precision AdamW (`adamw_update_mixed`): f32 masters whose bf16 and f16 copies the
/// step reads the gradients of and rewrites. Over 3 steps, the second with a NaN gradient:
/// the masters and moments equal those of `adamw_update` on f32 copies of the same state fed
/// the 16-bit gradients widened to f32 (the same arithmetic: a gradient is read exactly), the
/// copies equal the masters rounded once, and the skipped step changes nothing. Then the
/// refusals: a master not f32, a gradient not in its copy's dtype.
pub fn check_adamw_mixed(device: &Device) -> Result<()> {
    let hyper = AdamWHyper {
        beta1: 0.9,
        beta2: BETA2,
        eps: EPS,
        weight_decay: 0.01,
    };
    let sizes = [(5, DType::BF16), (4097, DType::F16), (12, DType::BF16)];
    let make = |salt: u64, scale: f32, abs: bool| -> Result<Vec<Tensor>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &(n, _))| {
                let mut vals = values(salt ^ i as u64, n, scale);
                if abs {
                    vals.iter_mut().for_each(|x| *x = x.abs());
                }
                tensor(vals, &shape_of(n), DType::F32, device)
            })
            .collect()
    };
    let (masters, m, v) = (
        make(11, 1.0, false)?,
        make(12, 0.1, false)?,
        make(13, 0.01, true)?,
    );
    let copies = masters
        .iter()
        .zip(&sizes)
        .map(|(p, &(_, dtype))| p.to_dtype(dtype))
        .collect::<Result<Vec<_>>>()?;
    let clone = |ts: &[Tensor]| ts.iter().map(Tensor::copy).collect::<Result<Vec<_>>>();
    let (ref_p, ref_m, ref_v) = (clone(&masters)?, clone(&m)?, clone(&v)?);
    let (scalars, ref_scalars) = (optim_scalars(1e-2, device)?, optim_scalars(1e-2, device)?);
    fn refs(ts: &[Tensor]) -> Vec<&Tensor> {
        ts.iter().collect()
    }
    for step in 0..3u64 {
        let grads = sizes
            .iter()
            .enumerate()
            .map(|(i, &(n, dtype))| {
                let mut vals = values(100 + step * 7 + i as u64, n, 1.0);
                if step == 1 && i == 1 {
                    vals[4096] = f32::NAN;
                }
                tensor(vals, &shape_of(n), dtype, device)
            })
            .collect::<Result<Vec<_>>>()?;
        let before = [clone(&masters)?, clone(&m)?, clone(&v)?, clone(&copies)?];
        adamw_update_mixed(
            &refs(&masters),
            &refs(&grads),
            &refs(&m),
            &refs(&v),
            &refs(&copies),
            &scalars,
            &hyper,
        )?;
        if step == 1 {
            let after = [&masters, &m, &v, &copies];
            for (got, was) in after.into_iter().flatten().zip(before.iter().flatten()) {
                assert_eq!(f32s(got)?, f32s(was)?, "the skipped step changed a tensor");
            }
            continue;
        }
        let wide = grads
            .iter()
            .map(|g| g.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        adamw_update(
            &refs(&ref_p),
            &refs(&wide),
            &refs(&ref_m),
            &refs(&ref_v),
            &ref_scalars,
            &hyper,
        )?;
        let pairs = masters.iter().zip(&ref_p).chain(m.iter().zip(&ref_m));
        for (got, want) in pairs.chain(v.iter().zip(&ref_v)) {
            assert_eq!(f32s(got)?, f32s(want)?, "step {step}: a master or moment");
        }
        for (c, p) in copies.iter().zip(&masters) {
            assert_eq!(
                f32s(c)?,
                f32s(&p.to_dtype(c.dtype())?)?,
                "step {step}: a copy"
            );
        }
    }
    let counts = scalars.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    assert_eq!(counts[OptimSlot::Applied.index()], 2.0);
    assert_eq!(counts[OptimSlot::Skipped.index()], 1.0);

    let half = masters[0].to_dtype(DType::F16)?;
    let err = adamw_update_mixed(
        &[&half],
        &[&copies[0]],
        &[&m[0]],
        &[&v[0]],
        &[&copies[0]],
        &scalars,
        &hyper,
    )
    .expect_err("an f16 master");
    assert!(
        err.to_string()
            .contains("mixed precision keeps f32 masters"),
        "{err}"
    );
    let err = adamw_update_mixed(
        &[&masters[0]],
        &[&masters[0].zeros_like()?],
        &[&m[0]],
        &[&v[0]],
        &[&copies[0]],
        &scalars,
        &hyper,
    )
    .expect_err("an f32 gradient of a bf16 copy");
    assert!(
        err.to_string()
            .contains("grads is F32 but its copy is BF16"),
        "{err}"
    );
    Ok(())
}
