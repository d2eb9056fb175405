//! The straightforward decoder the capturable step is checked against: a KV cache grown by
//! concatenation, the position a host integer, attention over exactly the filled positions
//! (the way candle-transformers' Llama does it). Same weights, same math, no mask.

use candle_core::{D, DType, Module, Result, Tensor};

use crate::llama::{Llama, attend};

/// The reference's state: per layer the keys and values so far, and the host position.
pub(crate) struct ConcatState {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    position: usize,
}

impl ConcatState {
    pub(crate) fn new(model: &Llama) -> ConcatState {
        ConcatState {
            k: vec![None; model.cfg.layers],
            v: vec![None; model.cfg.layers],
            position: 0,
        }
    }
}

fn grow(cache: &mut Option<Tensor>, new: Tensor) -> Result<Tensor> {
    let all = match cache.take() {
        Some(old) => Tensor::cat(&[&old, &new], 2)?,
        None => new,
    };
    *cache = Some(all.clone());
    Ok(all)
}

/// One step of the reference: `tokens` `[batch]` u32 in, greedy next tokens out.
pub(crate) fn step(model: &Llama, state: &mut ConcatState, tokens: &Tensor) -> Result<Tensor> {
    let cfg = &model.cfg;
    let cos = model.cos.narrow(0, state.position, 1)?;
    let sin = model.sin.narrow(0, state.position, 1)?;
    let no_mask = Tensor::zeros(state.position + 1, DType::F32, tokens.device())?;
    let mut x = model.embed.index_select(tokens, 0)?;
    for (i, b) in model.blocks.iter().enumerate() {
        let (q, k, v) = b.qkv(&x, &cos, &sin, cfg)?;
        let k = grow(&mut state.k[i], k)?.contiguous()?;
        let v = grow(&mut state.v[i], v)?.contiguous()?;
        let o = attend(&q, &k, &v, &no_mask, cfg)?;
        x = b.finish(&x, &o, cfg)?;
    }
    state.position += 1;
    let x = candle_nn::ops::rms_norm(&x, &model.norm, cfg.eps)?;
    model.lm_head.forward(&x)?.argmax(D::Minus1)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::llama::LlamaConfig;
    use crate::{Buckets, CandleGraft, EagerCause, StepOutcome, pad};

    const STEPS: usize = 64;

    fn prompt(batch: usize) -> Vec<u32> {
        (0..batch as u32).map(|i| (7 + 31 * i) % 256).collect()
    }

    /// The capturable step (static cache, device position, mask) against the concatenation
    /// reference, tokens fed back, for `STEPS` steps.
    #[test]
    fn static_cache_step_matches_the_concatenation_reference() {
        let device = Device::Cpu;
        let model = Llama::new(LlamaConfig::tiny(), 42, &device).unwrap();
        for batch in [1, 3] {
            let state = model.new_state(batch).unwrap();
            let mut reference = ConcatState::new(&model);
            let mut ours = Tensor::new(prompt(batch).as_slice(), &device).unwrap();
            let mut theirs = ours.clone();
            let mut distinct = std::collections::HashSet::new();
            for i in 0..STEPS {
                ours = model.step(&state, &ours).unwrap();
                theirs = step(&model, &mut reference, &theirs).unwrap();
                let (a, b) = (
                    ours.to_vec1::<u32>().unwrap(),
                    theirs.to_vec1::<u32>().unwrap(),
                );
                assert_eq!(a, b, "batch {batch}, step {i}");
                distinct.extend(a);
            }
            assert_eq!(state.position().unwrap(), STEPS as u32);
            // Random weights still give a sequence that moves (the test is not vacuous).
            assert!(distinct.len() > 3, "tokens barely change: {distinct:?}");
            state.reset().unwrap();
            assert_eq!(state.position().unwrap(), 0);
        }
    }

    /// The same in bf16 (the dtype of the 1B config): the static-cache step runs and agrees
    /// with the reference.
    #[test]
    fn bf16_step_matches_the_reference() {
        let device = Device::Cpu;
        let cfg = LlamaConfig {
            dtype: DType::BF16,
            ..LlamaConfig::tiny()
        };
        let model = Llama::new(cfg, 3, &device).unwrap();
        let state = model.new_state(2).unwrap();
        let mut reference = ConcatState::new(&model);
        let mut ours = Tensor::new(prompt(2).as_slice(), &device).unwrap();
        let mut theirs = ours.clone();
        for i in 0..16 {
            ours = model.step(&state, &ours).unwrap();
            theirs = step(&model, &mut reference, &theirs).unwrap();
            assert_eq!(
                ours.to_vec1::<u32>().unwrap(),
                theirs.to_vec1::<u32>().unwrap(),
                "step {i}"
            );
        }
    }

    /// graft-candle on the CPU runs the step eagerly with a typed reason and gives the plain
    /// model's tokens, the batch padded to its bucket.
    #[test]
    fn the_adapter_on_the_cpu_gives_the_plain_models_tokens() {
        let device = Device::Cpu;
        let model = Llama::new(LlamaConfig::tiny(), 7, &device).unwrap();
        let buckets = Buckets::new([1, 8, 32]).unwrap();
        let (bucket, padded) = pad(&buckets, &prompt(3), 0);
        assert_eq!(bucket, 8);
        let plain_state = model.new_state(bucket).unwrap();
        let state = model.new_state(bucket).unwrap();
        let mut graft = CandleGraft::new(&device).unwrap();
        let decode = graft.register_bucketed("decode", buckets);
        let mut statics = model.weights();
        statics.extend(state.tensors());
        let mut plain = Tensor::new(padded.as_slice(), &device).unwrap();
        let mut tokens = plain.clone();
        let mut kept = Vec::new();
        for i in 0..STEPS {
            plain = model.step(&plain_state, &plain).unwrap();
            let out = graft
                .call(decode, &[&tokens], &statics, &[bucket as u64], |ins| {
                    Ok(vec![model.step(&state, &ins[0])?])
                })
                .unwrap();
            assert!(
                matches!(&out.outcome, StepOutcome::Eager(EagerCause::NotCuda { location }) if location == "Cpu"),
                "{:?}",
                out.outcome
            );
            tokens = out.outputs.into_iter().next().unwrap();
            assert_eq!(tokens.dtype(), DType::U32);
            assert_eq!(
                tokens.to_vec1::<u32>().unwrap(),
                plain.to_vec1::<u32>().unwrap(),
                "step {i}"
            );
            kept.push((tokens.clone(), plain.to_vec1::<u32>().unwrap()));
        }
        // Outputs held across steps still hold their own step's tokens.
        for (held, expected) in kept {
            assert_eq!(held.to_vec1::<u32>().unwrap(), expected);
        }
    }
}
