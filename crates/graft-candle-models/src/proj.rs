//! A projection of a decoder: a dense weight (a candle-nn `Linear`, as candle's models load
//! it) or a block-quantized one, with candle's differentiable forward and a decode step's
//! matrix-vector kernel.

use candle_core::quantized::QMatMul;
use candle_core::{Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use graft_candle_kernels::linear;

/// A projection: dense (a candle-nn `Linear`, as candle's models load it) or quantized.
#[derive(Debug)]
pub(crate) enum Proj {
    Dense(Linear),
    Quant(QMatMul),
}

impl Proj {
    /// candle's own projection (differentiable: what training and the unfused prefill run).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Dense(l) => l.forward(x),
            Proj::Quant(q) => q.forward(x),
        }
    }

    /// A decode step's projection: graft-candle-kernels' `linear` for a dense weight (one
    /// matrix-vector launch with the bias, for a few rows), candle's for a quantized one.
    pub(crate) fn decode(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Proj::Dense(l) => linear(x, l.weight(), l.bias()),
            Proj::Quant(q) => q.forward(x),
        }
    }

    pub(crate) fn dense(&self) -> Option<&Linear> {
        match self {
            Proj::Dense(l) => Some(l),
            Proj::Quant(_) => None,
        }
    }

    /// The tensors it reads (none for a block-quantized weight, which is not a `Tensor`).
    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Proj::Dense(l) => std::iter::once(l.weight()).chain(l.bias()).collect(),
            Proj::Quant(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => vec![t],
            Proj::Quant(QMatMul::QTensor(_)) => Vec::new(),
        }
    }
}

/// A dense projection of `vb`'s `weight` (`[out, inp]`) and, with `bias`, its `bias`.
pub(crate) fn dense(vb: &VarBuilder, out: usize, inp: usize, bias: bool) -> Result<Proj> {
    let w = vb.get((out, inp), "weight")?;
    let b = if bias {
        Some(vb.get(out, "bias")?)
    } else {
        None
    };
    Ok(Proj::Dense(Linear::new(w, b)))
}
