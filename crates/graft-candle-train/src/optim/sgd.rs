//! SGD with momentum and weight decay (PyTorch's formulation, no dampening), its learning
//! rate on the device.

use candle_core::{Result, Tensor, Var};
use graft_candle_kernels::{OptimSlot, SgdHyper, sgd_update};

use super::scalars::{Scalars, with_gradients};
use super::{Gradients, LrSchedule, Update};

/// SGD's hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// The initial learning rate (change it with [`Sgd::set_learning_rate`]).
    pub lr: f64,
    /// Momentum (0 for plain SGD, with no buffer).
    pub momentum: f64,
    /// L2 weight decay, added to the gradient.
    pub weight_decay: f64,
}

#[derive(Debug)]
struct Param {
    var: Var,
    /// The momentum buffer, when momentum is not 0.
    buf: Option<Var>,
}

/// SGD whose learning rate is a device tensor: one recording replays every step, and a step
/// with a gradient that is not finite is skipped on the device (see the
/// [module documentation](super)).
#[derive(Debug)]
pub struct Sgd {
    params: Vec<Param>,
    cfg: SgdConfig,
    scalars: Scalars,
    update: Update,
}

impl SgdConfig {
    fn hyper(&self) -> SgdHyper {
        SgdHyper {
            momentum: self.momentum,
            weight_decay: self.weight_decay,
        }
    }
}

impl Sgd {
    /// SGD over `vars`, with zeroed momentum buffers, updated by the multi-tensor kernels. All
    /// on one device.
    pub fn new(vars: Vec<Var>, cfg: SgdConfig) -> Result<Sgd> {
        Sgd::with_update(vars, cfg, Update::MultiTensor)
    }

    /// SGD over `vars` updated as `update` says ([`Update::Elementwise`]: the reference).
    pub fn with_update(vars: Vec<Var>, cfg: SgdConfig, update: Update) -> Result<Sgd> {
        // Momentum in [0, 1), weight decay finite and not negative.
        SgdHyper::check(&cfg.hyper())?;
        let device = match vars.first() {
            Some(v) => v.device().clone(),
            None => candle_core::bail!("sgd needs at least one parameter"),
        };
        let scalars = Scalars::new(&device, cfg.lr)?;
        let params = vars
            .into_iter()
            .map(|var| {
                let buf = (cfg.momentum != 0.0)
                    .then(|| Var::zeros(var.shape(), var.dtype(), var.device()))
                    .transpose()?;
                Ok(Param { var, buf })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Sgd {
            params,
            cfg,
            scalars,
            update,
        })
    }

    /// How the steps update the parameters.
    pub fn update(&self) -> Update {
        self.update
    }

    /// One update from `grads`, on the device and capturable: `buf = momentum * buf + g`,
    /// `theta -= lr * buf` (with `g += weight_decay * theta` first), or nothing at all when a
    /// gradient is not finite (counted as skipped).
    pub fn step(&mut self, grads: &impl Gradients) -> Result<()> {
        self.scalars.follow_schedule()?;
        let found = with_gradients(&self.params, |p| &p.var, grads)?;
        if self.update == Update::Elementwise {
            return self.elementwise(&found);
        }
        let params: Vec<&Tensor> = found.iter().map(|(p, _)| p.var.as_tensor()).collect();
        let grads: Vec<&Tensor> = found.iter().map(|(_, g)| *g).collect();
        let buffers: Option<Vec<&Tensor>> = found
            .iter()
            .map(|(p, _)| p.buf.as_ref().map(Var::as_tensor))
            .collect();
        sgd_update(
            &params,
            &grads,
            buffers.as_deref(),
            self.scalars.tensor(),
            &self.cfg.hyper(),
        )
    }

    /// The reference step: elementwise candle ops per parameter.
    fn elementwise(&self, found: &[(&Param, &Tensor)]) -> Result<()> {
        let grads: Vec<&Tensor> = found.iter().map(|(_, g)| *g).collect();
        let finite = self.scalars.begin_step(&grads)?;
        let lr = self.scalars.slot(OptimSlot::LearningRate)?;
        for &(p, g) in found {
            let theta = p.var.as_tensor();
            let lr = lr.to_dtype(theta.dtype())?;
            let g = if self.cfg.weight_decay == 0.0 {
                g.clone()
            } else {
                (g + (theta * self.cfg.weight_decay)?)?
            };
            let direction = match &p.buf {
                Some(buf) => {
                    let next = ((buf.as_tensor() * self.cfg.momentum)? + &g)?;
                    buf.set(&finite.select(&next, buf.as_tensor())?)?;
                    next
                }
                None => g,
            };
            let next = (theta - direction.broadcast_mul(&lr)?)?;
            p.var.set(&finite.select(&next, theta)?)?;
        }
        Ok(())
    }

    /// Sets the learning rate of the next steps (a write to a device tensor, between steps).
    /// Refused while a schedule is set ([`Self::set_schedule`]).
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.scalars.set_lr(lr)
    }

    /// Makes every later step compute its learning rate on the device from the applied-step
    /// count (`None`: back to the constant rate last set). A step recorded with a schedule
    /// replays following it; one recorded without reads whatever rate the slot holds.
    pub fn set_schedule(&mut self, schedule: Option<LrSchedule>) -> Result<()> {
        self.scalars.set_schedule(schedule)
    }

    /// The learning rate the last step used (the scheduled one under a schedule): a host
    /// read, so between steps.
    pub fn learning_rate_now(&self) -> Result<f64> {
        self.scalars.lr_device()
    }

    /// The constant learning rate last set (under a schedule, [`Self::learning_rate_now`]
    /// gives the rate a step used).
    pub fn learning_rate(&self) -> f64 {
        self.scalars.lr_host()
    }

    /// Updates applied so far (a host read, so between steps).
    pub fn applied_steps(&self) -> Result<u64> {
        self.scalars.applied_steps()
    }

    /// Steps skipped because a gradient was not finite (a host read, so between steps).
    pub fn skipped_steps(&self) -> Result<u64> {
        self.scalars.skipped_steps()
    }

    /// Every tensor a step reads or writes in place, to pass as statics: the parameters, the
    /// momentum buffers, and the scalars (learning rate, step counts, flag).
    pub fn statics(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = Vec::with_capacity(2 * self.params.len() + 1);
        for p in &self.params {
            all.push(p.var.as_tensor());
            all.extend(p.buf.as_ref().map(Var::as_tensor));
        }
        all.push(self.scalars.tensor());
        all
    }
}
