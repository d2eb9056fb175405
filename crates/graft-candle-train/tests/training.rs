//! Capturable optimizers and the trainable model on the CPU: the same updates as candle-nn's
//! AdamW and PyTorch's SGD, the multi-tensor updates equal to the elementwise reference, a
//! non-finite gradient skipped, accumulation equal to one large batch, and a model that learns
//! (tests/gpu.rs runs them graphed and compares with eager).

#[path = "support/training.rs"]
mod training;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use graft_candle_train::optim::{
    AdamW, AdamWConfig, GradAccumulator, Gradients, Sgd, SgdConfig, Update,
};
use graft_candle_train::{Backward, Trainable};
use training::{adamw_step, batches, config, model_and_adamw, parameters, schedule};

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Gradients given by hand.
struct Given(Vec<(Tensor, Tensor)>);

impl Gradients for Given {
    fn gradient(&self, param: &Tensor) -> Option<&Tensor> {
        self.0
            .iter()
            .find(|(p, _)| p.id() == param.id())
            .map(|(_, g)| g)
    }
}

#[test]
fn adamw_matches_candle_nn_adamw() -> Result<()> {
    let device = Device::Cpu;
    let (model, mut ours) = model_and_adamw(&device)?;
    let (reference, _) = model_and_adamw(&device)?;
    let mut theirs = candle_nn::AdamW::new(
        reference.vars().to_vec(),
        candle_nn::ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    // One batch, seen 20 times: the model memorizes it.
    let (tokens, targets) = &batches(&config(), 2, 16, 1, &device)?[0];
    let mut losses = Vec::new();
    for step in 0..20 {
        ours.set_learning_rate(schedule(step))?;
        theirs.set_learning_rate(schedule(step));
        let loss = adamw_step(&model, &mut ours, tokens, targets)?;
        let loss_ref = reference.loss(tokens, targets, None)?;
        theirs.backward_step(&loss_ref)?;
        losses.push(loss.to_vec1::<f32>()?[0]);
    }
    // The bias corrections differ in rounding only (ours in f32 from the device step count,
    // candle-nn's in f64 on the host).
    let diff = max_diff(&parameters(&model)?, &parameters(&reference)?);
    assert!(
        diff < 1e-4,
        "parameters differ from candle-nn's adamw by {diff}"
    );
    assert_eq!((ours.applied_steps()?, ours.skipped_steps()?), (20, 0));
    assert!(losses[19] < losses[0] - 0.5, "the model learns: {losses:?}");
    Ok(())
}

/// What a run of the model ends with: losses, parameters, applied and skipped steps.
type Run = (Vec<f32>, Vec<Vec<f32>>, (u64, u64));

fn adamw_run(update: Update, steps: usize) -> Result<Run> {
    let device = Device::Cpu;
    let data = batches(&config(), 2, 16, 3, &device)?;
    let model = Trainable::random(&config(), 7, DType::F32, &device)?;
    let cfg = AdamWConfig {
        lr: 3e-3,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::with_update(model.vars().to_vec(), cfg, update)?;
    assert_eq!(opt.update(), update);
    assert_eq!(opt.statics().len(), 3 * model.vars().len() + 1);
    let mut losses = Vec::new();
    for step in 0..steps {
        opt.set_learning_rate(schedule(step))?;
        let (tokens, targets) = &data[step % data.len()];
        let loss = adamw_step(&model, &mut opt, tokens, targets)?;
        losses.push(loss.to_vec1::<f32>()?[0]);
    }
    let counts = (opt.applied_steps()?, opt.skipped_steps()?);
    Ok((losses, parameters(&model)?, counts))
}

#[test]
fn multi_tensor_adamw_matches_the_elementwise_reference() -> Result<()> {
    let fused = adamw_run(Update::MultiTensor, 12)?;
    let reference = adamw_run(Update::Elementwise, 12)?;
    for (step, (a, b)) in fused.0.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "step {step}: loss {a}, the reference's {b}"
        );
    }
    let diff = max_diff(&fused.1, &reference.1);
    assert!(
        diff < 1e-5,
        "parameters differ from the reference by {diff}"
    );
    assert_eq!((fused.2, reference.2), ((12, 0), (12, 0)));
    Ok(())
}

#[test]
fn multi_tensor_sgd_matches_the_elementwise_reference() -> Result<()> {
    let device = Device::Cpu;
    for momentum in [0.0, 0.9] {
        let cfg = SgdConfig {
            lr: 0.1,
            momentum,
            weight_decay: 0.01,
        };
        let run = |update: Update| -> Result<Vec<Vec<f32>>> {
            let vars = [(3, 7), (17, 1), (1, 40)]
                .into_iter()
                .map(|(rows, cols)| {
                    let t = Tensor::arange(0u32, (rows * cols) as u32, &device)?;
                    Var::from_tensor(
                        &t.to_dtype(DType::F32)?
                            .affine(0.1, -1.0)?
                            .reshape((rows, cols))?,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let mut sgd = Sgd::with_update(vars.clone(), cfg, update)?;
            for step in 0..5 {
                sgd.set_learning_rate(0.1 / (step + 1) as f64)?;
                // The last parameter has no gradient at odd steps: it is left alone.
                let grads = vars
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i < 2 || step % 2 == 0)
                    .map(|(i, v)| {
                        let g = (v.as_tensor().sin()? * (step + i) as f64)?;
                        Ok((v.as_tensor().clone(), g))
                    })
                    .collect::<Result<Vec<_>>>()?;
                sgd.step(&Given(grads))?;
            }
            assert_eq!((sgd.applied_steps()?, sgd.skipped_steps()?), (5, 0));
            vars.iter()
                .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
                .collect()
        };
        let diff = max_diff(&run(Update::MultiTensor)?, &run(Update::Elementwise)?);
        assert!(
            diff < 1e-6,
            "momentum {momentum}: sgd differs from the reference by {diff}"
        );
    }
    Ok(())
}

#[test]
fn sgd_with_momentum_follows_pytorch() -> Result<()> {
    let device = Device::Cpu;
    let w = Var::new(&[1.0f32, -2.0, 3.0], &device)?;
    let mut sgd = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        },
    )?;
    let (mut theta, mut buf) = ([1.0f32, -2.0, 3.0], [0.0f32; 3]);
    for step in 0..5 {
        let g = [0.5f32, -1.0, 0.25 * step as f32];
        sgd.step(&Given(vec![(
            w.as_tensor().clone(),
            Tensor::new(&g, &device)?,
        )]))?;
        for i in 0..3 {
            let gi = g[i] + 0.01 * theta[i];
            buf[i] = 0.9 * buf[i] + gi;
            theta[i] -= 0.1 * buf[i];
        }
        let got = w.as_tensor().to_vec1::<f32>()?;
        for (a, b) in got.iter().zip(&theta) {
            assert!(
                (a - b).abs() < 1e-6,
                "step {step}: {got:?} against {theta:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn a_step_with_a_non_finite_gradient_is_skipped_on_the_device() -> Result<()> {
    let device = Device::Cpu;
    let w = Var::new(&[1.0f32, 2.0], &device)?;
    let mut opt = AdamW::new(vec![w.clone()], AdamWConfig::default())?;
    let grad = |g: [f32; 2]| -> Result<Given> {
        Ok(Given(vec![(
            w.as_tensor().clone(),
            Tensor::new(&g, &device)?,
        )]))
    };
    opt.step(&grad([0.5, 0.5])?)?;
    let after_one = w.as_tensor().to_vec1::<f32>()?;
    for bad in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY] {
        opt.step(&grad([0.5, bad])?)?;
        assert_eq!(w.as_tensor().to_vec1::<f32>()?, after_one, "{bad} applied");
    }
    assert_eq!((opt.applied_steps()?, opt.skipped_steps()?), (1, 3));
    // The next finite step is AdamW's second (its bias corrections use t = 2).
    let twin_w = Var::new(&[1.0f32, 2.0], &device)?;
    let mut twin = AdamW::new(vec![twin_w.clone()], AdamWConfig::default())?;
    for _ in 0..2 {
        twin.step(&Given(vec![(
            twin_w.as_tensor().clone(),
            Tensor::new(&[0.5f32, 0.5], &device)?,
        )]))?;
    }
    opt.step(&grad([0.5, 0.5])?)?;
    assert_eq!(
        w.as_tensor().to_vec1::<f32>()?,
        twin_w.as_tensor().to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn the_learning_rate_is_read_from_the_device_at_every_step() -> Result<()> {
    let device = Device::Cpu;
    let w = Var::new(&[1.0f32], &device)?;
    let mut sgd = Sgd::new(
        vec![w.clone()],
        SgdConfig {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    )?;
    let g = Given(vec![(
        w.as_tensor().clone(),
        Tensor::new(&[1.0f32], &device)?,
    )]);
    sgd.step(&g)?;
    sgd.set_learning_rate(0.25)?;
    sgd.step(&g)?;
    assert_eq!(w.as_tensor().to_vec1::<f32>()?, vec![0.25]);
    assert_eq!(sgd.learning_rate(), 0.25);
    assert!(sgd.set_learning_rate(f64::NAN).is_err());
    assert!(sgd.set_learning_rate(-1.0).is_err());
    Ok(())
}

#[test]
fn accumulated_micro_batches_equal_one_large_batch() -> Result<()> {
    let device = Device::Cpu;
    let (model, mut opt) = model_and_adamw(&device)?;
    let (reference, mut ref_opt) = model_and_adamw(&device)?;
    let acc = GradAccumulator::new(model.vars())?;
    let data = batches(&config(), 4, 16, 2, &device)?;
    for (tokens, targets) in &data {
        // Two micro-batches of 2 rows, each loss scaled by 1/2.
        for half in 0..2 {
            let (t, y) = (
                tokens.narrow(0, 2 * half, 2)?,
                targets.narrow(0, 2 * half, 2)?,
            );
            let loss = (model.loss(&t, &y, None)? * 0.5)?;
            acc.accumulate(&loss.backward()?)?;
        }
        opt.step(&acc)?;
        acc.zero()?;
        adamw_step(&reference, &mut ref_opt, tokens, targets)?;
    }
    let diff = max_diff(&parameters(&model)?, &parameters(&reference)?);
    assert!(
        diff < 1e-5,
        "accumulation differs from the large batch by {diff}"
    );
    let zeros: f32 = acc
        .statics()
        .iter()
        .map(|t| t.abs()?.sum_all()?.to_scalar::<f32>())
        .sum::<Result<f32>>()?;
    assert_eq!(zeros, 0.0, "the update zeroes the sums");
    Ok(())
}

#[test]
fn optimizers_refuse_bad_configurations() {
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    let bad = AdamWConfig {
        beta1: 1.0,
        ..AdamWConfig::default()
    };
    assert!(AdamW::new(vec![w.clone()], bad).is_err());
    assert!(AdamW::new(vec![], AdamWConfig::default()).is_err());
    let sgd = SgdConfig {
        lr: 0.1,
        momentum: 1.5,
        weight_decay: 0.0,
    };
    assert!(Sgd::new(vec![w], sgd).is_err());
    // No gradient for any parameter: an error, not a silent no-op.
    let v = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    let mut opt = AdamW::new(vec![v], AdamWConfig::default()).unwrap();
    assert!(opt.step(&GradStoreless).is_err());
}

struct GradStoreless;

impl Gradients for GradStoreless {
    fn gradient(&self, _: &Tensor) -> Option<&Tensor> {
        None
    }
}

#[test]
fn the_model_refuses_a_sequence_longer_than_max_seq() -> Result<()> {
    let model = Trainable::random(&config(), 1, DType::F32, &Device::Cpu)?;
    let tokens = Tensor::zeros((1, 33), DType::U32, &Device::Cpu)?;
    assert!(model.forward(&tokens, None).is_err());
    Ok(())
}

/// 200 steps with a schedule: the fused kernels' losses within 1e-4 relative of the unfused
/// reference's, and the loss falls.
#[test]
fn fused_training_matches_unfused() -> Result<()> {
    use graft_candle_models::SequenceKernels;
    let device = Device::Cpu;
    let fused = training::losses_with(SequenceKernels::Fused, 200, &device)?;
    let unfused = training::losses_with(SequenceKernels::Unfused, 200, &device)?;
    let worst = training::max_relative(&fused, &unfused);
    assert!(worst < 1e-4, "losses differ by {worst} relative");
    assert!(
        fused[199] < 0.8 * fused[0],
        "{} -> {}",
        fused[0],
        fused[199]
    );
    Ok(())
}

/// A head tied to the embedding (GPT-2 124M's sizes tie it, as llama 3.2 1B does) trains
/// through both uses of the one table: 100 fused steps' losses within 1e-4 relative of the
/// unfused reference's, the loss falls, and the table has no second copy to drift from.
#[test]
fn a_tied_head_trains_fused_as_unfused() -> Result<()> {
    use graft_candle_models::SequenceKernels;
    let device = Device::Cpu;
    let mut cfg = config();
    cfg.tie_word_embeddings = true;
    let model = Trainable::random(&cfg, 7, DType::F32, &device)?;
    let untied = Trainable::random(&config(), 7, DType::F32, &device)?;
    assert_eq!(
        model.vars().len() + 1,
        untied.vars().len(),
        "the tied head is no var of its own"
    );
    let fused = training::losses_of(
        &cfg,
        SequenceKernels::Fused,
        Backward::Explicit,
        100,
        &device,
    )?;
    let unfused = training::losses_of(
        &cfg,
        SequenceKernels::Unfused,
        Backward::Autograd,
        100,
        &device,
    )?;
    let worst = training::max_relative(&fused, &unfused);
    assert!(worst < 1e-4, "losses differ by {worst} relative");
    assert!(fused[99] < 0.8 * fused[0], "{} -> {}", fused[0], fused[99]);
    Ok(())
}

/// The explicit backward program's gradients equal candle's autograd's over the same fused
/// kernels to within the rounding of sums taken in another order (1e-5 of each gradient's
/// largest magnitude in f32; 5e-2 in bf16, where the autograd rounds each projection's input
/// gradient before adding it and `dense_sum` adds in f32), with an untied and a tied head; 200 steps' losses stay within
/// 1e-4 relative (as fused against unfused) and fall.
#[test]
fn the_explicit_backward_equals_candles_autograd() -> Result<()> {
    use graft_candle_models::SequenceKernels;
    let device = Device::Cpu;
    let mut tied = config();
    tied.tie_word_embeddings = true;
    for cfg in [config(), tied] {
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 5e-2)] {
            let (worst, explicit, autograd) =
                training::explicit_against_autograd(&cfg, dtype, &device)?;
            assert!(
                worst < tolerance,
                "{dtype:?}: gradients differ by {worst} of their scale"
            );
            assert_eq!(
                explicit, autograd,
                "the same forward kernels give the same loss"
            );
        }
    }
    let explicit = training::losses_of(
        &config(),
        SequenceKernels::Fused,
        Backward::Explicit,
        200,
        &device,
    )?;
    let autograd = training::losses_of(
        &config(),
        SequenceKernels::Fused,
        Backward::Autograd,
        200,
        &device,
    )?;
    let worst = training::max_relative(&explicit, &autograd);
    assert!(worst < 1e-4, "losses differ by {worst} relative");
    assert!(
        explicit[199] < 0.8 * explicit[0],
        "{} -> {}",
        explicit[0],
        explicit[199]
    );
    Ok(())
}

/// Mixed precision as PyTorch's autocast trains (f32 masters, bf16 working copies that every
/// pass reads, `AdamW::mixed`): 100 steps' losses within 2% of the f32 model's from the same
/// weights (bf16 matmuls round each product's inputs to 8 bits of mantissa), the loss falls,
/// every copy is its master rounded after every step, the elementwise reference update gives
/// the multi-tensor one's losses to within f32 rounding, and a bad pairing is refused.
#[test]
fn mixed_precision_trains_like_f32() -> Result<()> {
    use graft_candle_train::optim::Update;
    let device = Device::Cpu;
    let cfg = config();
    let (full, _) = training::mixed_losses(&cfg, false, Update::MultiTensor, 100, &device)?;
    let (mixed, follow) = training::mixed_losses(&cfg, true, Update::MultiTensor, 100, &device)?;
    let worst = training::max_relative(&mixed, &full);
    assert!(
        worst < 2e-2,
        "mixed-precision losses differ by {worst} relative"
    );
    assert!(mixed[99] < 0.95 * mixed[0], "{} -> {}", mixed[0], mixed[99]);
    assert!(follow, "a copy differs from its master rounded to bf16");
    let (reference, follow) =
        training::mixed_losses(&cfg, true, Update::Elementwise, 100, &device)?;
    assert!(training::max_relative(&reference, &mixed) < 1e-4);
    assert!(
        follow,
        "the elementwise update left a copy behind its master"
    );
    let model = Trainable::random_mixed(&cfg, 7, DType::BF16, &device)?;
    // Clipping takes the optimizer's vars, which are the copies whose gradients it reads.
    let mut opt = AdamW::new(model.masters().to_vec(), AdamWConfig::default())?
        .mixed(model.vars().to_vec())?;
    let (tokens, targets) = batches(&cfg, 2, 16, 1, &device)?.remove(0);
    let grads = model.gradients(&tokens, &targets, None)?;
    let clipped = graft_candle_train::optim::clip_grad_norm(opt.vars(), &grads, 1.0)?;
    opt.step(&clipped)?;
    assert!(clipped.norm().to_vec1::<f32>()?[0].is_finite());
    assert_eq!(opt.applied_steps()?, 1);
    let masters = model.masters().to_vec();
    assert!(
        AdamW::new(masters.clone(), AdamWConfig::default())?
            .mixed(Vec::new())
            .is_err()
    );
    let copies = model.vars().to_vec();
    assert!(
        AdamW::new(copies.clone(), AdamWConfig::default())?
            .mixed(copies)
            .is_err()
    );
    assert!(Trainable::random_mixed(&cfg, 7, DType::F32, &device).is_err());
    assert_eq!(
        model.weights().values().next().map(Tensor::dtype),
        Some(DType::F32)
    );
    Ok(())
}

/// Where the explicit program does not run (the reference backward chosen, unfused kernels)
/// the model says why and its gradients are candle's autograd's, bit for bit.
#[test]
fn the_backward_falls_back_to_autograd_and_says_why() -> Result<()> {
    use graft_candle_models::SequenceKernels;
    let device = Device::Cpu;
    let mut model = Trainable::random(&config(), 7, DType::F32, &device)?;
    assert!(model.backward_fallbacks().is_empty());
    let (tokens, targets) = batches(&config(), 2, 16, 1, &device)?.remove(0);
    for (kernels, backward) in [
        (SequenceKernels::Fused, Backward::Autograd),
        (SequenceKernels::Unfused, Backward::Explicit),
    ] {
        model.set_kernels(kernels);
        model.set_backward(backward);
        assert_eq!(model.backward_fallbacks().len(), 1);
        let ours = model.gradients(&tokens, &targets, None)?;
        let reference = model.loss(&tokens, &targets, None)?.backward()?;
        for v in model.vars() {
            let (Some(a), Some(b)) = (ours.gradient(v), reference.get(v)) else {
                panic!("a gradient is missing");
            };
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0);
        }
    }
    Ok(())
}

/// A warmup-cosine schedule sets every step's rate on the device from the applied-step
/// count, in both update paths: the rate each step used and the parameter it moved follow the
/// host formula; a constant rate is refused while the schedule is set and restored when it is
/// cleared; schedules that cannot be followed are refused.
#[test]
fn a_schedule_sets_each_steps_rate_on_the_device() -> Result<()> {
    use graft_candle_train::optim::LrSchedule;
    let device = Device::Cpu;
    let schedule = LrSchedule::WarmupCosine {
        peak: 1.0,
        warmup: 3,
        total: 10,
        floor: 0.1,
    };
    for update in [Update::MultiTensor, Update::Elementwise] {
        let w = Var::new(&[0.0f32], &device)?;
        let cfg = SgdConfig {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let mut sgd = Sgd::with_update(vec![w.clone()], cfg, update)?;
        sgd.set_schedule(Some(schedule))?;
        let g = Given(vec![(
            w.as_tensor().clone(),
            Tensor::new(&[1.0f32], &device)?,
        )]);
        let mut moved = 0.0;
        for t in 0..12 {
            sgd.step(&g)?;
            let want = schedule.rate_at(t);
            moved -= want;
            let used = sgd.learning_rate_now()?;
            assert!(
                (used - want).abs() < 1e-6,
                "{update:?} step {t}: rate {used}, want {want}"
            );
            let got = f64::from(w.as_tensor().to_vec1::<f32>()?[0]);
            assert!(
                (got - moved).abs() < 1e-5,
                "{update:?} step {t}: w {got}, want {moved}"
            );
        }
        assert!((schedule.rate_at(0) - 1.0 / 3.0).abs() < 1e-12);
        assert!((schedule.rate_at(2) - 1.0).abs() < 1e-12);
        assert!((schedule.rate_at(10) - 0.1).abs() < 1e-12);
        assert!(
            sgd.set_learning_rate(0.25).is_err(),
            "a constant rate under a schedule"
        );
        sgd.set_schedule(None)?;
        sgd.step(&g)?;
        assert_eq!(
            sgd.learning_rate_now()?,
            0.5,
            "the constant rate comes back"
        );
        sgd.set_learning_rate(0.25)?;
        for bad in [
            LrSchedule::WarmupCosine {
                peak: 1.0,
                warmup: 5,
                total: 5,
                floor: 0.0,
            },
            LrSchedule::WarmupCosine {
                peak: 0.1,
                warmup: 0,
                total: 5,
                floor: 0.2,
            },
            LrSchedule::WarmupCosine {
                peak: f64::NAN,
                warmup: 0,
                total: 5,
                floor: 0.0,
            },
        ] {
            assert!(sgd.set_schedule(Some(bad)).is_err(), "{bad:?}");
        }
    }
    Ok(())
}

/// Gradient clipping on the device: gradients of global norm 5 clipped to 1 are scaled by
/// PyTorch's `max_norm / (norm + 1e-6)`, left alone under a larger bound, and a non-finite
/// gradient makes the step a skipped one; a bound of 0 is refused.
#[test]
fn clipping_scales_the_gradients_to_the_norm_on_the_device() -> Result<()> {
    use graft_candle_train::optim::clip_grad_norm;
    let device = Device::Cpu;
    let (a, b) = (
        Var::new(&[1.0f32], &device)?,
        Var::new(&[1.0f32, 1.0], &device)?,
    );
    let grads = |ga: f32| -> Result<Given> {
        Ok(Given(vec![
            (a.as_tensor().clone(), Tensor::new(&[ga], &device)?),
            (b.as_tensor().clone(), Tensor::new(&[4.0f32, 0.0], &device)?),
        ]))
    };
    let g = grads(3.0)?;
    let clipped = clip_grad_norm([&a, &b], &g, 1.0)?;
    assert_eq!(clipped.norm().to_vec1::<f32>()?, [5.0]);
    let coef = (1.0 / (5.0 + 1e-6)) as f32;
    let got_a = clipped.gradient(a.as_tensor()).unwrap().to_vec1::<f32>()?;
    let got_b = clipped.gradient(b.as_tensor()).unwrap().to_vec1::<f32>()?;
    assert!((got_a[0] - 3.0 * coef).abs() < 1e-6, "{got_a:?}");
    assert!(
        (got_b[0] - 4.0 * coef).abs() < 1e-6 && got_b[1] == 0.0,
        "{got_b:?}"
    );
    let loose = clip_grad_norm([&a, &b], &g, 10.0)?;
    assert_eq!(
        loose.gradient(a.as_tensor()).unwrap().to_vec1::<f32>()?,
        [3.0]
    );
    assert!(clip_grad_norm([&a, &b], &g, 0.0).is_err());
    // A NaN gradient: every clipped gradient is NaN, and AdamW skips the step.
    let mut adamw = AdamW::new(vec![a.clone(), b.clone()], AdamWConfig::default())?;
    adamw.step(&clip_grad_norm([&a, &b], &grads(f32::NAN)?, 1.0)?)?;
    assert_eq!(adamw.skipped_steps()?, 1);
    assert_eq!(a.as_tensor().to_vec1::<f32>()?, [1.0]);
    Ok(())
}

/// A mixed-precision run resumes bit for bit from its f32 masters and the optimizer's state:
/// the copies are the masters rounded, so `from_weights_mixed` rebuilds them exactly.
#[test]
fn a_mixed_precision_run_resumed_from_its_masters_continues_it_bit_for_bit() -> Result<()> {
    use std::collections::HashMap;
    let (device, cfg) = (Device::Cpu, config());
    let data = batches(&cfg, 2, 16, 6, &device)?;
    let start = |weights: Option<&HashMap<String, Tensor>>| -> Result<(Trainable, AdamW)> {
        let model = match weights {
            None => Trainable::random_mixed(&cfg, 7, DType::BF16, &device)?,
            Some(w) => Trainable::from_weights_mixed(&cfg, w, DType::BF16)?,
        };
        let opt = AdamW::new(model.masters().to_vec(), AdamWConfig::default())?
            .mixed(model.vars().to_vec())?;
        Ok((model, opt))
    };
    let (model, mut opt) = start(None)?;
    for (tokens, targets) in &data[..3] {
        adamw_step(&model, &mut opt, tokens, targets)?;
    }
    // Snapshots: the weights and state are the live tensors, which the next steps write.
    let mut saved = HashMap::new();
    for (name, t) in model.weights().into_iter().chain(opt.state()) {
        saved.insert(name, t.copy()?);
    }
    let run = |model: &Trainable, opt: &mut AdamW| -> Result<Vec<u32>> {
        data[3..]
            .iter()
            .map(|(tokens, targets)| {
                Ok(adamw_step(model, opt, tokens, targets)?.to_vec1::<f32>()?[0].to_bits())
            })
            .collect()
    };
    let want = run(&model, &mut opt)?;
    let (resumed, mut opt2) = start(Some(&saved))?;
    opt2.load_state(&saved)?;
    assert_eq!(run(&resumed, &mut opt2)?, want, "the losses after resuming");
    assert_eq!(parameters(&resumed)?, parameters(&model)?, "the copies");
    let masters = |m: &Trainable| -> Result<Vec<Vec<f32>>> {
        m.masters()
            .iter()
            .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
            .collect()
    };
    assert_eq!(masters(&resumed)?, masters(&model)?, "the masters");
    Ok(())
}

/// Checkpoint and resume: after 3 steps with dropout, the weights, AdamW's state and the
/// generator's state saved to a safetensors file and loaded into a fresh model, optimizer
/// and generator continue the run exactly: the next 3 steps' losses and the final weights are
/// the uninterrupted run's, bit for bit. A state of other shapes is refused.
#[test]
fn a_run_resumed_from_a_checkpoint_continues_it_bit_for_bit() -> Result<()> {
    use std::collections::HashMap;

    use graft_candle::random::DeviceRng;
    let device = Device::Cpu;
    let data = batches(&config(), 2, 16, 6, &device)?;
    let step = |model: &Trainable, opt: &mut AdamW, rng: &DeviceRng, i: usize| -> Result<f32> {
        let drop = |x: &Tensor| rng.dropout(x, 0.1);
        let (tokens, targets) = &data[i];
        let loss = model.loss(tokens, targets, Some(&drop))?;
        opt.step(&loss.backward()?)?;
        loss.to_vec1::<f32>().map(|l| l[0])
    };
    let (model, mut opt) = model_and_adamw(&device)?;
    let rng = DeviceRng::new(&device, 11)?;
    for i in 0..3 {
        step(&model, &mut opt, &rng, i)?;
    }
    let mut saved: HashMap<String, Tensor> = model.weights();
    saved.extend(opt.state());
    saved.insert("rng".to_owned(), rng.state().clone());
    let path = std::env::temp_dir().join(format!(
        "graft-candle-train-checkpoint-{}.safetensors",
        std::process::id()
    ));
    candle_core::safetensors::save(&saved, &path)?;
    let want: Vec<f32> = (3..6)
        .map(|i| step(&model, &mut opt, &rng, i))
        .collect::<Result<_>>()?;

    let loaded = candle_core::safetensors::load(&path, &device)?;
    std::fs::remove_file(&path)?;
    let resumed = Trainable::from_weights(&config(), &loaded)?;
    let mut opt2 = AdamW::new(
        resumed.vars().to_vec(),
        AdamWConfig {
            lr: 1.0,
            ..AdamWConfig::default()
        },
    )?;
    opt2.load_state(&loaded)?;
    assert_eq!(opt2.applied_steps()?, 3);
    // The rate comes back as the device holds it: an f32.
    assert_eq!(
        opt2.learning_rate() as f32,
        opt.learning_rate() as f32,
        "the saved rate comes back"
    );
    let rng2 = DeviceRng::new(&device, 99)?;
    rng2.load_state(&loaded["rng"])?;
    let got: Vec<f32> = (3..6)
        .map(|i| step(&resumed, &mut opt2, &rng2, i))
        .collect::<Result<_>>()?;
    assert_eq!(
        got.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        "losses after resuming: {got:?} against {want:?}"
    );
    assert_eq!(parameters(&resumed)?, parameters(&model)?);

    let mut wrong = loaded.clone();
    wrong.insert(
        "adamw.m.0".to_owned(),
        Tensor::zeros(3, DType::F32, &device)?,
    );
    let before = parameters(&resumed)?;
    assert!(
        opt2.load_state(&wrong).is_err(),
        "a moment of another shape"
    );
    assert!(
        rng2.load_state(&Tensor::zeros(3, DType::U32, &device)?)
            .is_err()
    );
    assert_eq!(parameters(&resumed)?, before);
    Ok(())
}
