//! The training example of docs/guide.md: the Llama port trained under graft-candle with the
//! capturable AdamW and a learning-rate schedule, one graph per step. Run by
//! graft-candle-train's tests: on the CPU in CI (tests/guide.rs), on the GPU in the CUDA build
//! (tests/gpu.rs).
use graft_candle::candle_core::{DType, Tensor};
use graft_candle::{CandleGraft, StepOutcome};
use graft_candle_models::llama::Sizes;
use graft_candle_train::Trainable;
use graft_candle_train::optim::{AdamW, AdamWConfig};

pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = graft_candle::device(0)?;
    let model = Trainable::random(&Sizes::TINY.config(), 42, DType::F32, &device)?;
    // Step count, bias corrections and learning rate live on the device.
    let mut opt = AdamW::new(model.vars().to_vec(), AdamWConfig::default())?;
    let mut graft = CandleGraft::new(&device)?;
    let train = graft.register("train");
    // Everything the step reads or writes in place: parameters, moments, scalars, tables.
    let mut statics: Vec<Tensor> = opt.statics().into_iter().cloned().collect();
    statics.extend(model.constants().into_iter().cloned());
    let statics: Vec<&Tensor> = statics.iter().collect();

    // One batch of 2 sequences of 16 tokens; the targets are the next tokens.
    let ids: Vec<u32> = (0..34).map(|i| (i * 7 % 256) as u32).collect();
    let all = Tensor::from_vec(ids, (2, 17), &device)?;
    let tokens = all.narrow(1, 0, 16)?.contiguous()?;
    let targets = all.narrow(1, 1, 16)?.contiguous()?;
    let mut losses = Vec::new();
    for step in 0..30 {
        // A schedule: a write to the device tensor between steps, never a new recording.
        opt.set_learning_rate(3e-3 * (1.0 - step as f64 / 30.0))?;
        let out = graft.call(train, &[&tokens, &targets], &statics, &[], |x| {
            // The loss and every gradient, each written once (the explicit backward program).
            let grads = model.gradients(&x[0], &x[1], None)?;
            opt.step(&grads)?;
            Ok(vec![grads.loss().clone()])
        })?;
        if graft.is_graphed() && step >= 2 {
            assert!(matches!(out.outcome, StepOutcome::Replayed(_)));
        }
        losses.push(out.outputs[0].to_vec1::<f32>()?[0]);
    }
    assert!(losses[29] < losses[0] - 1.0, "the loss falls: {losses:?}");
    assert_eq!((opt.applied_steps()?, opt.skipped_steps()?), (30, 0));
    Ok(())
}
