//! Generation on the GPU: K = 8, 32 and 128 tokens per launch in a CUDA conditional loop
//! draw exactly the tokens of one replayed launch per token, greedy and sampled; and candle's
//! own random ops (cuRAND, host-side state) inside a step draw exactly the eager numbers.

use graft_candle::candle_core::{D, Tensor};
use graft_candle::{CandleGraft, EagerCause, StepOutcome};

use super::generate;
use super::{TestResult, gpu};

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_conditional_loop_draws_the_tokens_of_one_replay_per_token() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = generate::model(&gpu(), dir.path())?;
    let ks: &[usize] = if super::under_sanitizer() {
        &[8]
    } else {
        &[8, 32, 128]
    };
    let outcomes = generate::loop_equals_per_step(&model, ks, 8)?;
    assert!(
        outcomes.iter().all(|o| !matches!(o, StepOutcome::Eager(_))),
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, StepOutcome::Replayed(_)))
    );
    Ok(())
}

/// 50 calls of a step drawing with candle's `rand`, `randn` and a Gumbel sample on `rand`,
/// under graft and then eagerly from the same seed: the same numbers, call for call, and
/// the eager call after the run continues the same stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn candle_random_ops_in_a_step_draw_the_eager_numbers() -> TestResult {
    let device = gpu();
    let logits = Tensor::arange(0f32, 64.0, &device)?.reshape((2, 32))?;
    let draw = |inputs: &[Tensor]| -> graft_candle::candle_core::Result<Vec<Tensor>> {
        let u = Tensor::rand(0f32, 1f32, (2, 32), inputs[0].device())?;
        let n = Tensor::randn(0f32, 1f32, (2, 32), inputs[0].device())?;
        let gumbel = u.log()?.neg()?.log()?.neg()?;
        let pick = (&inputs[0] + gumbel)?.argmax(D::Minus1)?;
        Ok(vec![u, n, pick])
    };
    let read = |t: &[Tensor]| -> graft_candle::candle_core::Result<Vec<Vec<f32>>> {
        Ok(vec![
            t[0].flatten_all()?.to_vec1::<f32>()?,
            t[1].flatten_all()?.to_vec1::<f32>()?,
            t[2].to_dtype(graft_candle::candle_core::DType::F32)?
                .to_vec1::<f32>()?,
        ])
    };
    let calls = 50;
    device.set_seed(42)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register("draw");
    let mut graphed = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..calls {
        let out = graft.call(step, &[&logits], &[], &[], draw)?;
        graphed.push(read(&out.outputs)?);
        outcomes.push(out.outcome);
    }
    let after = read(&draw(std::slice::from_ref(&logits))?)?;
    device.set_seed(42)?;
    for (i, got) in graphed.iter().enumerate() {
        let want = read(&draw(std::slice::from_ref(&logits))?)?;
        assert_eq!(got, &want, "call {i}");
    }
    assert_eq!(
        after,
        read(&draw(std::slice::from_ref(&logits))?)?,
        "the eager call after"
    );
    for o in &outcomes[2..] {
        assert!(
            matches!(
                o,
                StepOutcome::Eager(EagerCause::Graft(
                    graft_core::EagerReason::HostRandom { .. }
                ))
            ),
            "{o:?}"
        );
    }
    Ok(())
}
