//! Decode steps with other heads than the greedy one: the logits themselves, and each row's
//! next token picked by its own sampling parameters (a device input of the step), so requests
//! that sample differently share one batch and one recording.

use candle_core::{Result, Tensor};
use graft_candle::{CandleGraft, Error, Step, StepId};
use graft_candle_kernels::sample_rows;

use super::{Decoder, KvCache};

impl Decoder {
    /// [`Decoder::decode`] with the logits (`[batch, vocab]` f32) as the output.
    pub fn decode_logits(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        tokens: &Tensor,
    ) -> std::result::Result<Step, Error> {
        self.decode_with(
            graft,
            step,
            cache,
            &[tokens],
            |logits, _| Ok(logits.clone()),
        )
    }

    /// One eager decode step whose row i draws its next token by row i of `params` (`[batch,
    /// SAMPLE_WORDS]` u32, the words of a `graft_candle_kernels::SampleParams`): `[batch]`
    /// u32. Greedy rows give [`Decoder::greedy`]'s tokens.
    pub fn sample(&self, cache: &KvCache, tokens: &Tensor, params: &Tensor) -> Result<Tensor> {
        sample_rows(&self.forward(cache, tokens)?, params)
    }

    /// [`Decoder::sample`] under graft: `tokens` and `params` are the step's inputs (upload
    /// both before each call), the rest as [`Decoder::decode`]. One recording per bucket
    /// serves every mix of sampling parameters.
    pub fn decode_sampled(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        tokens: &Tensor,
        params: &Tensor,
    ) -> std::result::Result<Step, Error> {
        self.decode_with(graft, step, cache, &[tokens, params], |logits, inputs| {
            sample_rows(logits, &inputs[1])
        })
    }
}
