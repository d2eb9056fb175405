//! graft-candle on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine, through
//! `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): graft-cuda over candle's
//! stream, the device set up for capture, and the device-side generator replayed.
#![cfg(feature = "cuda")]

use graft_candle::CandleGraft;
use graft_candle::candle_core::Tensor;

#[path = "gpu/random.rs"]
mod random;

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
