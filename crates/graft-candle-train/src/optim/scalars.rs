//! The device-side values every capturable optimizer keeps (learning rate, applied and
//! skipped step counts, and the multi-tensor step's not-finite flag: graft-candle-kernels'
//! optimizer scalars, one `[4]` f32 tensor), the parameters a step updates, and the
//! all-finite flag that gates the elementwise reference update.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var};
use graft_candle_kernels::{OPTIM_SCALARS, OptimSlot, optim_scalars};

use super::{Gradients, LrSchedule};

/// An optimizer's scalars: a `[4]` f32 tensor on the parameters' device, by [`OptimSlot`].
#[derive(Debug)]
pub(crate) struct Scalars {
    values: Var,
    /// The rate last written, so reading it costs no device round trip.
    lr_host: f64,
    /// The schedule each step's rate follows, if any.
    schedule: Option<LrSchedule>,
}

/// The flag of one elementwise step: whether every gradient was finite.
pub(crate) struct Finite {
    /// `[1]` u8: 1 when every gradient was finite.
    pub(crate) mask: Tensor,
}

impl Scalars {
    pub(crate) fn new(device: &Device, lr: f64) -> Result<Scalars> {
        check_rate(lr)?;
        Ok(Scalars {
            values: Var::from_tensor(&optim_scalars(lr, device)?)?,
            lr_host: lr,
            schedule: None,
        })
    }

    pub(crate) fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_rate(lr)?;
        if self.schedule.is_some() {
            candle_core::bail!(
                "the learning rate follows a schedule: call set_schedule(None) before setting a constant rate"
            );
        }
        let value = Tensor::new(&[lr as f32], self.values.device())?;
        self.values
            .slice_set(&value, 0, OptimSlot::LearningRate.index())?;
        self.lr_host = lr;
        Ok(())
    }

    pub(crate) fn lr_host(&self) -> f64 {
        self.lr_host
    }

    /// Makes every later step's rate follow `schedule` (`None`: the last constant rate set).
    pub(crate) fn set_schedule(&mut self, schedule: Option<LrSchedule>) -> Result<()> {
        if let Some(s) = &schedule {
            s.check()?;
        } else if self.schedule.is_some() {
            let value = Tensor::new(&[self.lr_host as f32], self.values.device())?;
            self.values
                .slice_set(&value, 0, OptimSlot::LearningRate.index())?;
        }
        self.schedule = schedule;
        Ok(())
    }

    /// At the start of a step: writes the scheduled rate of the step count into the rate's
    /// slot, on the device (nothing without a schedule).
    pub(crate) fn follow_schedule(&self) -> Result<()> {
        let Some(schedule) = &self.schedule else {
            return Ok(());
        };
        let rate = schedule.rate(&self.slot(OptimSlot::Applied)?)?;
        self.values
            .slice_set(&rate, 0, OptimSlot::LearningRate.index())
    }

    /// Writes a checkpoint's scalars (checked by [`checked`]) in place; the host copy of the
    /// rate follows them (a host read).
    pub(crate) fn load(&mut self, saved: &Tensor) -> Result<()> {
        self.values.set(saved)?;
        self.lr_host = self.lr_device()?;
        Ok(())
    }

    /// The rate in the device's slot: the last step's under a schedule (a host read).
    pub(crate) fn lr_device(&self) -> Result<f64> {
        self.read(OptimSlot::LearningRate).map(f64::from)
    }

    /// The `[4]` tensor: what the multi-tensor updates read and advance, and a static of the
    /// step.
    pub(crate) fn tensor(&self) -> &Tensor {
        self.values.as_tensor()
    }

    /// One slot as a `[1]` view of the tensor.
    pub(crate) fn slot(&self, slot: OptimSlot) -> Result<Tensor> {
        self.values.narrow(0, slot.index(), 1)
    }

    /// Checks `grads` and counts the step as applied or skipped, on the device, for the
    /// elementwise update. A gradient is finite when `g * 0` sums to 0: any inf or NaN makes
    /// it NaN.
    pub(crate) fn begin_step(&self, grads: &[&Tensor]) -> Result<Finite> {
        // Zeros made on the device (a host scalar would be an upload).
        let mut total = self.slot(OptimSlot::Applied)?.zeros_like()?;
        for g in grads {
            let zero = (g.to_dtype(DType::F32)? * 0.0)?.sum_all()?.reshape(1)?;
            total = (total + zero)?;
        }
        let mask = total.eq(&total.zeros_like()?)?;
        let ok = mask.to_dtype(DType::F32)?;
        let mut delta = vec![ok.zeros_like()?; OPTIM_SCALARS];
        delta[OptimSlot::Skipped.index()] = ok.affine(-1.0, 1.0)?;
        delta[OptimSlot::Applied.index()] = ok;
        let next = (self.values.as_tensor() + Tensor::cat(&delta, 0)?)?;
        self.values.set(&next)?;
        Ok(Finite { mask })
    }

    /// Updates applied so far (a host read: between steps).
    pub(crate) fn applied_steps(&self) -> Result<u64> {
        self.read(OptimSlot::Applied).map(|v| v as u64)
    }

    /// Updates skipped so far (a host read: between steps).
    pub(crate) fn skipped_steps(&self) -> Result<u64> {
        self.read(OptimSlot::Skipped).map(|v| v as u64)
    }

    /// One slot's value (a host read).
    fn read(&self, slot: OptimSlot) -> Result<f32> {
        let v = self.slot(slot)?.to_vec1::<f32>()?;
        Ok(v.first().copied().unwrap_or(0.0))
    }
}

impl Finite {
    /// `new` where the step's gradients were finite, `old` where not (`new` may be NaN).
    pub(crate) fn select(&self, new: &Tensor, old: &Tensor) -> Result<Tensor> {
        self.mask.broadcast_as(old.shape())?.where_cond(new, old)
    }
}

/// The parameters of `params` (each found by `var`) that have a gradient in `grads`, each
/// with it, in order; an error when none has. Parameters without a gradient are left alone.
pub(crate) fn with_gradients<'p, 'g, P>(
    params: &'p [P],
    var: impl Fn(&P) -> &Var,
    grads: &'g impl Gradients,
) -> Result<Vec<(&'p P, &'g Tensor)>> {
    let found: Vec<_> = params
        .iter()
        .filter_map(|p| grads.gradient(var(p).as_tensor()).map(|g| (p, g)))
        .collect();
    if found.is_empty() {
        candle_core::bail!("the optimizer step got no gradient for any parameter");
    }
    Ok(found)
}

fn check_rate(lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        candle_core::bail!("the learning rate must be finite and not negative, got {lr}");
    }
    Ok(())
}

/// Checkpoint tensor `name` of `state`, which must have `like`'s shape and dtype.
pub(crate) fn checked<'s>(
    state: &'s HashMap<String, Tensor>,
    name: &str,
    like: &Tensor,
) -> Result<&'s Tensor> {
    let Some(t) = state.get(name) else {
        candle_core::bail!(
            "the optimizer state has no {name}: pass what the optimizer's state() gave"
        );
    };
    if t.shape() != like.shape() || t.dtype() != like.dtype() {
        candle_core::bail!(
            "the optimizer state's {name} is {:?} {:?}, this optimizer's is {:?} {:?}: resume with the parameters it was saved with",
            t.dtype(),
            t.shape(),
            like.dtype(),
            like.shape()
        );
    }
    Ok(t)
}
