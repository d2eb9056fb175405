//! A block's MLP: one SiLU-gated MLP, or a mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE)
//! routed on the device: the router's logits, each token's top-k experts and weights in one
//! launch (graft-candle-kernels' `route`), and the chosen experts summed by weight in two or
//! three (`Experts::forward`, which finds the experts' weights through a device table of their
//! addresses). No routing decision reaches the host, so a recorded step replays whatever the
//! tokens choose. A shared expert (Qwen2-MoE) runs on the decoder's side stream while the
//! routed experts run on the device's (a fork and join in the recorded graph).

use candle_core::{Result, Tensor};
use candle_nn::{Activation, Linear, VarBuilder};
use graft_candle_kernels::{
    Experts, SharedExpert, SideStream, linear, linear_swiglu, route, swiglu,
};

use super::proj::{Proj, dense};
use super::spec::{DecoderSpec, MoeNames, MoeSpec};

/// A block's MLP.
#[derive(Debug)]
pub(crate) enum Mlp {
    /// `down · (act(gate · x) * (up · x))`.
    Gated { gate: Proj, up: Proj, down: Proj },
    /// A mixture of SiLU-gated experts.
    Experts {
        /// `[experts, hidden]`: the router's logits.
        router: Linear,
        experts: Experts,
        top_k: usize,
        /// Divide the chosen weights by their sum.
        normalize: bool,
        /// Qwen2-MoE's shared expert, run on `side` beside the routed ones.
        shared: Option<SharedExpert>,
        side: SideStream,
    },
}

impl Mlp {
    /// Loads block `layer`'s MLP from `vb` (the block's prefix): the experts where `spec`
    /// puts them, the gated MLP `mlp.{gate,up,down}_proj` elsewhere (split by `split`, the
    /// tensor-parallel narrowing of a projection along its rows (0) or columns (1)).
    /// A shared expert runs on `side` (the decoder's one side stream).
    pub(crate) fn load(
        spec: &DecoderSpec,
        layer: usize,
        vb: &VarBuilder,
        split: impl Fn(Proj, usize) -> Result<Proj>,
        side: &SideStream,
    ) -> Result<Mlp> {
        let d = spec.hidden;
        let Some(moe) = spec.moe.as_ref().filter(|m| m.at(layer)) else {
            let mlp = vb.pp("mlp");
            let f = spec.intermediate;
            return Ok(Mlp::Gated {
                gate: split(dense(&mlp.pp("gate_proj"), f, d, false)?, 0)?,
                up: split(dense(&mlp.pp("up_proj"), f, d, false)?, 0)?,
                down: split(dense(&mlp.pp("down_proj"), d, f, false)?, 1)?,
            });
        };
        if spec.act != Activation::Silu {
            candle_core::bail!(
                "{:?} config: experts with hidden_act {:?}; only silu experts are supported",
                spec.arch,
                spec.act
            );
        }
        let block = vb.pp(moe.names.block());
        let f = moe.intermediate;
        let [gate_name, up_name, down_name] = moe.names.projections();
        let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
        for e in 0..moe.experts {
            let expert = block.pp(format!("experts.{e}"));
            gate.push(expert.get((f, d), &format!("{gate_name}.weight"))?);
            up.push(expert.get((f, d), &format!("{up_name}.weight"))?);
            down.push(expert.get((d, f), &format!("{down_name}.weight"))?);
        }
        let shared = match moe.shared {
            Some(fs) => {
                let p = block.pp("shared_expert");
                Some(SharedExpert::new(
                    p.get((fs, d), "gate_proj.weight")?,
                    p.get((fs, d), "up_proj.weight")?,
                    p.get((d, fs), "down_proj.weight")?,
                    block.get((1, d), "shared_expert_gate.weight")?,
                )?)
            }
            None => None,
        };
        Ok(Mlp::Experts {
            router: Linear::new(block.get((moe.experts, d), "gate.weight")?, None),
            experts: Experts::new(gate, up, down)?,
            top_k: moe.top_k,
            normalize: moe.normalize,
            shared,
            side: side.clone(),
        })
    }

    /// The MLP of a decode step or prefill chunk's normed `h` (`[n, 1, hidden]`): a gated
    /// MLP's gate, up and SwiGLU in one launch (a SiLU gate without biases) and its down
    /// projection; the experts' router, routing, and the experts. A gated MLP's output is
    /// this rank's partial sum on a tensor-parallel rank.
    pub(crate) fn decode(&self, h: &Tensor, act: Activation) -> Result<Tensor> {
        match self {
            Mlp::Gated { gate, up, down } => {
                let gated = match (act, gate.dense(), up.dense()) {
                    (Activation::Silu, Some(g), Some(u))
                        if g.bias().is_none() && u.bias().is_none() =>
                    {
                        linear_swiglu(h, g.weight(), u.weight())?
                    }
                    (act, ..) => {
                        let (gate, up) = (gate.decode(h)?, up.decode(h)?);
                        match act {
                            Activation::Silu => swiglu(&gate, &up)?,
                            act => (gate.apply(&act)? * up)?,
                        }
                    }
                };
                down.decode(&gated)
            }
            Mlp::Experts {
                router,
                experts,
                top_k,
                normalize,
                shared,
                side,
            } => {
                let routed = || {
                    let tokens = h.flatten_to(h.rank().saturating_sub(2))?;
                    let logits = linear(&tokens, router.weight(), None)?;
                    experts.forward(h, &route(&logits, *top_k, *normalize)?)
                };
                match shared {
                    None => routed(),
                    Some(shared) => {
                        let (shared, routed) = shared.beside(h, side, routed)?;
                        routed + shared
                    }
                }
            }
        }
    }

    /// The differentiable MLP (whole sequences: training's forward). Refused for experts,
    /// whose routing kernels have no backward.
    pub(crate) fn forward(&self, h: &Tensor, act: Activation) -> Result<Tensor> {
        match self {
            Mlp::Gated { gate, up, down } => {
                down.forward(&(gate.forward(h)?.apply(&act)? * up.forward(h)?)?)
            }
            Mlp::Experts { .. } => candle_core::bail!(
                "whole-sequence logits (training) of a mixture-of-experts decoder are not supported: its routing runs on kernels without a backward; decode and prefill it instead"
            ),
        }
    }

    /// Puts a shared expert on `side`.
    pub(crate) fn set_side_stream(&mut self, to: &SideStream) {
        if let Mlp::Experts { side, .. } = self {
            *side = to.clone();
        }
    }

    /// The tensors it reads in place (a step's statics).
    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Mlp::Gated { gate, up, down } => [gate, up, down]
                .into_iter()
                .flat_map(Proj::tensors)
                .collect(),
            Mlp::Experts {
                router,
                experts,
                shared,
                ..
            } => std::iter::once(router.weight())
                .chain(experts.tensors())
                .chain(shared.iter().flat_map(SharedExpert::tensors))
                .collect(),
        }
    }
}

impl MoeSpec {
    /// Whether layer `layer` has experts.
    pub(crate) fn at(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.every.max(1))
    }
}

impl MoeNames {
    /// The prefix of a block's experts and router (`{block}.gate`, `{block}.experts.{e}`).
    pub(crate) fn block(self) -> &'static str {
        match self {
            MoeNames::Mixtral => "block_sparse_moe",
            MoeNames::Qwen => "mlp",
        }
    }

    /// An expert's gate, up and down projection names.
    pub(crate) fn projections(self) -> [&'static str; 3] {
        match self {
            MoeNames::Mixtral => ["w1", "w3", "w2"],
            MoeNames::Qwen => ["gate_proj", "up_proj", "down_proj"],
        }
    }
}
