//! Multi-tensor optimizer updates: AdamW and SGD with momentum applied to every parameter of a
//! model in a few launches, in place, their changing values (learning rate, step counts) read
//! from a small device tensor, so one CUDA-graph recording of a training step serves every
//! step.
//!
//! A step is [`adamw_update`] or [`sgd_update`] over lists of tensors (parameters, their
//! gradients, the rule's state) and the device scalars ([`optim_scalars`], slots in
//! [`OptimSlot`]). On CUDA it launches, for N tensors (those with elements), at most
//! `ceil(N / 160)` all-finite checks of the gradients, `ceil(N / 64)` updates and one
//! single-thread count update: three launches up to 64 tensors. The tensors' addresses and
//! sizes travel by value in the kernel parameters (as PyTorch's `multi_tensor_apply` does), so
//! a recording keeps the addresses it was recorded with, and every launch configuration comes
//! from the shapes only. A step whose gradients are not all finite changes no parameter and
//! no state, leaves the applied count and advances the skipped one. Every value is computed in
//! f32 and rounded once to the tensor's dtype (f32, bf16 or f16; the dtypes may differ from one
//! parameter to the next); nothing is summed, so the results do not depend on the launch shape.
//! The CPU implementation runs the same expressions in plain loops (equal, value for value, to
//! candle's elementwise f32 ops in the same order) and writes the tensors back in place; the
//! CUDA compiler may fuse a multiply and an add, a difference in the last bit.

#[cfg(feature = "cuda")]
mod cuda;
mod span;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use crate::{KernelError, check};
use span::Span;

const ADAMW: &str = "adamw_update";
const SGD: &str = "sgd_update";

/// How many values an optimizer's device scalars hold (their slots are [`OptimSlot`]s).
pub const OPTIM_SCALARS: usize = 4;

/// The slots of a multi-tensor optimizer's device scalars: a contiguous `[OPTIM_SCALARS]` f32
/// tensor made by [`optim_scalars`], which every step reads and advances in place. Pass it as
/// a static of a recorded step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimSlot {
    /// The learning rate, read by every step: write it between steps (for instance with
    /// `Tensor::slice_set`), never inside a recorded one.
    LearningRate = 0,
    /// Updates applied so far: AdamW's step count `t` before the step (exact up to 2^24).
    Applied = 1,
    /// Steps skipped because a gradient was not finite.
    Skipped = 2,
    /// Set to 1 inside a step whose gradients are not all finite, and back to 0 by the
    /// step's last launch (0 between steps).
    NotFinite = 3,
}

impl OptimSlot {
    /// The slot's index in the scalars tensor.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Fresh device scalars for a multi-tensor optimizer on `device`: learning rate `lr` (finite,
/// not negative), no step applied or skipped.
pub fn optim_scalars(lr: f64, device: &Device) -> Result<Tensor> {
    if !lr.is_finite() || lr < 0.0 {
        return Err(hyperparameter("optim_scalars", "lr", lr, "finite and >= 0"));
    }
    let mut values = [0f32; OPTIM_SCALARS];
    values[OptimSlot::LearningRate.index()] = lr as f32;
    Tensor::new(&values, device)
}

/// AdamW's hyperparameters (Loshchilov and Hutter), constants of every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    /// The first moment's decay, in `[0, 1)`.
    pub beta1: f64,
    /// The second moment's decay, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the second moment's square root (finite, >= 0).
    pub eps: f64,
    /// Decoupled weight decay (finite, >= 0).
    pub weight_decay: f64,
}

impl AdamWHyper {
    /// Checks the ranges: betas in `[0, 1)`, eps and weight decay finite and not negative
    /// ([`adamw_update`] checks them too).
    pub fn check(&self) -> Result<()> {
        in_range(ADAMW, "beta1", self.beta1, true)?;
        in_range(ADAMW, "beta2", self.beta2, true)?;
        in_range(ADAMW, "eps", self.eps, false)?;
        in_range(ADAMW, "weight_decay", self.weight_decay, false)
    }
}

/// SGD's hyperparameters (PyTorch's formulation, no dampening), constants of every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdHyper {
    /// Momentum in `[0, 1)`: 0 for plain SGD, with no buffers.
    pub momentum: f64,
    /// L2 weight decay added to the gradient (finite, >= 0).
    pub weight_decay: f64,
}

impl SgdHyper {
    /// Checks the ranges: momentum in `[0, 1)`, weight decay finite and not negative
    /// ([`sgd_update`] checks them too).
    pub fn check(&self) -> Result<()> {
        in_range(SGD, "momentum", self.momentum, true)?;
        in_range(SGD, "weight_decay", self.weight_decay, false)
    }
}

/// One AdamW step over every parameter, in place, on the device of `scalars`:
///
/// ```text
/// t = applied + 1;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
/// p = p (1 - lr wd) - lr (m / (1 - exp(t ln beta1))) / (sqrt(v / (1 - exp(t ln beta2))) + eps)
/// ```
///
/// with `lr` and `applied` read from `scalars` ([`optim_scalars`]), then `applied` advanced;
/// or, when a gradient holds an infinity or a NaN, nothing changed but `skipped` advanced.
/// `params`, `m` and `v` are contiguous (a start offset is fine) and do not share memory with
/// each other or with `scalars`; `grads[i]`, `m[i]` and `v[i]` have `params[i]`'s shape, dtype
/// (f32, bf16 or f16) and device; gradients may be strided views.
pub fn adamw_update(
    params: &[&Tensor],
    grads: &[&Tensor],
    m: &[&Tensor],
    v: &[&Tensor],
    scalars: &Tensor,
    hyper: &AdamWHyper,
) -> Result<()> {
    adamw((params, grads, m, v), None, scalars, hyper)
}

/// [`adamw_update`] for mixed precision: `params` (and their `m`, `v`) are f32 master
/// weights, `copies[i]` the 16-bit working copy (bf16 or f16, `params[i]`'s shape) that the
/// forward and backward passes read, and `grads[i]` the gradient of that copy, in its dtype.
/// The update reads each gradient in its dtype, updates the master in f32 and writes the copy
/// from the new master (rounded once) in the same pass, so a step needs no cast kernel either
/// way; a skipped step leaves the copies too. The copies must not overlap anything else.
pub fn adamw_update_mixed(
    params: &[&Tensor],
    grads: &[&Tensor],
    m: &[&Tensor],
    v: &[&Tensor],
    copies: &[&Tensor],
    scalars: &Tensor,
    hyper: &AdamWHyper,
) -> Result<()> {
    adamw((params, grads, m, v), Some(copies), scalars, hyper)
}

/// The AdamW step over `(params, grads, m, v)`, with or without copies.
type AdamWLists<'a> = (
    &'a [&'a Tensor],
    &'a [&'a Tensor],
    &'a [&'a Tensor],
    &'a [&'a Tensor],
);

fn adamw<'a>(
    (params, grads, m, v): AdamWLists<'a>,
    copies: Option<&'a [&'a Tensor]>,
    scalars: &Tensor,
    hyper: &AdamWHyper,
) -> Result<()> {
    let consts = AdamWConsts::new(hyper)?;
    let rule = Rule::AdamW {
        consts,
        m,
        v,
        copies,
    };
    run(ADAMW, rule, params, grads, scalars)
}

/// One SGD step over every parameter, in place, on the device of `scalars`:
///
/// ```text
/// g = g + wd p;  b = momentum b + g (with buffers);  p = p - lr b (or p - lr g without)
/// ```
///
/// with `lr` read from `scalars` ([`optim_scalars`]) and `applied` advanced; or, when a
/// gradient holds an infinity or a NaN, nothing changed but `skipped` advanced. `buffers` holds
/// one momentum buffer per parameter when the momentum is not 0 and is `None` when it is. The
/// tensors obey [`adamw_update`]'s rules, the buffers those of its moments.
pub fn sgd_update(
    params: &[&Tensor],
    grads: &[&Tensor],
    buffers: Option<&[&Tensor]>,
    scalars: &Tensor,
    hyper: &SgdHyper,
) -> Result<()> {
    let consts = SgdConsts::new(hyper)?;
    if buffers.is_some() != (hyper.momentum != 0.0) {
        return Err(KernelError::MomentumBuffers {
            momentum: hyper.momentum,
            buffers: if buffers.is_some() {
                "buffers"
            } else {
                "no buffers"
            },
        }
        .into());
    }
    run(SGD, Rule::Sgd { consts, buffers }, params, grads, scalars)
}

fn hyperparameter(
    op: &'static str,
    name: &'static str,
    value: f64,
    expected: &'static str,
) -> candle_core::Error {
    KernelError::Hyperparameter {
        op,
        name,
        value,
        expected,
    }
    .into()
}

/// Checks that `value` is in `[0, 1)` (`below_one`) or finite and not negative.
fn in_range(op: &'static str, name: &'static str, value: f64, below_one: bool) -> Result<()> {
    let (ok, expected) = if below_one {
        ((0.0..1.0).contains(&value), "in [0, 1)")
    } else {
        (value.is_finite() && value >= 0.0, "finite and >= 0")
    };
    if ok {
        Ok(())
    } else {
        Err(hyperparameter(op, name, value, expected))
    }
}

/// AdamW's constants as the update computes with them (f32, each rounded from f64 once),
/// passed by value to the CUDA kernel (`GraftAdamW`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct AdamWConsts {
    beta1: f32,
    /// `1 - beta1`.
    rest1: f32,
    beta2: f32,
    /// `1 - beta2`.
    rest2: f32,
    eps: f32,
    weight_decay: f32,
    ln_beta1: f32,
    ln_beta2: f32,
}

impl AdamWConsts {
    fn new(h: &AdamWHyper) -> Result<AdamWConsts> {
        h.check()?;
        Ok(AdamWConsts {
            beta1: h.beta1 as f32,
            rest1: (1.0 - h.beta1) as f32,
            beta2: h.beta2 as f32,
            rest2: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            weight_decay: h.weight_decay as f32,
            ln_beta1: h.beta1.ln() as f32,
            ln_beta2: h.beta2.ln() as f32,
        })
    }

    /// One element: `(p, m, v)` after the step with `lr`, the bias corrections `c1`, `c2` and
    /// `decay = 1 - lr wd` (the kernel's expressions, in its order).
    fn update(&self, [p, g, m, v]: [f32; 4], lr: f32, c1: f32, c2: f32, decay: f32) -> [f32; 3] {
        let m = m * self.beta1 + g * self.rest1;
        let v = v * self.beta2 + g * g * self.rest2;
        let adjusted = (m / c1) / ((v / c2).sqrt() + self.eps);
        [p * decay - adjusted * lr, m, v]
    }
}

/// SGD's constants as the update computes with them, passed by value to the CUDA kernel
/// (`GraftSgd`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct SgdConsts {
    momentum: f32,
    weight_decay: f32,
    /// 1 with momentum buffers (momentum not 0).
    buffers: u32,
    /// 1 when the weight decay is not 0.
    decays: u32,
}

impl SgdConsts {
    fn new(h: &SgdHyper) -> Result<SgdConsts> {
        h.check()?;
        Ok(SgdConsts {
            momentum: h.momentum as f32,
            weight_decay: h.weight_decay as f32,
            buffers: u32::from(h.momentum != 0.0),
            decays: u32::from(h.weight_decay != 0.0),
        })
    }

    /// One element: `(p, b)` after the step with `lr` (`b` unused without buffers).
    fn update(&self, p: f32, g: f32, b: f32, lr: f32) -> [f32; 2] {
        let g = if self.decays != 0 {
            g + p * self.weight_decay
        } else {
            g
        };
        let direction = if self.buffers != 0 {
            b * self.momentum + g
        } else {
            g
        };
        [p - direction * lr, direction]
    }
}

/// The update rule of a step, with its state lists (one entry per parameter).
#[derive(Clone, Copy, Debug)]
enum Rule<'a> {
    AdamW {
        consts: AdamWConsts,
        m: &'a [&'a Tensor],
        v: &'a [&'a Tensor],
        /// Mixed precision: each f32 master's 16-bit working copy, written from it.
        copies: Option<&'a [&'a Tensor]>,
    },
    Sgd {
        consts: SgdConsts,
        /// With momentum only.
        buffers: Option<&'a [&'a Tensor]>,
    },
}

impl<'a> Rule<'a> {
    /// The working copies, with mixed precision.
    fn copies(&self) -> Option<&'a [&'a Tensor]> {
        match *self {
            Rule::AdamW { copies, .. } => copies,
            Rule::Sgd { .. } => None,
        }
    }

    /// The state lists, by name.
    fn states(&self) -> Vec<(&'static str, &'a [&'a Tensor])> {
        match *self {
            Rule::AdamW { m, v, .. } => vec![("m", m), ("v", v)],
            Rule::Sgd { buffers, .. } => buffers.map(|b| ("buffers", b)).into_iter().collect(),
        }
    }
}

/// One multi-tensor step, its lists checked: the in-place op on the scalars, which reaches
/// every other tensor through the lists it holds (the borrowed tensors outlive the call).
struct Step<'a> {
    op: &'static str,
    rule: Rule<'a>,
    params: &'a [&'a Tensor],
    /// The gradients, contiguous.
    grads: Vec<Tensor>,
}

fn run<'a>(
    op: &'static str,
    rule: Rule<'a>,
    params: &'a [&'a Tensor],
    grads: &[&Tensor],
    scalars: &Tensor,
) -> Result<()> {
    let states = rule.states();
    let copies = rule.copies();
    if scalars.dtype() != DType::F32 {
        return Err(KernelError::ExpectedDType {
            op,
            input: "scalars",
            got: scalars.dtype(),
            expected: DType::F32,
        }
        .into());
    }
    if scalars.dims() != [OPTIM_SCALARS] {
        return Err(check::shape(op, "scalars", scalars, "[4] (optim_scalars)"));
    }
    check::contiguous(op, "scalars", scalars)?;
    let lists = std::iter::once(("grads", grads.len()))
        .chain(copies.map(|c| ("copies", c.len())))
        .chain(states.iter().map(|(n, l)| (*n, l.len())));
    for (input, len) in lists {
        if len != params.len() {
            return Err(KernelError::ListLength {
                op,
                input,
                params: params.len(),
                got: len,
            }
            .into());
        }
    }
    let mut spans = vec![Span::of(scalars, "scalars", 0, true)];
    for (index, p) in params.iter().enumerate() {
        check::float(op, "params", p)?;
        if !p.device().same_device(scalars.device()) {
            return Err(KernelError::Device {
                op,
                input: "params",
            }
            .into());
        }
        check::contiguous(op, "params", p)?;
        spans.push(Span::of(p, "params", index, true));
        if let Some(copies) = copies {
            let c = copies[index];
            if p.dtype() != DType::F32 || !matches!(c.dtype(), DType::BF16 | DType::F16) {
                return Err(KernelError::MixedDTypes {
                    op,
                    index,
                    master: p.dtype(),
                    copy: c.dtype(),
                }
                .into());
            }
            if !c.device().same_device(p.device()) {
                return Err(KernelError::Device {
                    op,
                    input: "copies",
                }
                .into());
            }
            entry(op, "copies", index, c, p, ("itself", c))?;
            check::contiguous(op, "copies", c)?;
            spans.push(Span::of(c, "copies", index, true));
        }
        for (input, list) in &states {
            entry(op, input, index, list[index], p, ("its parameter", p))?;
            check::contiguous(op, input, list[index])?;
            spans.push(Span::of(list[index], input, index, true));
        }
    }
    let grads = grads
        .iter()
        .zip(params)
        .enumerate()
        .map(|(index, (g, p))| {
            let like = copies.map_or(("its parameter", *p), |c| ("its copy", c[index]));
            entry(op, "grads", index, g, p, like)?;
            let g = g.contiguous()?;
            spans.push(Span::of(&g, "grads", index, false));
            Ok(g)
        })
        .collect::<Result<Vec<_>>>()?;
    Span::check(op, spans)?;
    scalars.inplace_op1(&Step {
        op,
        rule,
        params,
        grads,
    })
}

/// Checks that `t`, entry `index` of list `input`, has the dtype and device of `like` (its
/// parameter, or with mixed precision its copy, by name) and its parameter's shape.
fn entry(
    op: &'static str,
    input: &'static str,
    index: usize,
    t: &Tensor,
    p: &Tensor,
    (name, like): (&'static str, &Tensor),
) -> Result<()> {
    check::like(op, input, t, name, like)?;
    if t.dims() != p.dims() {
        return Err(KernelError::EntryShape {
            op,
            input,
            index,
            got: t.dims().to_vec(),
            expected: p.dims().to_vec(),
        }
        .into());
    }
    Ok(())
}

impl InplaceOp1 for Step<'_> {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let CpuStorage::F32(all) = storage else {
            return Err(KernelError::ExpectedDType {
                op: self.op,
                input: "scalars",
                got: storage.dtype(),
                expected: DType::F32,
            }
            .into());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(KernelError::NotContiguous {
                op: self.op,
                input: "scalars",
            }
            .into());
        };
        let scalars =
            <&mut [f32; OPTIM_SCALARS]>::try_from(&mut all[start..end]).map_err(|_| {
                KernelError::Shape {
                    op: self.op,
                    input: "scalars",
                    got: layout.dims().to_vec(),
                    expected: "[4] (optim_scalars)",
                }
            })?;
        self.cpu(scalars)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        cuda::step(self, storage, layout)
    }
}

/// A CPU tensor's elements as f32.
fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// Writes `values` into the contiguous CPU tensor `t` in place, rounded to its dtype.
fn write(t: &Tensor, values: Vec<f32>) -> Result<()> {
    let n = values.len();
    let src = Tensor::from_vec(values, n, &Device::Cpu)?.to_dtype(t.dtype())?;
    t.flatten_all()?.slice_set(&src, 0, 0)
}

impl Step<'_> {
    /// The step on the CPU: the kernels' arithmetic in plain loops, written back in place.
    fn cpu(&self, s: &mut [f32; OPTIM_SCALARS]) -> Result<()> {
        let mut finite = true;
        for g in &self.grads {
            finite &= f32s(g)?.iter().all(|x| x.is_finite());
        }
        if !finite {
            s[OptimSlot::Skipped.index()] += 1.0;
            return Ok(());
        }
        let lr = s[OptimSlot::LearningRate.index()];
        let t = s[OptimSlot::Applied.index()] + 1.0;
        for (i, (p, g)) in self.params.iter().zip(&self.grads).enumerate() {
            if p.elem_count() == 0 {
                continue;
            }
            let (mut pv, gv) = (f32s(p)?, f32s(g)?);
            match self.rule {
                Rule::AdamW {
                    consts: c,
                    m,
                    v,
                    copies,
                } => {
                    let (mut mv, mut vv) = (f32s(m[i])?, f32s(v[i])?);
                    let c1 = 1.0 - (t * c.ln_beta1).exp();
                    let c2 = 1.0 - (t * c.ln_beta2).exp();
                    let decay = 1.0 - lr * c.weight_decay;
                    for j in 0..pv.len() {
                        [pv[j], mv[j], vv[j]] =
                            c.update([pv[j], gv[j], mv[j], vv[j]], lr, c1, c2, decay);
                    }
                    write(m[i], mv)?;
                    write(v[i], vv)?;
                    if let Some(copies) = copies {
                        write(copies[i], pv.clone())?;
                    }
                }
                Rule::Sgd {
                    consts: c,
                    buffers: Some(b),
                } => {
                    let mut bv = f32s(b[i])?;
                    for j in 0..pv.len() {
                        [pv[j], bv[j]] = c.update(pv[j], gv[j], bv[j], lr);
                    }
                    write(b[i], bv)?;
                }
                Rule::Sgd {
                    consts: c,
                    buffers: None,
                } => {
                    for j in 0..pv.len() {
                        pv[j] = c.update(pv[j], gv[j], 0.0, lr)[0];
                    }
                }
            }
            write(p, pv)?;
        }
        s[OptimSlot::Applied.index()] = t;
        Ok(())
    }
}
