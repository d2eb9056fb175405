//! graft-candle on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine, through
//! `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): graft-cuda over candle's
//! stream, the device set up for capture, the device-side generator replayed,
//! `call_into`'s outputs and allocations (counted with a global allocator), and candle's TF32
//! switch as part of a call's signature.
#![cfg(feature = "cuda")]

use graft_candle::candle_core::{DType, Tensor};
use graft_candle::{CandleGraft, StepOutcome};

#[path = "gpu/random.rs"]
mod random;

#[path = "support/call_into.rs"]
mod call_into;

#[path = "../../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

/// `call_into` graphed: the outputs land in the given tensors, equal to `call`'s.
#[test]
#[ignore = "needs a CUDA GPU"]
fn call_into_writes_the_given_tensors() -> TestResult {
    call_into::call_into_writes_the_given_tensors(&gpu())
}

/// A decode-like loop through `call_into` on the same tensors (tokens in one tensor the step
/// reads and its output overwrites in place of a fresh one), with as many statics as a model
/// has weights (more than a call's inline scratch holds): after the warmup and the recording,
/// 1,000 replays allocate nothing on the host (guards off: a guarded call captures, which
/// allocates; graft-core's tests/no_alloc.rs counts the replays between guards).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_replay_into_the_same_tensors_allocates_nothing() -> TestResult {
    let device = gpu();
    let config = graft_core::Config {
        guards: None,
        ..graft_core::Config::default()
    };
    let mut graft = CandleGraft::with_config(&device, config)?;
    let step = graft.register("step");
    let w = Tensor::arange(0f32, 64., &device)?;
    let x = Tensor::ones(64, DType::F32, &device)?;
    let out = [Tensor::zeros(64, DType::F32, &device)?];
    let weights = (0..40)
        .map(|i| Tensor::full(i as f32, 16, &device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let statics: Vec<&Tensor> = std::iter::once(&w).chain(&weights).collect();
    let body = |t: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![((&t[0] * &w)?.affine(0.5, 1.0))?])
    };
    for _ in 0..4 {
        graft.call_into(step, &[&x], &statics, &[], &out, body)?;
    }
    let before = allocations();
    for _ in 0..1000 {
        let outcome = graft.call_into(step, &[&x], &statics, &[], &out, body)?;
        assert!(matches!(outcome, StepOutcome::Replayed(_)), "{outcome:?}");
    }
    let allocated = allocations() - before;
    let want: Vec<f32> = (0..64).map(|i| i as f32 * 0.5 + 1.0).collect();
    assert_eq!(out[0].to_vec1::<f32>()?, want);
    assert_eq!(allocated, 0, "host allocations in 1,000 replays");
    Ok(())
}

/// candle's TF32 switch is part of a call's signature: a step recorded with it off warms up
/// and records again once it is on, and its replays then equal eager execution under it (a
/// replay of the first recording would keep the full-precision GEMM).
#[test]
#[ignore = "needs a CUDA GPU"]
fn flipping_tf32_records_the_step_again() -> TestResult {
    use graft_candle::candle_core::cuda::{
        gemm_reduced_precision_f32, set_gemm_reduced_precision_f32,
    };
    /// Puts the switch back however the test ends.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_gemm_reduced_precision_f32(self.0);
        }
    }
    let _restore = Restore(gemm_reduced_precision_f32());
    let device = gpu();
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register("matmul");
    let a = Tensor::arange(0f32, 65536., &device)?
        .reshape((256, 256))?
        .affine(1e-3, 0.)?
        .sin()?;
    let b = a.t()?.cos()?;
    let body = |t: &[Tensor]| -> candle_core::Result<Vec<Tensor>> { Ok(vec![t[0].matmul(&t[1])?]) };
    let values = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    /// Four calls with the switch at one setting: their outcomes, the last call's values and
    /// eager execution's.
    struct Run {
        outcomes: Vec<StepOutcome>,
        graft: Vec<f32>,
        eager: Vec<f32>,
    }
    let mut run = |tf32: bool| -> Result<Run, Box<dyn std::error::Error>> {
        set_gemm_reduced_precision_f32(tf32);
        let mut outcomes = Vec::new();
        let mut graft_values = Vec::new();
        for _ in 0..4 {
            let s = graft.call(step, &[&a, &b], &[], &[], body)?;
            outcomes.push(s.outcome);
            graft_values = values(&s.outputs[0])?;
        }
        Ok(Run {
            outcomes,
            graft: graft_values,
            eager: values(&a.matmul(&b)?)?,
        })
    };
    let (off, on) = (run(false)?, run(true)?);
    assert_ne!(
        on.eager, off.eager,
        "TF32 changed no bit of this product: the test shows nothing"
    );
    assert!(
        matches!(off.outcomes[3], StepOutcome::Replayed(_)),
        "{:?}",
        off.outcomes
    );
    assert_eq!(off.graft, off.eager);
    assert!(
        !matches!(on.outcomes[0], StepOutcome::Replayed(_)),
        "replayed across the switch: {:?}",
        on.outcomes
    );
    assert!(
        matches!(on.outcomes[3], StepOutcome::Replayed(_)),
        "{:?}",
        on.outcomes
    );
    assert_eq!(on.graft, on.eager);
    Ok(())
}

#[path = "support/gpu.rs"]
mod common;
use common::*;

/// graft-cuda adopts candle's stream, and refuses the default streams, which cannot be
/// captured.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graft_cuda_adopts_candles_stream_and_refuses_default_streams() -> TestResult {
    use graft_candle::candle_core::cuda_backend::cudarc::driver::CudaContext;
    let device = gpu();
    let stream = device.as_cuda_device()?.cuda_stream();
    let adopted = graft_cuda::CudaDevice::from_stream(stream.clone())?;
    assert_eq!(adopted.ordinal(), 0);
    drop(adopted);
    // candle's stream still works after graft's device is gone.
    let x = Tensor::new(&[1f32, 2., 3.], &device)?;
    assert_eq!((x * 2.0)?.to_vec1::<f32>()?, [2., 4., 6.]);
    let context = CudaContext::new(0)?;
    for stream in [context.per_thread_stream(), context.default_stream()] {
        match graft_cuda::CudaDevice::from_stream(stream) {
            Err(e) => assert!(e.to_string().contains("default stream"), "{e}"),
            Ok(_) => panic!("a default stream was adopted"),
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_is_set_up_for_capture() -> TestResult {
    let device = gpu();
    let cuda = device.as_cuda_device()?;
    assert!(!cuda.is_event_tracking());
    assert!(!graft_candle::cuda::capture_stream(cuda).is_null());
    let graft = CandleGraft::new(&device)?;
    assert!(graft.is_graphed());
    Ok(())
}

/// A tensor of another candle device of the same GPU (a second `graft_candle::device(0)`,
/// with its own stream) is refused with an error that says so, not with "cuda:0 is not
/// cuda:0".
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_tensor_of_another_device_of_the_same_gpu_is_named_as_such() -> TestResult {
    let (a, b) = (gpu(), gpu());
    let mut graft = CandleGraft::new(&a)?;
    let step = graft.register("step");
    let x = Tensor::ones(4, DType::F32, &b)?;
    let err = graft
        .call(step, &[&x], &[], &[], |i| Ok(vec![(&i[0] * 2.0)?]))
        .err()
        .ok_or("a tensor of another device was taken")?;
    assert!(
        matches!(
            err,
            graft_candle::Error::OtherDeviceOfGpu { position: 0, .. }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("one Device, cloned"), "{err}");
    Ok(())
}
