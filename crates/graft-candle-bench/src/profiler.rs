//! A profiled range: CUDA's profiler API started and stopped around some work, so that
//! `ncu --profile-from-start off` (or any CUPTI tool honouring the range) sees only its kernels.

use graft_candle::candle_core::cuda_backend::cudarc::driver::sys;

use crate::common::BenchResult;

/// Runs `work` between `cuProfilerStart` and `cuProfilerStop` (in this thread's current CUDA
/// context: candle's, which the benchmarks run on). Without a profiler attached both calls do
/// nothing.
pub fn profiled<T>(work: impl FnOnce() -> BenchResult<T>) -> BenchResult<T> {
    // SAFETY: cuProfilerStart takes no arguments and only marks the start of a profiled range
    // in the current context (candle's, made current by its device on this thread).
    let started = unsafe { sys::cuProfilerStart() };
    if started != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuProfilerStart failed: {started:?}").into());
    }
    let out = work();
    // SAFETY: as above, for the end of the range.
    let stopped = unsafe { sys::cuProfilerStop() };
    if stopped != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuProfilerStop failed: {stopped:?}").into());
    }
    out
}
