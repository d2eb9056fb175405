//! Shared by the CPU and GPU training tests: data, one training step, and what a run ends
//! with (losses and parameters), so eager and graphed runs are compared the same way.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_models::llama::{Config, Sizes};
use graft_candle_train::Trainable;
use graft_candle_train::optim::{AdamW, AdamWConfig};

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

/// Forward, backward and the optimizer's update: the body of a training step.
pub(crate) fn adamw_step(
    model: &Trainable,
    opt: &mut AdamW,
    tokens: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    let loss = model.loss(tokens, targets, None)?;
    let grads = loss.backward()?;
    opt.step(&grads)?;
    Ok(loss)
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
    losses_of(&config(), kernels, steps, device)
}

/// [`losses_with`] for the model `cfg` describes.
pub(crate) fn losses_of(
    cfg: &Config,
    kernels: graft_candle_models::SequenceKernels,
    steps: usize,
    device: &Device,
) -> Result<Vec<f32>> {
    let cfg = cfg.clone();
    let mut model = Trainable::random(&cfg, 7, DType::F32, device)?;
    model.set_kernels(kernels);
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
