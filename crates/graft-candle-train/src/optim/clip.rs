//! Gradient-norm clipping on the device: the global L2 norm of the gradients, and each
//! gradient scaled by min(1, max_norm / (norm + 1e-6)) (PyTorch's `clip_grad_norm_`), in the
//! step, with no host read, so a recorded step clips by each replay's own norm.

use std::collections::HashMap;

use candle_core::{DType, Result, Tensor, TensorId, Var};

use super::Gradients;

/// Gradients scaled to a global norm of at most `max_norm` ([`clip_grad_norm`]), and the norm
/// before the scaling. Pass them to an optimizer's `step`.
#[derive(Debug)]
pub struct ClippedGradients {
    grads: HashMap<TensorId, Tensor>,
    norm: Tensor,
}

impl ClippedGradients {
    /// The gradients' global L2 norm before clipping: `[1]` f32 on the device (read it after
    /// the step; a non-finite norm makes every clipped gradient NaN, and the optimizers then
    /// skip the step).
    pub fn norm(&self) -> &Tensor {
        &self.norm
    }
}

impl Gradients for ClippedGradients {
    fn gradient(&self, param: &Tensor) -> Option<&Tensor> {
        self.grads.get(&param.id())
    }
}

/// The gradients in `grads` of `params` (those that have one), scaled together so that their
/// global L2 norm is at most `max_norm` (left as they are when it already is): computed on
/// the device in f32, each scaled gradient in its own dtype. `max_norm` must be finite and
/// above 0.
pub fn clip_grad_norm<'a>(
    params: impl IntoIterator<Item = &'a Var>,
    grads: &impl Gradients,
    max_norm: f64,
) -> Result<ClippedGradients> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        candle_core::bail!("clip_grad_norm needs a finite max_norm above 0, got {max_norm}");
    }
    let found: Vec<(TensorId, &Tensor)> = params
        .into_iter()
        .filter_map(|p| grads.gradient(p.as_tensor()).map(|g| (p.id(), g)))
        .collect();
    let mut squares: Option<Tensor> = None;
    for (_, g) in &found {
        let s = g.to_dtype(DType::F32)?.sqr()?.sum_all()?.reshape(1)?;
        squares = Some(match squares {
            Some(total) => (total + s)?,
            None => s,
        });
    }
    let Some(squares) = squares else {
        candle_core::bail!("clip_grad_norm got no gradient for any parameter");
    };
    let norm = squares.sqrt()?;
    // min(1, max_norm / (norm + 1e-6)) = 1 - relu(1 - max_norm / (norm + 1e-6)).
    let scale = norm
        .affine(1.0, 1e-6)?
        .recip()?
        .affine(-max_norm, 1.0)?
        .relu()?
        .affine(-1.0, 1.0)?;
    let mut clipped = HashMap::with_capacity(found.len());
    for (id, g) in found {
        clipped.insert(id, g.broadcast_mul(&scale.to_dtype(g.dtype())?)?);
    }
    Ok(ClippedGradients {
        grads: clipped,
        norm,
    })
}
