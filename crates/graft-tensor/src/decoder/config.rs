//! The decoder's sizes ([`DecoderConfig`]) and its default buckets.

use std::fmt;

use graft_core::Buckets;

use crate::error::{Result, TensorError};

/// The buckets [`Decoder::register`] uses: 1, 2, 4, 8, 16, 32.
pub fn default_buckets() -> Buckets {
    Buckets::powers_of_two(32)
}

/// Sizes of the decoder.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct DecoderConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Model (residual stream) width.
    pub d_model: usize,
    /// Attention heads (`d_model` must be a multiple).
    pub heads: usize,
    /// Hidden width of the MLP.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Context length: positions of the KV cache, and steps a state can take.
    pub ctx: usize,
    /// Layer-norm epsilon.
    pub eps: f32,
}

impl DecoderConfig {
    /// The benchmark model: 4 layers, d=512, 8 heads, ffn 2048, vocab 8192, context 512.
    pub fn bench() -> DecoderConfig {
        DecoderConfig {
            layers: 4,
            d_model: 512,
            heads: 8,
            ffn: 2048,
            vocab: 8192,
            ctx: 512,
            eps: 1e-5,
        }
    }

    /// The tensor-parallel benchmark model, large enough that splitting it over two GPUs
    /// pays: 8 layers, d=4096, 32 heads, ffn 16384, vocab 8192, context 128 (1.7B
    /// parameters, 6.7 GB in fp32).
    pub fn tensor_parallel() -> DecoderConfig {
        DecoderConfig {
            layers: 8,
            d_model: 4096,
            heads: 32,
            ffn: 16384,
            vocab: 8192,
            ctx: 128,
            eps: 1e-5,
        }
    }

    /// A small model for the simulator: 2 layers, d=64, 4 heads, ffn 256, vocab 512, context 64.
    pub fn tiny() -> DecoderConfig {
        DecoderConfig {
            layers: 2,
            d_model: 64,
            heads: 4,
            ffn: 256,
            vocab: 512,
            ctx: 64,
            eps: 1e-5,
        }
    }

    /// Columns per head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads.max(1)
    }

    /// Parameters (f32s), alignment padding excluded.
    pub fn parameters(&self) -> usize {
        let (d, f) = (self.d_model, self.ffn);
        let layer = 4 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d);
        self.vocab * d + self.ctx * d + self.layers * layer + 2 * d + d * self.vocab + self.vocab
    }

    pub(super) fn validate(&self) -> Result<()> {
        let what = if self.layers == 0
            || self.d_model == 0
            || self.heads == 0
            || self.ffn == 0
            || self.vocab == 0
            || self.ctx == 0
        {
            "every size must be at least 1"
        } else if !self.d_model.is_multiple_of(self.heads) {
            "d_model must be a multiple of heads"
        } else if i32::try_from(self.vocab).is_err() || i32::try_from(self.ctx).is_err() {
            "vocab and ctx must fit in an i32"
        } else if self.eps.is_nan() || self.eps <= 0.0 {
            "eps must be positive"
        } else {
            return Ok(());
        };
        Err(TensorError::Config { what })
    }
}

impl fmt::Display for DecoderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers, d={}, {} heads, ffn {}, vocab {}, context {}, fp32 ({:.1}M parameters)",
            self.layers,
            self.d_model,
            self.heads,
            self.ffn,
            self.vocab,
            self.ctx,
            self.parameters() as f64 / 1e6
        )
    }
}
