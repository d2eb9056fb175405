//! SGD with momentum and weight decay (PyTorch's formulation, no dampening), its learning
//! rate on the device.

use candle_core::{Result, Tensor, Var};

use super::Gradients;
use super::scalars::Scalars;

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
}

impl Sgd {
    /// SGD over `vars`, with zeroed momentum buffers. All on one device.
    pub fn new(vars: Vec<Var>, cfg: SgdConfig) -> Result<Sgd> {
        if !(0.0..1.0).contains(&cfg.momentum) {
            candle_core::bail!("sgd's momentum must be in [0, 1), got {}", cfg.momentum);
        }
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
        })
    }

    /// One update from `grads`, on the device and capturable: `buf = momentum * buf + g`,
    /// `theta -= lr * buf` (with `g += weight_decay * theta` first), or nothing at all when a
    /// gradient is not finite (counted as skipped).
    pub fn step(&mut self, grads: &impl Gradients) -> Result<()> {
        let finite = self
            .scalars
            .begin_step(self.params.iter().map(|p| p.var.as_tensor()), grads)?;
        let lr = self.scalars.lr();
        for p in &self.params {
            let theta = p.var.as_tensor();
            let Some(g) = grads.gradient(theta) else {
                continue;
            };
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
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.scalars.set_lr(lr)
    }

    /// The learning rate last set.
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
    /// momentum buffers, the learning rate and the step counts.
    pub fn statics(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = Vec::with_capacity(2 * self.params.len() + 3);
        for p in &self.params {
            all.push(p.var.as_tensor());
            all.extend(p.buf.as_ref().map(Var::as_tensor));
        }
        all.extend(self.scalars.tensors());
        all
    }
}
