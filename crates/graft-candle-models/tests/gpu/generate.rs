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

/// Each kind of candle operation a decode step uses, alone in the body of a device loop of
/// one iteration: each is recorded (no eager fallback) and replays the eager result. Names
/// every operation that fails, so a driver rule a body breaks is found by its operation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn each_candle_operation_kind_records_inside_a_device_loop() -> TestResult {
    use graft_candle::candle_core::{DType, Result as CResult};
    let _ = tracing_subscriber::fmt()
        .with_env_filter("graft_cuda=debug")
        .with_test_writer()
        .try_init();
    type Op = fn(&Tensor, &Tensor, &Tensor) -> CResult<Tensor>;
    let ops: [(&str, Op); 12] = [
        ("affine kernel", |x, _, _| x.affine(2.0, 1.0)),
        ("matmul (cuBLAS)", |x, w, _| x.matmul(w)),
        ("zeros (memset)", |x, _, _| x.zeros_like()),
        ("copy (memcpy)", |x, _, _| x.copy()),
        ("to_dtype", |x, _, _| {
            x.to_dtype(DType::U32)?.to_dtype(DType::F32)
        }),
        ("ones and full", |x, _, _| {
            Tensor::ones(x.shape(), DType::F32, x.device())?
                + Tensor::full(2f32, x.shape(), x.device())?
        }),
        ("min_keepdim on u32", |x, _, _| {
            x.to_dtype(DType::U32)?
                .min_keepdim(0)?
                .to_dtype(DType::F32)?
                .broadcast_as(x.shape())?
                .contiguous()
        }),
        ("where_cond", |x, _, i| {
            i.broadcast_as(x.shape())?
                .contiguous()?
                .where_cond(x, &x.neg()?)
        }),
        ("index_select", |x, _, i| {
            x.index_select(i, 1)?.broadcast_as(x.shape())?.contiguous()
        }),
        ("softmax", |x, _, _| candle_nn::ops::softmax_last_dim(x)),
        ("rms_norm", |x, _, _| {
            candle_nn::ops::rms_norm(x, &Tensor::ones(x.dim(1)?, DType::F32, x.device())?, 1e-5)
        }),
        ("cat and narrow", |x, _, _| {
            Tensor::cat(&[x, x], 1)?
                .narrow(1, 0, x.dim(1)?)?
                .contiguous()
        }),
    ];
    let device = gpu();
    let x = Tensor::arange(0f32, 32.0, &device)?.reshape((4, 8))?;
    let w = Tensor::arange(0f32, 64.0, &device)?
        .reshape((8, 8))?
        .affine(0.01, 0.0)?;
    let i = Tensor::new(&[1u32], &device)?;
    let mut failed = Vec::new();
    for (name, op) in ops {
        let want = op(&x, &w, &i)?.flatten_all()?.to_vec1::<f32>()?;
        let out = Tensor::zeros((4, 8), DType::F32, &device)?;
        let flag = Tensor::zeros(1, DType::U32, &device)?;
        let mut graft = CandleGraft::new(&device)?;
        let step = graft.register(name);
        for call in 0..3 {
            flag.slice_set(&Tensor::ones(1, DType::U32, &device)?, 0, 0)?;
            out.slice_set(&Tensor::zeros((4, 8), DType::F32, &device)?, 0, 0)?;
            let ran = graft.call_looping(step, &[], &[&x, &w, &i, &out, &flag], &[], |_, loops| {
                loops.while_loop(&flag, || {
                    out.slice_set(&op(&x, &w, &i)?, 0, 0)?;
                    flag.slice_set(&(&flag - &flag)?, 0, 0)
                })?;
                Ok(Vec::new())
            });
            let got = out.flatten_all()?.to_vec1::<f32>()?;
            match ran {
                Err(e) => {
                    failed.push(format!("{name}: {e}"));
                    break;
                }
                Ok(s) if matches!(s.outcome, StepOutcome::Eager(_)) && call > 0 => {
                    failed.push(format!("{name}: {:?}", s.outcome));
                    break;
                }
                Ok(_) if got != want => {
                    failed.push(format!("{name}: call {call} gave {got:?}, eager {want:?}"));
                    break;
                }
                Ok(_) => {}
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
    Ok(())
}
