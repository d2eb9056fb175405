//! Shared by the CPU and GPU training tests: data, one training step, and what a run ends
//! with (losses and parameters), so eager and graphed runs are compared the same way.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_models::llama::{Config, Sizes};
use graft_candle_train::optim::{AdamW, AdamWConfig, Gradients};
use graft_candle_train::{Backward, Trainable};

/// A small config for training tests whose head dim (64) the fused attention covers: 2
/// layers, d=128, 2 heads over 1 KV head, vocab 256, sequences up to 32.
pub(crate) fn config() -> Config {
    Sizes {
        layers: 2,
        hidden: 128,
        heads: 2,
        kv_heads: 1,
        intermediate: 256,
        vocab: 256,
        max_positions: 32,
        ..Sizes::TINY
    }
    .config()
}

/// `n` batches of `(tokens, targets)`, `[batch, seq]` u32 each, from a fixed seed: targets are
/// the tokens shifted by one, so the model can learn them.
pub(crate) fn batches(
    cfg: &Config,
    batch: usize,
    seq: usize,
    n: usize,
    device: &Device,
) -> Result<Vec<(Tensor, Tensor)>> {
    let mut state = 0x9E37_79B9_u64;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) % cfg.vocab_size as u64) as u32
    };
    (0..n)
        .map(|_| {
            let row: Vec<u32> = (0..batch * (seq + 1)).map(|_| next()).collect();
            let all = Tensor::from_vec(row, (batch, seq + 1), device)?;
            Ok((
                all.narrow(1, 0, seq)?.contiguous()?,
                all.narrow(1, 1, seq)?.contiguous()?,
            ))
        })
        .collect()
}

/// The model and its optimizer, from seed 7.
pub(crate) fn model_and_adamw(device: &Device) -> Result<(Trainable, AdamW)> {
    let model = Trainable::random(&config(), 7, DType::F32, device)?;
    let opt = AdamW::new(
        model.vars().to_vec(),
        AdamWConfig {
            lr: 3e-3,
            ..AdamWConfig::default()
        },
    )?;
    Ok((model, opt))
}

/// Forward, backward (the model's: the explicit program unless it was told otherwise) and
/// the optimizer's update: the body of a training step.
pub(crate) fn adamw_step(
    model: &Trainable,
    opt: &mut AdamW,
    tokens: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    let grads = model.gradients(tokens, targets, None)?;
    opt.step(&grads)?;
    Ok(grads.loss().clone())
}

/// One step's gradients of the model `cfg` describes (seed 7, `dtype`, batch 2, sequence 16)
/// by the explicit program against candle's autograd, both over the fused kernels: the
/// largest difference of any parameter's gradient, relative to that gradient's largest
/// magnitude, and the two losses. Fails if the program does not take the model or a
/// gradient is missing on either side.
pub(crate) fn explicit_against_autograd(
    cfg: &Config,
    dtype: DType,
    device: &Device,
) -> Result<(f32, f32, f32)> {
    let mut model = Trainable::random(cfg, 7, dtype, device)?;
    let fallbacks = model.backward_fallbacks();
    if !fallbacks.is_empty() {
        candle_core::bail!("the explicit program does not take the model: {fallbacks:?}");
    }
    let (tokens, targets) = batches(cfg, 2, 16, 1, device)?.remove(0);
    let explicit = model.gradients(&tokens, &targets, None)?;
    model.set_backward(Backward::Autograd);
    let autograd = model.gradients(&tokens, &targets, None)?;
    let mut worst = 0f32;
    for v in model.vars() {
        let (Some(a), Some(b)) = (explicit.gradient(v), autograd.gradient(v)) else {
            candle_core::bail!(
                "a parameter of shape {:?} has no gradient on one side",
                v.dims()
            );
        };
        let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (a, b) = (f32s(a)?, f32s(b)?);
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    let loss = |g: &graft_candle_train::StepGradients| -> Result<f32> {
        Ok(g.loss().to_vec1::<f32>()?[0])
    };
    Ok((worst, loss(&explicit)?, loss(&autograd)?))
}

/// Every parameter's values, flattened, in the model's order.
pub(crate) fn parameters(model: &Trainable) -> Result<Vec<Vec<f32>>> {
    model
        .vars()
        .iter()
        .map(|v| {
            v.as_tensor()
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()
        })
        .collect()
}

/// A learning-rate schedule: linear warmup over 10 steps, then cosine decay to 10% at 200.
pub(crate) fn schedule(step: usize) -> f64 {
    let peak = 3e-3;
    if step < 10 {
        return peak * (step + 1) as f64 / 10.0;
    }
    let t = ((step - 10) as f64 / 190.0).min(1.0);
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// The losses of `steps` eager AdamW steps (the schedule above at a third, a peak of 1e-3;
/// at 3e-3 both runs' losses wander apart by up to 2.6% after 100 steps, to f32 rounding
/// amplified, not a wrong gradient: step 1 agrees to 1e-7), batch 2, sequence 16, a new
/// batch each step, so the loss stays far from 0 where rounding would be all of it) from
/// seed 7 with `kernels`.
pub(crate) fn losses_with(
    kernels: graft_candle_models::SequenceKernels,
    steps: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    losses_of(&config(), kernels, Backward::Explicit, steps, device)
}

/// [`losses_with`] for the model `cfg` describes, its gradients as `backward` says.
pub(crate) fn losses_of(
    cfg: &Config,
    kernels: graft_candle_models::SequenceKernels,
    backward: Backward,
    steps: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    let cfg = cfg.clone();
    let mut model = Trainable::random(&cfg, 7, DType::F32, device)?;
    model.set_kernels(kernels);
    model.set_backward(backward);
    let mut opt = AdamW::new(model.vars().to_vec(), AdamWConfig::default())?;
    let data = batches(&cfg, 2, 16, steps, device)?;
    let mut losses = Vec::with_capacity(steps);
    for (step, (tokens, targets)) in data.iter().enumerate() {
        opt.set_learning_rate(schedule(step) / 3.0)?;
        losses.push(adamw_step(&model, &mut opt, tokens, targets)?.to_vec1::<f32>()?[0]);
    }
    Ok(losses)
}

/// The largest relative difference between two runs' losses.
pub(crate) fn max_relative(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-6))
        .fold(0.0, f32::max)
}

/// The losses of `steps` eager AdamW steps of the model `cfg` describes from seed 7 (as
/// [`losses_of`]), in f32 or in mixed precision (f32 masters, bf16 copies, `AdamW::mixed`
/// with `update`), and whether every copy equalled its master rounded to bf16 after every
/// step.
pub(crate) fn mixed_losses(
    cfg: &Config,
    mixed: bool,
    update: graft_candle_train::optim::Update,
    steps: usize,
    device: &Device,
) -> Result<(Vec<f32>, bool)> {
    let (model, mut opt) = if mixed {
        let model = Trainable::random_mixed(cfg, 7, DType::BF16, device)?;
        let opt = AdamW::with_update(model.masters().to_vec(), AdamWConfig::default(), update)?
            .mixed(model.vars().to_vec())?;
        (model, opt)
    } else {
        let model = Trainable::random(cfg, 7, DType::F32, device)?;
        let opt = AdamW::with_update(model.vars().to_vec(), AdamWConfig::default(), update)?;
        (model, opt)
    };
    let data = batches(cfg, 2, 16, steps, device)?;
    let (mut losses, mut copies_follow) = (Vec::with_capacity(steps), true);
    for (step, (tokens, targets)) in data.iter().enumerate() {
        opt.set_learning_rate(schedule(step) / 3.0)?;
        losses.push(adamw_step(&model, &mut opt, tokens, targets)?.to_vec1::<f32>()?[0]);
        for (copy, master) in model.vars().iter().zip(model.masters()) {
            let rounded = master.as_tensor().to_dtype(DType::BF16)?;
            let diff = (copy.as_tensor().to_dtype(DType::F32)? - rounded.to_dtype(DType::F32)?)?;
            copies_follow &= diff.abs()?.max_all()?.to_scalar::<f32>()? == 0.0;
        }
    }
    Ok((losses, copies_follow))
}
