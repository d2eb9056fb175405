//! Shared by the CPU and GPU guard tests: a small MLP trained with candle-nn's optimizers
//! (whose bias corrections and learning rate are host values passed to candle's `affine`
//! kernel) and a learning-rate schedule set on every step, under graft-candle with guards on
//! or eagerly, so both runs are compared the same way.

use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Linear, Optimizer};
use graft_candle::CandleGraft;
use graft_core::{Config, Guards};

pub(crate) type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

/// graft's defaults with guards on (calls 1, 2, 4, ... after a recording).
pub(crate) fn guarded() -> Config {
    Config {
        guards: Some(Guards::default()),
        ..Config::default()
    }
}

/// What a run ends with.
#[derive(Debug, PartialEq)]
pub(crate) struct Run {
    pub(crate) losses: Vec<f32>,
    pub(crate) params: Vec<Vec<f32>>,
    /// Per step, whether it replayed a recording (never, eagerly).
    pub(crate) replayed: Vec<bool>,
}

impl Run {
    /// The largest difference of a loss or a parameter from `other`'s.
    pub(crate) fn max_diff(&self, other: &Run) -> f32 {
        let pairs = self.losses.iter().zip(&other.losses).chain(
            self.params
                .iter()
                .flatten()
                .zip(other.params.iter().flatten()),
        );
        pairs.map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    }
}

/// A fixed `rows x cols` matrix of small values.
fn fixed(rows: usize, cols: usize, salt: usize, device: &Device) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 + salt * 11) % 17) as f32 / 17.0 - 0.5)
        .collect();
    Tensor::from_vec(values, (rows, cols), device)
}

/// The learning rate at `step`: a decay set before every step.
pub(crate) fn schedule(step: usize) -> f64 {
    0.02 / (1.0 + step as f64 / 20.0)
}

/// `n` steps of an 8-16-1 MLP regressing a fixed target with the optimizer `make` builds,
/// `set_learning_rate(schedule(step))` before each, under `graft` (step "mlp", the
/// parameters as statics) or eagerly.
pub(crate) fn train<O: Optimizer>(
    device: &Device,
    graft: Option<&mut CandleGraft>,
    n: usize,
    make: impl Fn(Vec<Var>) -> candle_core::Result<O>,
) -> Fallible<Run> {
    train_at(device, graft, n, make, schedule, false)
}

/// [`train`] with the learning rate `rate(step)`; with `guard_changes`, the step after each
/// change of the rate is guarded (`CandleGraft::guard_next_call`), as a training loop that
/// knows its schedule closes the guards' window.
pub(crate) fn train_at<O: Optimizer>(
    device: &Device,
    graft: Option<&mut CandleGraft>,
    n: usize,
    make: impl Fn(Vec<Var>) -> candle_core::Result<O>,
    rate: fn(usize) -> f64,
    guard_changes: bool,
) -> Fallible<Run> {
    let vars = [
        Var::from_tensor(&fixed(16, 8, 1, device)?)?,
        Var::from_tensor(&fixed(1, 16, 2, device)?.flatten_all()?)?,
        Var::from_tensor(&fixed(1, 16, 3, device)?)?,
        Var::from_tensor(&fixed(1, 1, 4, device)?.flatten_all()?)?,
    ];
    let hidden = Linear::new(
        vars[0].as_tensor().clone(),
        Some(vars[1].as_tensor().clone()),
    );
    let out = Linear::new(
        vars[2].as_tensor().clone(),
        Some(vars[3].as_tensor().clone()),
    );
    let mut opt = make(vars.to_vec())?;
    let x = fixed(32, 8, 5, device)?;
    let y = x.sum_keepdim(1)?.affine(0.5, 0.25)?;
    let statics: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let mut graft = graft.map(|g| {
        let id = g.register("mlp");
        (g, id)
    });
    let mut losses = Vec::with_capacity(n);
    let mut replayed = Vec::with_capacity(n);
    for step in 0..n {
        opt.set_learning_rate(rate(step));
        if let Some((g, _)) = &mut graft
            && guard_changes
            && step > 0
            && rate(step) != rate(step - 1)
        {
            g.guard_next_call();
        }
        let mut body = |t: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            let prediction = out.forward(&hidden.forward(&t[0])?.relu()?)?;
            let loss = (prediction - &t[1])?.sqr()?.mean_all()?;
            opt.backward_step(&loss)?;
            Ok(vec![loss])
        };
        let loss = match &mut graft {
            Some((g, id)) => {
                let step = g.call(*id, &[&x, &y], &statics, &[], body)?;
                replayed.push(matches!(
                    step.outcome,
                    graft_candle::StepOutcome::Replayed(_)
                ));
                step.outputs.into_iter().next().ok_or("no loss")?
            }
            None => {
                replayed.push(false);
                body(&[x.clone(), y.clone()])?.remove(0)
            }
        };
        losses.push(loss.to_scalar::<f32>()?);
    }
    let params = vars
        .iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<_>>()?;
    Ok(Run {
        losses,
        params,
        replayed,
    })
}

/// candle-nn's AdamW at the schedule's first rate.
pub(crate) fn adamw(vars: Vec<Var>) -> candle_core::Result<candle_nn::AdamW> {
    candle_nn::AdamW::new_lr(vars, schedule(0))
}

/// candle-nn's SGD at the schedule's first rate.
pub(crate) fn sgd(vars: Vec<Var>) -> candle_core::Result<candle_nn::SGD> {
    candle_nn::SGD::new(vars, schedule(0))
}
