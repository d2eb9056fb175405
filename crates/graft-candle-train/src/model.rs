//! A trainable variant of graft-candle-models' decoder: the same architecture, loaded by the
//! same port from the same checkpoint names, with every weight a candle `Var` of a `VarMap`.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use graft_candle_models::llama::{self, Config};
use graft_candle_models::{Decoder, Dropout, SequenceKernels, checkpoint};

/// A Llama port whose weights are trainable: its forward pass runs whole sequences
/// ([`Decoder::sequence_logits`]), and [`Trainable::decoder`] decodes with the same weights.
#[derive(Debug)]
pub struct Trainable {
    decoder: Decoder,
    /// The weights, in the order of the checkpoint's tensors.
    vars: Vec<Var>,
    /// `[max_positions, max_positions]`: 0 on and below the diagonal, -inf above.
    mask: Tensor,
    /// The forward pass's (and so the backward's) kernels.
    kernels: SequenceKernels,
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
        })
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

    /// The decoder, whose weights are the trainable ones: decode with what was learned.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// The parameters, in a fixed order (for an optimizer).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The weights by checkpoint name (what [`Trainable::from_weights`] takes): save them
    /// with `candle_core::safetensors::save` to resume or to serve the trained model.
    pub fn weights(&self) -> HashMap<String, Tensor> {
        self.decoder
            .spec()
            .checkpoint_tensors()
            .into_iter()
            .map(|(name, _)| name)
            .zip(self.vars.iter().map(|v| v.as_tensor().clone()))
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
