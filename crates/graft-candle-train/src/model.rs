//! A trainable variant of graft-candle-models' decoder: the same architecture, loaded by the
//! same port from the same checkpoint names, with every weight a candle `Var` of a `VarMap`;
//! its gradients from the explicit backward program or from candle's autograd.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, TensorId, Var};
use candle_nn::{VarBuilder, VarMap};
use graft_candle_models::llama::{self, Config};
use graft_candle_models::{Decoder, Dropout, SequenceKernels, checkpoint};

use crate::optim::Gradients;

/// How [`Trainable::gradients`] computes a step's gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backward {
    /// graft-candle-models' explicit program (`Decoder::sequence_gradients`: each gradient
    /// written once by the kernel that computes it) where it takes the step; candle's autograd
    /// where it does not ([`Trainable::backward_fallbacks`] says why). The default.
    #[default]
    Explicit,
    /// candle's autograd over the forward pass: the reference.
    Autograd,
}

/// A step's loss and every parameter's gradient ([`Trainable::gradients`]); an optimizer
/// reads them through [`Gradients`].
#[derive(Debug)]
pub struct StepGradients {
    loss: Tensor,
    grads: Grads,
}

#[derive(Debug)]
enum Grads {
    Explicit(HashMap<TensorId, Tensor>),
    Autograd(GradStore),
}

impl StepGradients {
    /// The step's mean cross-entropy, `[1]` f32.
    pub fn loss(&self) -> &Tensor {
        &self.loss
    }
}

impl Gradients for StepGradients {
    fn gradient(&self, param: &Tensor) -> Option<&Tensor> {
        match &self.grads {
            Grads::Explicit(by_id) => by_id.get(&param.id()),
            Grads::Autograd(store) => store.get(param),
        }
    }
}

/// A Llama port whose weights are trainable: its forward pass runs whole sequences
/// ([`Decoder::sequence_logits`]), and [`Trainable::decoder`] decodes with the same weights.
#[derive(Debug)]
pub struct Trainable {
    decoder: Decoder,
    /// The weights the passes read, in the order of the checkpoint's tensors (with mixed
    /// precision, the 16-bit working copies).
    vars: Vec<Var>,
    /// Mixed precision: the f32 master of each of `vars`, in their order; empty otherwise.
    masters: Vec<Var>,
    /// `[max_positions, max_positions]`: 0 on and below the diagonal, -inf above.
    mask: Tensor,
    /// The forward pass's (and so the backward's) kernels.
    kernels: SequenceKernels,
    /// How [`Trainable::gradients`] computes gradients.
    backward: Backward,
}

impl Trainable {
    /// The Llama `cfg` describes with [`checkpoint::random_weights`] from `seed` (the same
    /// weights on every device), in `dtype`, on `device`. `cfg.max_position_embeddings` is the
    /// longest sequence a step may train on.
    pub fn random(cfg: &Config, seed: u64, dtype: DType, device: &Device) -> Result<Trainable> {
        let weights = checkpoint::random_weights(&llama::spec(cfg), seed, dtype, device)?;
        Trainable::from_weights(cfg, &weights)
    }

    /// The Llama `cfg` describes, starting from `weights` (a checkpoint's tensors by name, as
    /// `candle_core::safetensors::load` returns them; every tensor the port loads must be
    /// there), in their dtype and on their device.
    pub fn from_weights(cfg: &Config, weights: &HashMap<String, Tensor>) -> Result<Trainable> {
        let spec = llama::spec(cfg);
        let varmap = VarMap::new();
        let mut vars = Vec::new();
        let (mut dtype, mut device) = (DType::F32, Device::Cpu);
        for (name, _) in spec.checkpoint_tensors() {
            let Some(t) = weights.get(&name) else {
                candle_core::bail!("the weights have no {name}: pass a complete checkpoint");
            };
            (dtype, device) = (t.dtype(), t.device().clone());
            let var = Var::from_tensor(t)?;
            vars.push(var.clone());
            varmap
                .data()
                .lock()
                .map_err(|_| candle_core::Error::Msg("the var map's lock is poisoned".into()))?
                .insert(name, var);
        }
        let decoder = llama::load(VarBuilder::from_varmap(&varmap, dtype, &device), cfg)?;
        let n = cfg.max_position_embeddings;
        let mask: Vec<f32> = (0..n * n)
            .map(|i| {
                if i % n > i / n {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, n), &device)?.to_dtype(dtype)?;
        Ok(Trainable {
            decoder,
            vars,
            mask,
            kernels: SequenceKernels::Fused,
            backward: Backward::Explicit,
            masters: Vec::new(),
        })
    }

    /// [`Trainable::random`] in mixed precision, as PyTorch's autocast trains: f32 master
    /// weights ([`Trainable::masters`]) and their working copies in `compute` (bf16 or f16,
    /// [`Trainable::vars`]), which every forward and backward pass reads, so the matmuls and
    /// attention run in `compute` and the gradients come in `compute`. Train it with
    /// `AdamW::new(model.masters().to_vec(), cfg)?.mixed(model.vars().to_vec())?`, which
    /// updates the masters in f32 and rewrites the copies from them in the same pass.
    pub fn random_mixed(
        cfg: &Config,
        seed: u64,
        compute: DType,
        device: &Device,
    ) -> Result<Trainable> {
        let weights = checkpoint::random_weights(&llama::spec(cfg), seed, DType::F32, device)?;
        Trainable::from_weights_mixed(cfg, &weights, compute)
    }

    /// [`Trainable::from_weights`] in mixed precision ([`Trainable::random_mixed`]): the
    /// masters are `weights` widened to f32, the copies the masters rounded to `compute`.
    pub fn from_weights_mixed(
        cfg: &Config,
        weights: &HashMap<String, Tensor>,
        compute: DType,
    ) -> Result<Trainable> {
        if !matches!(compute, DType::BF16 | DType::F16) {
            candle_core::bail!(
                "mixed precision computes in bf16 or f16, not {compute:?}: for one dtype use Trainable::from_weights"
            );
        }
        let mut masters = HashMap::with_capacity(weights.len());
        let mut copies = HashMap::with_capacity(weights.len());
        for (name, t) in weights {
            let master = t.to_dtype(DType::F32)?;
            copies.insert(name.clone(), master.to_dtype(compute)?);
            masters.insert(name.clone(), master);
        }
        let mut model = Trainable::from_weights(cfg, &copies)?;
        model.masters = model
            .decoder
            .spec()
            .checkpoint_tensors()
            .into_iter()
            .map(|(name, _)| match masters.get(&name) {
                Some(t) => Var::from_tensor(t),
                None => {
                    candle_core::bail!("the weights have no {name}: pass a complete checkpoint")
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(model)
    }

    /// Chooses the kernels of the forward and backward passes: [`SequenceKernels::Fused`]
    /// (the default: graft-candle-kernels' fused ops, cross-entropy included) or
    /// [`SequenceKernels::Unfused`] (candle's elementwise ops, the reference). The parts the
    /// fused ops do not cover for this model run unfused:
    /// [`Decoder::fused_sequence_fallbacks`] says which and why.
    pub fn set_kernels(&mut self, kernels: SequenceKernels) {
        self.kernels = kernels;
    }

    /// The kernels the passes run.
    pub fn kernels(&self) -> SequenceKernels {
        self.kernels
    }

    /// Chooses how [`Trainable::gradients`] computes gradients ([`Backward::Explicit`] by
    /// default).
    pub fn set_backward(&mut self, backward: Backward) {
        self.backward = backward;
    }

    /// Why [`Trainable::gradients`] runs candle's autograd for a step without dropout (empty
    /// when it runs the explicit program): the backward chosen, the kernels, or what the
    /// program does not know about this model. A step with dropout always runs the autograd.
    pub fn backward_fallbacks(&self) -> Vec<String> {
        match (self.backward, self.kernels) {
            (Backward::Autograd, _) => vec!["Backward::Autograd was chosen".into()],
            (_, SequenceKernels::Unfused) => {
                vec!["the unfused kernels were chosen (they have no explicit program)".into()]
            }
            (Backward::Explicit, SequenceKernels::Fused) => {
                self.decoder.sequence_gradients_unsupported()
            }
        }
    }

    /// The mean cross-entropy of predicting `targets` (`[batch, seq]` u32) from `tokens` and
    /// the gradient of every parameter: by the explicit program where
    /// [`Trainable::backward_fallbacks`] is empty and there is no `dropout` (each gradient
    /// written once, no zeroed buffer and add per gradient), by candle's autograd over
    /// [`Trainable::loss`] otherwise. Both run the same forward kernels; their gradients
    /// differ only in the order the rounding of sums happens.
    pub fn gradients(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout<'_>>,
    ) -> Result<StepGradients> {
        if dropout.is_none() && self.backward_fallbacks().is_empty() {
            let g = self.decoder.sequence_gradients(tokens, targets)?;
            let by_id = g.grads.into_iter().map(|(w, d)| (w.id(), d)).collect();
            return Ok(StepGradients {
                loss: g.loss,
                grads: Grads::Explicit(by_id),
            });
        }
        let loss = self.loss(tokens, targets, dropout)?;
        let store = loss.backward()?;
        Ok(StepGradients {
            loss,
            grads: Grads::Autograd(store),
        })
    }

    /// The decoder, whose weights are the trainable ones: decode with what was learned.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The weights the passes read, in a fixed order (for an optimizer; with mixed precision
    /// the 16-bit working copies, whose gradients [`Trainable::gradients`] gives).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// With mixed precision, the f32 master of each of [`Trainable::vars`], in their order
    /// (empty otherwise).
    pub fn masters(&self) -> &[Var] {
        &self.masters
    }

    /// The weights by checkpoint name (what [`Trainable::from_weights`] takes; with mixed
    /// precision the f32 masters, which [`Trainable::from_weights_mixed`] takes): save them
    /// with `candle_core::safetensors::save` to resume or to serve the trained model.
    pub fn weights(&self) -> HashMap<String, Tensor> {
        let held = if self.masters.is_empty() {
            &self.vars
        } else {
            &self.masters
        };
        self.decoder
            .spec()
            .checkpoint_tensors()
            .into_iter()
            .map(|(name, _)| name)
            .zip(held.iter().map(|v| v.as_tensor().clone()))
            .collect()
    }

    /// The constant tensors a step reads (rotary tables and mask), to pass as statics along
    /// with the optimizer's.
    pub fn constants(&self) -> [&Tensor; 3] {
        let [cos, sin] = self.decoder.rope_tables();
        [cos, sin, &self.mask]
    }

    /// Logits `[batch, seq, vocab]` of `tokens` (`[batch, seq]` u32). `dropout`, when given,
    /// is applied to the output of every attention and MLP before the residual add (for
    /// example `|x| rng.dropout(x, 0.1)` with a `graft_candle::random::DeviceRng`).
    pub fn forward(&self, tokens: &Tensor, dropout: Option<&Dropout<'_>>) -> Result<Tensor> {
        self.decoder
            .sequence_logits_with(tokens, &self.mask, dropout, self.kernels)
    }

    /// The mean cross-entropy of predicting `targets` (`[batch, seq]` u32), as a `[1]` f32
    /// tensor.
    pub fn loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        dropout: Option<&Dropout<'_>>,
    ) -> Result<Tensor> {
        let logits = self.forward(tokens, dropout)?;
        if self.kernels == SequenceKernels::Fused {
            return graft_candle_kernels::cross_entropy(&logits, targets);
        }
        let (b, s, vocab) = logits.dims3()?;
        let logits = logits.reshape((b * s, vocab))?.to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, &targets.reshape(b * s)?)?.reshape(1)
    }
}
