//! graft-candle-train's `--guards` measurement: a guarded call of the training step against
//! its replay, and candle-nn's AdamW with a schedule eagerly against under graft-candle.

use std::time::Instant;

use candle_nn::Optimizer;

use graft_candle::CandleGraft;
use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle_bench::common::{BenchResult, median};
use graft_candle_models::llama::Sizes;
use graft_candle_train::Trainable;

use super::{Kernels, Options, Trainer, Variant, data, split};

/// Per-step medians of the guard measurement.
pub(super) struct GuardRow {
    pub(super) replay: f64,
    pub(super) guarded: f64,
    pub(super) nn_eager: f64,
    pub(super) nn_graft: f64,
    pub(super) nn_same: bool,
    pub(super) found: usize,
}

/// A guarded call of the step (`guard_next_call` before each) against its replay, and
/// candle-nn's AdamW with a schedule eagerly against under graft-candle (default guards),
/// whose losses must agree (to 1e-5 relative: graft reruns the same kernels).
pub(super) fn measure_guards(
    sizes: Sizes,
    batch: usize,
    o: &Options,
    device: &Device,
) -> BenchResult<GuardRow> {
    let data = data(batch, o.seq, sizes.vocab, device)?;
    let mut t = Trainer::new(sizes, Kernels::Fused, device)?;
    let one = t.graft.register("train");
    let per_round = o.timing.per_round(o.steps)?;
    let (mut replay, mut guarded) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        t.step(&Variant::Graph(one), &data)?;
    }
    for _ in 0..o.timing.rounds {
        for (guard, times) in [(false, &mut replay), (true, &mut guarded)] {
            for _ in 0..per_round {
                if guard {
                    t.graft.guard_next_call();
                }
                device.synchronize()?;
                let start = Instant::now();
                t.step(&Variant::Graph(one), &data)?;
                device.synchronize()?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let differences = t.graft.graft().map_or(0, |g| g.stats().guard_differences);
    if differences != 0 {
        return Err(format!("graft-candle-train's AdamW was flagged {differences} times").into());
    }
    // candle-nn's AdamW on two fresh copies of the model, eager and under graft-candle.
    let run = |graphed: bool| -> BenchResult<(Vec<f64>, Vec<f32>, usize)> {
        let model = Trainable::random(&sizes.config(), 1234, DType::F32, device)?;
        let mut nn =
            candle_nn::AdamW::new(model.vars().to_vec(), candle_nn::ParamsAdamW::default())?;
        let mut graft = CandleGraft::new(device)?;
        let id = graft.register("candle-nn");
        let statics: Vec<Tensor> = model
            .vars()
            .iter()
            .map(|v| v.as_tensor().clone())
            .chain(model.constants().into_iter().cloned())
            .collect();
        let statics: Vec<&Tensor> = statics.iter().collect();
        let (tokens, targets) = split(&data)?;
        let (mut times, mut losses) = (Vec::new(), Vec::new());
        for step in 0..o.steps + 3 {
            nn.set_learning_rate(1e-3 / (1.0 + step as f64 / 10.0));
            let mut body = |x: &[Tensor]| -> graft_candle::candle_core::Result<Vec<Tensor>> {
                let loss = model.loss(&x[0], &x[1], None)?;
                nn.backward_step(&loss)?;
                Ok(vec![loss])
            };
            device.synchronize()?;
            let start = Instant::now();
            let loss = if graphed {
                graft
                    .call(id, &[&tokens, &targets], &statics, &[], body)?
                    .outputs
                    .remove(0)
            } else {
                body(&[tokens.clone(), targets.clone()])?.remove(0)
            };
            device.synchronize()?;
            if step >= 3 {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
            losses.push(loss.to_vec1::<f32>()?[0]);
        }
        let found = graft.graft().map_or(0, |g| g.guard_findings().len());
        Ok((times, losses, found))
    };
    let (mut nn_eager, eager_losses, _) = run(false)?;
    let (mut nn_graft, graft_losses, found) = run(true)?;
    let nn_same = eager_losses
        .iter()
        .zip(&graft_losses)
        .all(|(a, b)| (a - b).abs() <= 1e-5 * a.abs().max(1.0));
    Ok(GuardRow {
        replay: median(&mut replay),
        guarded: median(&mut guarded),
        nn_eager: median(&mut nn_eager),
        nn_graft: median(&mut nn_graft),
        nn_same,
        found,
    })
}
