//! A tensor a custom op's forward pass computes beside its output and leaves for its backward
//! pass (attention's and cross-entropy's row log-sum-exps): candle's custom ops return one
//! storage, so the other lives in the op, which candle keeps in the graph until the graph is
//! dropped.

use std::sync::OnceLock;

use candle_core::op::BackpropOp;
use candle_core::{Result, Shape, Storage, Tensor};

use crate::KernelError;

/// Set once by the forward pass (from either backend), read by every backward pass after it.
#[derive(Debug, Default)]
pub(crate) struct Saved(OnceLock<Tensor>);

impl Saved {
    /// Keeps `storage` as a tensor of `shape` (contiguous, no gradient).
    pub(crate) fn put(&self, op: &'static str, storage: Storage, shape: Shape) -> Result<()> {
        let t = Tensor::from_storage(storage, shape, BackpropOp::none(), false);
        self.0
            .set(t)
            .map_err(|_| KernelError::SavedTwice { op }.into())
    }

    /// The tensor the forward pass kept.
    pub(crate) fn get(&self, op: &'static str) -> Result<Tensor> {
        match self.0.get() {
            Some(t) => Ok(t.clone()),
            None => Err(KernelError::NotSaved { op }.into()),
        }
    }
}
