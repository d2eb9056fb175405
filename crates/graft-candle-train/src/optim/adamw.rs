//! AdamW (Loshchilov and Hutter) with its step count, bias corrections and learning rate on
//! the device.

use std::collections::HashMap;

use candle_core::{Result, Tensor, Var};
use graft_candle_kernels::{AdamWHyper, OptimSlot, adamw_update, adamw_update_mixed};

use super::scalars::{Scalars, checked, with_gradients};
use super::{Gradients, LrSchedule, Update};

/// AdamW's hyperparameters; the defaults are candle-nn's and PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// The initial learning rate (change it with [`AdamW::set_learning_rate`]).
    pub lr: f64,
    /// The first moment's decay.
    pub beta1: f64,
    /// The second moment's decay.
    pub beta2: f64,
    /// Added to the second moment's square root.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            lr: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

#[derive(Debug)]
struct Param {
    var: Var,
    m: Var,
    v: Var,
    /// Mixed precision: the 16-bit working copy of `var` (an f32 master) that the model
    /// reads and whose gradient the step is given; rewritten from the master by each step.
    copy: Option<Var>,
}

impl Param {
    /// The tensor whose gradient updates this parameter: the copy's, with mixed precision.
    fn graded(&self) -> &Var {
        self.copy.as_ref().unwrap_or(&self.var)
    }
}

/// AdamW whose every per-step value is a device tensor: one recording replays every step
/// (see the [module documentation](super)).
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Param>,
    cfg: AdamWConfig,
    scalars: Scalars,
    update: Update,
}

impl AdamWConfig {
    fn hyper(&self) -> AdamWHyper {
        AdamWHyper {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

impl AdamW {
    /// AdamW over `vars`, with zeroed moments, updated by the multi-tensor kernels. All on one
    /// device.
    pub fn new(vars: Vec<Var>, cfg: AdamWConfig) -> Result<AdamW> {
        AdamW::with_update(vars, cfg, Update::MultiTensor)
    }

    /// AdamW over `vars` updated as `update` says ([`Update::Elementwise`]: the reference).
    pub fn with_update(vars: Vec<Var>, cfg: AdamWConfig, update: Update) -> Result<AdamW> {
        // Betas in [0, 1), eps and weight decay finite and not negative.
        AdamWHyper::check(&cfg.hyper())?;
        let device = match vars.first() {
            Some(v) => v.device().clone(),
            None => candle_core::bail!("adamw needs at least one parameter"),
        };
        let scalars = Scalars::new(&device, cfg.lr)?;
        let params = vars
            .into_iter()
            .map(|var| {
                let zeros = || Var::zeros(var.shape(), var.dtype(), var.device());
                Ok(Param {
                    m: zeros()?,
                    v: zeros()?,
                    var,
                    copy: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            params,
            cfg,
            scalars,
            update,
        })
    }

    /// This optimizer over f32 masters made mixed precision: `copies[i]` is the bf16 or f16
    /// working copy of parameter `i` that the model computes with (for a
    /// `Trainable::random_mixed`, `AdamW::new(model.masters().to_vec(), cfg)?
    /// .mixed(model.vars().to_vec())`). A step finds each gradient by its copy, updates the
    /// master and moments in f32 and rewrites the copy from the master: in the same pass of
    /// the multi-tensor update (no cast kernel), or by candle ops in the elementwise
    /// reference.
    pub fn mixed(mut self, copies: Vec<Var>) -> Result<AdamW> {
        if self.params.len() != copies.len() {
            candle_core::bail!(
                "{} masters but {} copies: pass one working copy per parameter, in order",
                self.params.len(),
                copies.len()
            );
        }
        for (p, copy) in self.params.iter_mut().zip(copies) {
            let half = matches!(
                copy.dtype(),
                candle_core::DType::BF16 | candle_core::DType::F16
            );
            if p.var.dtype() != candle_core::DType::F32 || !half || p.var.shape() != copy.shape() {
                candle_core::bail!(
                    "a master is {:?} {:?} and its copy {:?} {:?}: masters are f32 and copies bf16 or f16 of their shape",
                    p.var.dtype(),
                    p.var.dims(),
                    copy.dtype(),
                    copy.dims()
                );
            }
            p.copy = Some(copy);
        }
        Ok(self)
    }

    /// How the steps update the parameters.
    pub fn update(&self) -> Update {
        self.update
    }

    /// One update from `grads`, entirely on the device and capturable: advances the step
    /// count, or, when a gradient is not finite, leaves every parameter and moment as it was
    /// and counts a skipped step. Parameters without a gradient are left alone.
    pub fn step(&mut self, grads: &impl Gradients) -> Result<()> {
        self.scalars.follow_schedule()?;
        let found = with_gradients(&self.params, Param::graded, grads)?;
        if self.update == Update::Elementwise {
            return self.elementwise(&found);
        }
        let mut lists: [Vec<&Tensor>; 5] = Default::default();
        for (p, g) in found {
            lists[0].push(p.var.as_tensor());
            lists[1].push(g);
            lists[2].push(p.m.as_tensor());
            lists[3].push(p.v.as_tensor());
            lists[4].extend(p.copy.as_ref().map(Var::as_tensor));
        }
        let [params, grads, m, v, copies] = &lists;
        let (scalars, hyper) = (self.scalars.tensor(), &self.cfg.hyper());
        if copies.is_empty() {
            adamw_update(params, grads, m, v, scalars, hyper)
        } else {
            adamw_update_mixed(params, grads, m, v, copies, scalars, hyper)
        }
    }

    /// The reference step: elementwise candle ops per parameter.
    fn elementwise(&self, found: &[(&Param, &Tensor)]) -> Result<()> {
        let grads: Vec<&Tensor> = found.iter().map(|(_, g)| *g).collect();
        let finite = self.scalars.begin_step(&grads)?;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } = self.cfg;
        // 1 - beta^t, from the device step count (a skipped first step gives 0; its update
        // is discarded by the select below).
        let t = self.scalars.slot(OptimSlot::Applied)?;
        let correction = |beta: f64| (&t * beta.ln())?.exp()?.affine(-1.0, 1.0);
        let (c1, c2) = (correction(beta1)?, correction(beta2)?);
        let lr = self.scalars.slot(OptimSlot::LearningRate)?;
        let decay = (&lr * weight_decay)?.affine(-1.0, 1.0)?;
        for &(p, g) in found {
            let theta = p.var.as_tensor();
            let dtype = theta.dtype();
            let g = &g.to_dtype(dtype)?;
            let (c1, c2, lr, decay) = (
                c1.to_dtype(dtype)?,
                c2.to_dtype(dtype)?,
                lr.to_dtype(dtype)?,
                decay.to_dtype(dtype)?,
            );
            let (m, v) = (p.m.as_tensor(), p.v.as_tensor());
            let next_m = ((m * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = next_m.broadcast_div(&c1)?;
            let v_hat = next_v.broadcast_div(&c2)?;
            let adjusted = (m_hat / (v_hat.sqrt()? + eps)?)?;
            let next = (theta.broadcast_mul(&decay)? - adjusted.broadcast_mul(&lr)?)?;
            p.m.set(&finite.select(&next_m, m)?)?;
            p.v.set(&finite.select(&next_v, v)?)?;
            p.var.set(&finite.select(&next, theta)?)?;
            if let Some(copy) = &p.copy {
                copy.set(&p.var.as_tensor().to_dtype(copy.dtype())?)?;
            }
        }
        Ok(())
    }

    /// Sets the learning rate of the next steps: a write to a device tensor, between steps
    /// (never inside a recorded step: that would be an upload). Recorded steps follow it.
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

    /// Updates applied so far (AdamW's `t`; a host read, so between steps). Exact up to
    /// 2^24 steps (the count is an f32).
    pub fn applied_steps(&self) -> Result<u64> {
        self.scalars.applied_steps()
    }

    /// Steps skipped because a gradient was not finite (a host read, so between steps).
    pub fn skipped_steps(&self) -> Result<u64> {
        self.scalars.skipped_steps()
    }

    /// The optimizer's state for a checkpoint, by name: each parameter's moments
    /// (`adamw.m.{i}`, `adamw.v.{i}`, `i` its index in the order given) and the scalars
    /// (`adamw.scalars`: learning rate, applied and skipped steps). Save it beside the
    /// parameters (`candle_core::safetensors::save`); [`AdamW::load_state`] resumes from it.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut all = Vec::with_capacity(2 * self.params.len() + 1);
        for (i, p) in self.params.iter().enumerate() {
            all.push((format!("adamw.m.{i}"), p.m.as_tensor().clone()));
            all.push((format!("adamw.v.{i}"), p.v.as_tensor().clone()));
        }
        all.push(("adamw.scalars".to_owned(), self.scalars.tensor().clone()));
        all
    }

    /// Resumes from `state` (what [`AdamW::state`] gave, for parameters of the same shapes in
    /// the same order), written into this optimizer's own tensors in place, so steps recorded
    /// with it stay valid; the next step continues the saved run exactly. Between steps (a
    /// host write). Fails, changing nothing, when a tensor is missing or of another shape or
    /// dtype.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let mut writes = Vec::with_capacity(2 * self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            for (name, var) in [
                (format!("adamw.m.{i}"), &p.m),
                (format!("adamw.v.{i}"), &p.v),
            ] {
                writes.push((var, checked(state, &name, var.as_tensor())?));
            }
        }
        let scalars = checked(state, "adamw.scalars", self.scalars.tensor())?;
        for (var, t) in writes {
            var.set(t)?;
        }
        self.scalars.load(scalars)
    }

    /// The tensors whose gradients a step reads, in the order given: the parameters, or with
    /// mixed precision their working copies (what [`clip_grad_norm`](super::clip_grad_norm)
    /// takes, so clipping finds the same gradients the step will).
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(Param::graded)
    }

    /// Every tensor a step reads or writes in place, to pass as statics of the training step:
    /// the parameters, both moments, the working copies (mixed precision), and the scalars
    /// (learning rate, step counts, flag).
    pub fn statics(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = Vec::with_capacity(4 * self.params.len() + 1);
        for p in &self.params {
            all.extend([p.var.as_tensor(), p.m.as_tensor(), p.v.as_tensor()]);
            all.extend(p.copy.as_ref().map(Var::as_tensor));
        }
        all.push(self.scalars.tensor());
        all
    }
}
