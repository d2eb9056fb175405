//! The device-side values every capturable optimizer keeps (learning rate, applied and
//! skipped step counts) and the all-finite flag that gates an update.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::Gradients;

/// An optimizer's scalars, each a `[1]` f32 tensor on the parameters' device.
#[derive(Debug)]
pub(crate) struct Scalars {
    lr: Var,
    /// Updates applied: AdamW's `t`.
    applied: Var,
    /// Updates skipped because a gradient was not finite.
    skipped: Var,
    /// The rate last written, so reading it costs no device round trip.
    lr_host: f64,
}

/// The flag of one step: whether every gradient was finite.
pub(crate) struct Finite {
    /// `[1]` u8: 1 when every gradient was finite.
    pub(crate) mask: Tensor,
}

impl Scalars {
    pub(crate) fn new(device: &Device, lr: f64) -> Result<Scalars> {
        check_rate(lr)?;
        Ok(Scalars {
            lr: Var::from_tensor(&Tensor::new(&[lr as f32], device)?)?,
            applied: Var::zeros(1, DType::F32, device)?,
            skipped: Var::zeros(1, DType::F32, device)?,
            lr_host: lr,
        })
    }

    pub(crate) fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_rate(lr)?;
        self.lr.set(&Tensor::new(&[lr as f32], self.lr.device())?)?;
        self.lr_host = lr;
        Ok(())
    }

    pub(crate) fn lr_host(&self) -> f64 {
        self.lr_host
    }

    pub(crate) fn lr(&self) -> &Tensor {
        self.lr.as_tensor()
    }

    pub(crate) fn applied(&self) -> &Tensor {
        self.applied.as_tensor()
    }

    pub(crate) fn tensors(&self) -> [&Tensor; 3] {
        [
            self.lr.as_tensor(),
            self.applied.as_tensor(),
            self.skipped.as_tensor(),
        ]
    }

    /// Checks the gradients of `params` and counts the step as applied or skipped, on the
    /// device. A gradient is finite when `g * 0` sums to 0: any inf or NaN makes it NaN.
    pub(crate) fn begin_step<'a>(
        &self,
        params: impl Iterator<Item = &'a Tensor>,
        grads: &impl Gradients,
    ) -> Result<Finite> {
        let mut total: Option<Tensor> = None;
        for p in params {
            if let Some(g) = grads.gradient(p) {
                let zero = (g.to_dtype(DType::F32)? * 0.0)?.sum_all()?;
                total = Some(match total {
                    Some(t) => (t + zero)?,
                    None => zero,
                });
            }
        }
        let total = match total {
            Some(t) => t.reshape(1)?,
            None => candle_core::bail!("the optimizer step got no gradient for any parameter"),
        };
        // A comparison with a tensor made on the device: a host scalar would be an upload.
        let mask = total.eq(&total.zeros_like()?)?;
        let ok = mask.to_dtype(DType::F32)?;
        self.applied.set(&(self.applied.as_tensor() + &ok)?)?;
        self.skipped
            .set(&(self.skipped.as_tensor() + ok.affine(-1.0, 1.0)?)?)?;
        Ok(Finite { mask })
    }

    /// Updates applied so far (a host read: between steps).
    pub(crate) fn applied_steps(&self) -> Result<u64> {
        read_count(&self.applied)
    }

    /// Updates skipped so far (a host read: between steps).
    pub(crate) fn skipped_steps(&self) -> Result<u64> {
        read_count(&self.skipped)
    }
}

impl Finite {
    /// `new` where the step's gradients were finite, `old` where not (`new` may be NaN).
    pub(crate) fn select(&self, new: &Tensor, old: &Tensor) -> Result<Tensor> {
        self.mask.broadcast_as(old.shape())?.where_cond(new, old)
    }
}

fn read_count(var: &Var) -> Result<u64> {
    let v = var.as_tensor().to_vec1::<f32>()?;
    Ok(v.first().copied().unwrap_or(0.0) as u64)
}

fn check_rate(lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        candle_core::bail!("the learning rate must be finite and not negative, got {lr}");
    }
    Ok(())
}
