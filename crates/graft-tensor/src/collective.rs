//! [`Collective`]: the all-reduce a tensor-parallel model runs between its ranks, on the
//! simulator ([`graft_sim::SimComm`]) and on CUDA ([`graft_cuda::NcclComm`]).

use std::fmt;

use graft_cuda::NcclComm;
use graft_sim::SimComm;

use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

/// One rank's end of a communicator: an in-place sum over the ranks, enqueued on the rank's
/// runtime stream (so a body's all-reduce is recorded into its graph and replayed with it).
pub trait Collective: Send + Sync + fmt::Debug + 'static {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// `x = sum over ranks of x`, for a whole-buffer f32 tensor.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<()>;
}

/// The buffer and element count of `x`, which must be a whole f32 buffer.
fn whole_f32(x: &Tensor) -> Result<usize> {
    if x.dtype() != DType::F32 {
        return Err(TensorError::DType {
            op: "all_reduce_sum",
            operand: "x",
            expected: DType::F32,
            found: x.dtype(),
        });
    }
    if !x.is_whole_buffer() {
        return Err(TensorError::NotWholeBuffer {
            operand: "x",
            offset: x.offset(),
            bytes: x.bytes(),
            buffer: x.buffer().len(),
        });
    }
    Ok(x.numel())
}

impl Collective for SimComm {
    fn rank(&self) -> usize {
        SimComm::rank(self)
    }

    fn world(&self) -> usize {
        SimComm::world(self)
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<()> {
        let n = whole_f32(x)?;
        Ok(self.all_reduce_sum_f32(x.buffer(), n)?)
    }
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world(&self) -> usize {
        NcclComm::world(self)
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<()> {
        let n = whole_f32(x)?;
        Ok(self.all_reduce_sum_f32(x.buffer(), n)?)
    }
}
