//! Gradients summed over several micro-batches in place, for gradient accumulation under a
//! recorded step.

use candle_core::{Result, Tensor, Var};

use super::Gradients;

/// One zeroed buffer per parameter that micro-batch steps add their gradients to.
///
/// A training loop with k micro-batches records two steps: the micro-batch step (forward,
/// backward, [`GradAccumulator::accumulate`]) and the update step (the optimizer's `step`
/// from this accumulator, then [`GradAccumulator::zero`]). The buffers are zeroed at the end
/// of the update, not at the start of the first micro-batch, so that every micro-batch runs
/// the same body and one recording serves all k of them. Scale the loss by `1/k` in the
/// micro-batch step to get the mean gradient.
#[derive(Debug)]
pub struct GradAccumulator {
    /// `(parameter, its gradient sum)`.
    sums: Vec<(Tensor, Var)>,
}

impl GradAccumulator {
    /// Zeroed sums for `vars`.
    pub fn new(vars: &[Var]) -> Result<GradAccumulator> {
        let sums = vars
            .iter()
            .map(|v| {
                let sum = Var::zeros(v.shape(), v.dtype(), v.device())?;
                Ok((v.as_tensor().clone(), sum))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GradAccumulator { sums })
    }

    /// Adds the gradients of one backward pass (candle's `GradStore`, or a
    /// [`StepGradients`](crate::StepGradients)), in place.
    pub fn accumulate(&self, grads: &impl Gradients) -> Result<()> {
        for (param, sum) in &self.sums {
            if let Some(g) = grads.gradient(param) {
                sum.set(&(sum.as_tensor() + g)?)?;
            }
        }
        Ok(())
    }

    /// Zeroes every sum, in place.
    pub fn zero(&self) -> Result<()> {
        for (_, sum) in &self.sums {
            sum.set(&sum.as_tensor().zeros_like()?)?;
        }
        Ok(())
    }

    /// The sums, to pass as statics of both steps.
    pub fn statics(&self) -> Vec<&Tensor> {
        self.sums.iter().map(|(_, s)| s.as_tensor()).collect()
    }
}

impl Gradients for GradAccumulator {
    fn gradient(&self, param: &Tensor) -> Option<&Tensor> {
        self.sums
            .iter()
            .find(|(p, _)| p.id() == param.id())
            .map(|(_, s)| s.as_tensor())
    }
}
