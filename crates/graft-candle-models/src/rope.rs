//! Rotary embedding tables and their use at positions held on the device: the rows of the
//! tables are picked with `index_select` at each sequence's position, so no host position
//! reaches a kernel.

use std::f32::consts::PI;

use candle_core::{DType, Device, Result, Tensor};

use super::spec::{RopeSpec, RopeStyle};

/// `[max_positions, head_dim / 2]` cosine and sine tables in the model's dtype.
#[derive(Debug)]
pub(crate) struct Rope {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    style: RopeStyle,
}

/// The inverse frequencies of `spec` for heads of `dim` columns, with the arithmetic of the
/// candle model ported (f32 or f64 powers, Llama 3's scaling).
fn inverse_frequencies(spec: &RopeSpec, dim: usize) -> Vec<f32> {
    let plain = (0..dim).step_by(2).map(|i| {
        if spec.f64_powers {
            1f32 / spec.theta.powf(i as f64 / dim as f64) as f32
        } else {
            1f32 / (spec.theta as f32).powf(i as f32 / dim as f32)
        }
    });
    let Some(s) = spec.llama3 else {
        return plain.collect();
    };
    let low_wavelen = s.original_max_positions as f32 / s.low_freq_factor;
    let high_wavelen = s.original_max_positions as f32 / s.high_freq_factor;
    plain
        .map(|freq| {
            let wavelen = 2. * PI / freq;
            if wavelen < high_wavelen {
                freq
            } else if wavelen > low_wavelen {
                freq / s.factor
            } else {
                let smooth = (s.original_max_positions as f32 / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1. - smooth) * freq / s.factor + smooth * freq
            }
        })
        .collect()
}

impl Rope {
    /// The tables of `spec` for heads of `dim` columns, computed in f32 and stored in `dtype`.
    pub(crate) fn new(spec: &RopeSpec, dim: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let inv = inverse_frequencies(spec, dim);
        let half = inv.len();
        let inv = Tensor::from_vec(inv, (1, half), device)?;
        let positions = u32::try_from(spec.max_positions)
            .map_err(|_| candle_core::Error::Msg("max_position_embeddings exceeds u32".into()))?;
        let angles = Tensor::arange(0u32, positions, device)?
            .to_dtype(DType::F32)?
            .reshape((spec.max_positions, 1))?
            .matmul(&inv)?;
        Ok(Rope {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            style: spec.style,
        })
    }

    /// The table rows at `positions` (`[batch]` u32 on the device), shaped `[batch, 1,
    /// head_dim / 2]` for one new position per sequence.
    pub(crate) fn at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let cos = self.cos.index_select(positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(positions, 0)?.unsqueeze(1)?;
        Ok((cos, sin))
    }

    /// `x` (`[batch, heads, seq, head_dim]`) rotated at positions `0..seq`, in differentiable
    /// ops (candle-nn's fused rotary kernels have no backward).
    pub(crate) fn apply_sequence(&self, x: &Tensor) -> Result<Tensor> {
        let seq = x.dim(2)?;
        let (cos, sin) = (self.cos.narrow(0, 0, seq)?, self.sin.narrow(0, 0, seq)?);
        match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope_slow(x, &cos, &sin),
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i_slow(x, &cos, &sin),
        }
    }

    /// How the kernels pair a head's dims.
    pub(crate) fn style(&self) -> graft_candle_kernels::RopeStyle {
        match self.style {
            RopeStyle::Half => graft_candle_kernels::RopeStyle::Half,
            RopeStyle::Interleaved => graft_candle_kernels::RopeStyle::Interleaved,
        }
    }

    /// `x` (`[batch, heads, t, head_dim]`, contiguous) rotated by the rows `at` returned.
    pub(crate) fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(x, cos, sin),
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Llama3Scaling;

    fn spec(llama3: Option<Llama3Scaling>) -> RopeSpec {
        RopeSpec {
            theta: 500_000.0,
            f64_powers: false,
            llama3,
            style: RopeStyle::Half,
            max_positions: 16,
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let plain = inverse_frequencies(&spec(None), 128);
        let scaling = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192,
        };
        let scaled = inverse_frequencies(&spec(Some(scaling)), 128);
        assert_eq!(plain.len(), 64);
        assert_eq!(plain[0], scaled[0], "the highest frequency is kept");
        assert_eq!(
            plain[63] / 8.0,
            scaled[63],
            "the lowest is divided by the factor"
        );
        assert!(
            plain
                .iter()
                .zip(&scaled)
                .any(|(p, s)| p != s && *p / 8.0 != *s)
        );
    }

    #[test]
    fn rows_are_picked_per_sequence() -> Result<()> {
        let rope = Rope::new(&spec(None), 8, DType::F32, &Device::Cpu)?;
        let positions = Tensor::new(&[3u32, 0], &Device::Cpu)?;
        let (cos, _) = rope.at(&positions)?;
        assert_eq!(cos.dims(), [2, 1, 4]);
        let rows = cos.squeeze(1)?.to_vec2::<f32>()?;
        assert_eq!(rows[1], [1.0; 4], "position 0 does not rotate");
        assert_eq!(rows[0], rope.cos.get(3)?.to_vec1::<f32>()?);
        Ok(())
    }
}
