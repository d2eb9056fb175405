//! `CandleGraft::call_into` on any device (tests/call_into.rs on the CPU, tests/gpu.rs on the
//! GPU, graphed): outputs written into the caller's tensors, equal to `call`'s, and every
//! mismatch between an output and the tensor given for it refused with its position.

use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle::{CandleGraft, Error, StepOutcome};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// y = 2 w x + 1, and its sum: the step of these tests (x an input, w a static).
fn step(t: &[Tensor], w: &Tensor) -> candle_core::Result<Vec<Tensor>> {
    let y = ((&t[0] * w)?.affine(2.0, 1.0))?;
    let total = y.sum_all()?;
    Ok(vec![y, total])
}

/// 12 calls of the step writing into the same two tensors, each equal to `call`'s outputs on
/// a second runtime; then the mismatches.
pub(crate) fn call_into_writes_the_given_tensors(device: &Device) -> TestResult {
    let mut into = CandleGraft::new(device)?;
    let mut fresh = CandleGraft::new(device)?;
    let (a, b) = (into.register("step"), fresh.register("step"));
    let w = Tensor::arange(0f32, 8., device)?;
    let x = Tensor::ones(8, DType::F32, device)?;
    let outputs = [
        Tensor::zeros(8, DType::F32, device)?,
        Tensor::zeros((), DType::F32, device)?,
    ];
    let mut outcomes = Vec::new();
    for i in 0..12 {
        let x = x.affine(1.0, f64::from(i))?;
        let outcome = into.call_into(a, &[&x], &[&w], &[], &outputs, |t| step(t, &w))?;
        outcomes.push(outcome);
        let want = fresh.call(b, &[&x], &[&w], &[], |t| step(t, &w))?.outputs;
        assert_eq!(
            outputs[0].to_vec1::<f32>()?,
            want[0].to_vec1::<f32>()?,
            "call {i}"
        );
        assert_eq!(
            outputs[1].to_scalar::<f32>()?,
            want[1].to_scalar::<f32>()?,
            "call {i}"
        );
    }
    if into.is_graphed() {
        assert!(
            outcomes[2..]
                .iter()
                .any(|o| matches!(o, StepOutcome::Replayed(_))),
            "{outcomes:?}"
        );
    }
    // A tensor of another shape, another dtype, one missing, one too many.
    let wrong_shape = [Tensor::zeros(4, DType::F32, device)?, outputs[1].clone()];
    let wrong_dtype = [outputs[0].clone(), Tensor::zeros((), DType::F64, device)?];
    let too_few = [outputs[0].clone()];
    let too_many = [
        outputs[0].clone(),
        outputs[1].clone(),
        Tensor::zeros(1, DType::F32, device)?,
    ];
    for (given, position) in [
        (&wrong_shape[..], 0),
        (&wrong_dtype[..], 1),
        (&too_few[..], 1),
        (&too_many[..], 2),
    ] {
        match into.call_into(a, &[&x], &[&w], &[], given, |t| step(t, &w)) {
            Err(Error::OutputMismatch { position: p, .. }) => assert_eq!(p, position),
            other => panic!("expected a mismatch at output {position}, got {other:?}"),
        }
    }
    // The right tensors still work after the refusals.
    into.call_into(a, &[&x], &[&w], &[], &outputs, |t| step(t, &w))?;
    Ok(())
}
