//! The generator's kernels in a build without the `cuda` feature (chosen in `random/mod.rs`):
//! loading is a no-op and a draw refuses; no CUDA tensor can exist in this build, so neither
//! is ever reached through a tensor.

use std::ops::Range;

use candle_core::{CudaDevice, CudaStorage, Result, bail};

/// Nothing to load without CUDA.
pub(super) fn load(_device: &CudaDevice) -> Result<()> {
    Ok(())
}

/// Refuses: there are no CUDA tensors in this build.
pub(super) fn uniform(
    _state: &CudaStorage,
    _range: Range<usize>,
    _n: usize,
) -> Result<CudaStorage> {
    bail!(
        "drawing random numbers on CUDA needs graft-candle's cuda feature; build it with --features cuda"
    )
}

/// Refuses: there are no CUDA tensors in this build.
pub(super) fn advance(_state: &mut CudaStorage, _range: Range<usize>, _blocks: u64) -> Result<()> {
    bail!(
        "drawing random numbers on CUDA needs graft-candle's cuda feature; build it with --features cuda"
    )
}
