//! Many tokens per launch: [`Decoder::generate_graft`] runs up to K decode steps in one graft
//! call whose body is a device-side loop ([`Ctx::while_loop`]) around one step, its token pick
//! (greedy, or sampled from the state's generator, [`crate::sampling`]) and one bookkeeping
//! kernel ([`ops::loop_record`]); recorded, a replay runs every iteration on the device and the
//! host reads the tokens once per launch. [`Decoder::generate_per_step`] is the reference:
//! what a server does without the loop, one graft call per token ([`Decoder::step_sampled_graft`],
//! the same step and pick) and a host read of each, stopping on the host by the same rule.
//! Both give the same tokens.
//!
//! The rule: row `r` may emit `left[r]` more tokens; a row that emits `eos` (emitted) has
//! none left; a launch stops when every row has none left, after K steps, or when the KV
//! cache is full. Every step decodes every row of the bucket (stopped ones too, whose tokens
//! are dropped), so the position advances once per step that ran.

use graft_core::{BodyError, Ctx, FunctionId, FunctionSpec, Graft, Outcome, Output};

use super::config::default_buckets;
use super::model::{Decoder, check_outputs};
use super::state::KvState;
use crate::backend::Backend;
use crate::error::{Result, TensorError};
use crate::ops::{self, PAD};
use crate::sampling::Sampling;
use crate::tensor::{Meta, Tensor};

/// One launch of a token loop: how many tokens, when a sequence ends, and how tokens are
/// picked. Each distinct value is its own graph (its parameters are baked into the kernels).
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct LoopSpec {
    /// K: the most steps (tokens per sequence) per launch, at least 1.
    pub max_tokens: usize,
    /// The end token: a sequence that emits it stops (in `0..vocab`), or none.
    pub eos: Option<i32>,
    /// How each step picks the next tokens.
    pub sampling: Sampling,
}

/// What [`Decoder::generate_graft`] or [`Decoder::generate_per_step`] generated.
#[derive(Clone, Debug)]
pub struct Generated {
    /// Per real row: the tokens it emitted, in order (its end token included).
    pub emitted: Vec<Vec<i32>>,
    /// Per real row: the tokens it may still emit (0: stopped).
    pub left: Vec<usize>,
    /// Steps that ran (the position advanced by as many).
    pub steps: usize,
    /// `[bucket]` i32: the last step's tokens, every row's (a graft output): the next
    /// launch's input. The tokens passed in when no step ran.
    pub next: Tensor,
    /// The loop's token buffer `[K, bucket]` i32 (a graft output; [`Decoder::generate_graft`]
    /// only): step `i`'s token of row `r`, or [`PAD`] where the row had stopped or the step
    /// did not run.
    pub tokens: Option<Tensor>,
    /// What graft did in the (last) call; `None` when no call was made.
    pub outcome: Option<Outcome>,
}

/// The tokens a row may emit after emitting `token` with `left` (at least 1) left.
fn after(left: usize, token: i32, eos: Option<i32>) -> usize {
    if Some(token) == eos { 0 } else { left - 1 }
}

impl<D: Backend> Decoder<D> {
    /// Registers the sampled decode step ([`Decoder::step_sampled_graft`]) with `graft`:
    /// inputs (tokens, position, weights, caches, generator), the last four static; keys
    /// (bucket, [`Sampling::keys`]).
    pub fn register_sampled(&self, graft: &mut Graft<D, Meta>) -> FunctionId {
        graft.register(
            "decode_sample",
            FunctionSpec::inference([1, 2, 3, 4]).buckets(default_buckets()),
        )
    }

    /// Registers the token loop ([`Decoder::generate_graft`]) with `graft`: inputs (tokens,
    /// position, weights, caches, generator, token limits), the last five static; keys
    /// (bucket, K, end token + 1 or 0 for none, [`Sampling::keys`]), so each [`LoopSpec`] has
    /// its own graph.
    pub fn register_loop(&self, graft: &mut Graft<D, Meta>) -> FunctionId {
        graft.register(
            "decode_loop",
            FunctionSpec::inference([1, 2, 3, 4, 5]).buckets(default_buckets()),
        )
    }

    /// One step through graft that picks the next tokens as `sampling` says (greedy: the
    /// argmax of [`Decoder::step_graft`], leaving the generator as it is; else drawing from
    /// the state's generator, [`KvState::seed`], and advancing it): `fid` from
    /// [`Decoder::register_sampled`]. Returns the next tokens (`[bucket]` i32) and what graft
    /// did.
    pub fn step_sampled_graft(
        &self,
        graft: &mut Graft<D, Meta>,
        fid: FunctionId,
        state: &mut KvState,
        tokens: &Tensor,
        sampling: Sampling,
    ) -> Result<(Tensor, Outcome)> {
        self.check_call(state, tokens)?;
        sampling.check()?;
        let mut outs = std::mem::take(&mut state.outs);
        let st: &KvState = state;
        let inputs = [
            tokens.buffer(),
            st.pos.buffer(),
            self.arena.buffer(),
            st.cache.buffer(),
            st.rng.buffer(),
        ];
        let [s0, s1] = sampling.keys();
        let called = graft.call_into(
            fid,
            &inputs,
            &[st.bucket as u64, s0, s1],
            |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<Meta>>, BodyError> {
                let ins = self.body_inputs(st, ctx.inputs())?;
                let rng =
                    Tensor::from_buffer(ctx.input(4).clone(), st.rng.shape(), st.rng.dtype())?;
                let next = self.forward_sampled(
                    ctx,
                    &ins.tokens,
                    &ins.pos,
                    &ins.weights,
                    &ins.kv,
                    &rng,
                    sampling,
                )?;
                Ok(vec![next.into_output()])
            },
            &mut outs,
        );
        let result = check_outputs(called, &outs, "decode_sample", 1)
            .and_then(|outcome| Ok((Tensor::from_output(outs[0].clone())?, outcome)));
        outs.clear();
        state.outs = outs;
        let next = result?;
        state.steps += 1;
        Ok(next)
    }

    /// Up to `spec.max_tokens` steps in one graft call (`fid` from [`Decoder::register_loop`])
    /// whose body loops on the device: each step decodes every row, picks its tokens as
    /// `spec.sampling` says, and one kernel stores each row's token and decides whether to go
    /// on (see the module docs for the rule). `tokens` (`[bucket]` i32) is the first step's
    /// input; `left[r]` is the number of tokens real row `r` may still emit (rows past
    /// `left.len()` are padding, with none). Then one host read of the token buffer gives the
    /// tokens; the state's step count advances by the steps that ran.
    ///
    /// # Errors
    /// As [`Decoder::step_graft`]; [`TensorError::Limits`] for more limits than rows;
    /// [`TensorError::LoopLength`], [`TensorError::EosOutOfRange`] and
    /// [`TensorError::Temperature`] for a spec that cannot run.
    pub fn generate_graft(
        &self,
        graft: &mut Graft<D, Meta>,
        fid: FunctionId,
        state: &mut KvState,
        tokens: &Tensor,
        left: &[usize],
        spec: &LoopSpec,
    ) -> Result<Generated> {
        self.check_call(state, tokens)?;
        self.check_spec(state, left, spec)?;
        state.write_limits(graft.device(), left)?;
        let mut outs = std::mem::take(&mut state.outs);
        let st: &KvState = state;
        let inputs = [
            tokens.buffer(),
            st.pos.buffer(),
            self.arena.buffer(),
            st.cache.buffer(),
            st.rng.buffer(),
            st.limits.buffer(),
        ];
        let [s0, s1] = spec.sampling.keys();
        // check_spec refused negative end tokens.
        let eos_key = spec.eos.map_or(0, |e| e as u64 + 1);
        let keys = [st.bucket as u64, spec.max_tokens as u64, eos_key, s0, s1];
        let called = graft.call_into(
            fid,
            &inputs,
            &keys,
            |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<Meta>>, BodyError> {
                let ins = self.body_inputs(st, ctx.inputs())?;
                let rng =
                    Tensor::from_buffer(ctx.input(4).clone(), st.rng.shape(), st.rng.dtype())?;
                let limits = Tensor::from_buffer(
                    ctx.input(5).clone(),
                    st.limits.shape(),
                    st.limits.dtype(),
                )?;
                let k = &self.kernels;
                let ctx_len = self.config.ctx as i32;
                let lp = ops::loop_begin(
                    k,
                    ctx,
                    &ins.tokens,
                    &limits,
                    &ins.pos,
                    spec.max_tokens,
                    ctx_len,
                    spec.eos,
                )?;
                ctx.while_loop(lp.flag(), |ctx: &mut Ctx<'_, D>| {
                    let next = self.forward_sampled(
                        ctx,
                        lp.current(),
                        &ins.pos,
                        &ins.weights,
                        &ins.kv,
                        &rng,
                        spec.sampling,
                    )?;
                    ops::loop_record(k, &lp, &next)?;
                    Ok::<(), BodyError>(())
                })?;
                Ok(vec![
                    lp.tokens().clone().into_output(),
                    lp.current().clone().into_output(),
                ])
            },
            &mut outs,
        );
        let result = check_outputs(called, &outs, "decode_loop", 2).and_then(|outcome| {
            let buffer = Tensor::from_output(outs[0].clone())?;
            let next = Tensor::from_output(outs[1].clone())?;
            Ok((buffer, next, outcome))
        });
        outs.clear();
        state.outs = outs;
        let (buffer, next, outcome) = result?;
        let host = buffer.to_vec_i32(graft.device())?;
        let mut emitted = vec![Vec::new(); left.len()];
        let mut left = left.to_vec();
        let mut steps = 0;
        for (i, row) in host.chunks_exact(state.bucket).enumerate() {
            if row.iter().all(|&t| t == PAD) {
                break;
            }
            steps = i + 1;
            for ((&t, e), l) in row.iter().zip(&mut emitted).zip(&mut left) {
                if t != PAD && *l > 0 {
                    e.push(t);
                    *l = after(*l, t, spec.eos);
                }
            }
        }
        state.steps += steps;
        Ok(Generated {
            emitted,
            left,
            steps,
            next,
            tokens: Some(buffer),
            outcome: Some(outcome),
        })
    }

    /// The reference of [`Decoder::generate_graft`]: the same steps, one graft call each
    /// ([`Decoder::step_sampled_graft`], `fid` from [`Decoder::register_sampled`]) with a host
    /// read of its tokens, stopping on the host by the same rule. What a server does without
    /// a device loop; its tokens are the loop's.
    ///
    /// # Errors
    /// As [`Decoder::generate_graft`].
    pub fn generate_per_step(
        &self,
        graft: &mut Graft<D, Meta>,
        fid: FunctionId,
        state: &mut KvState,
        tokens: &Tensor,
        left: &[usize],
        spec: &LoopSpec,
    ) -> Result<Generated> {
        self.check_call(state, tokens)?;
        self.check_spec(state, left, spec)?;
        let mut emitted = vec![Vec::new(); left.len()];
        let mut left = left.to_vec();
        let mut next = tokens.clone();
        let mut outcome = None;
        let mut steps = 0;
        while steps < spec.max_tokens
            && left.iter().any(|&l| l > 0)
            && state.steps < state.capacity()
        {
            let (t, o) = self.step_sampled_graft(graft, fid, state, &next, spec.sampling)?;
            let host = t.to_vec_i32(graft.device())?;
            for ((&t, e), l) in host.iter().zip(&mut emitted).zip(&mut left) {
                if *l > 0 {
                    e.push(t);
                    *l = after(*l, t, spec.eos);
                }
            }
            next = t;
            outcome = Some(o);
            steps += 1;
        }
        Ok(Generated {
            emitted,
            left,
            steps,
            next,
            tokens: None,
            outcome,
        })
    }

    /// Refuses limits and specs that cannot run on `state`.
    fn check_spec(&self, state: &KvState, left: &[usize], spec: &LoopSpec) -> Result<()> {
        if left.len() > state.bucket {
            return Err(TensorError::Limits {
                found: left.len(),
                bucket: state.bucket,
            });
        }
        let max = i32::MAX as usize / state.bucket.max(1);
        if spec.max_tokens == 0 || spec.max_tokens > max {
            return Err(TensorError::LoopLength {
                max_tokens: spec.max_tokens,
                max,
            });
        }
        if let Some(eos) = spec.eos
            && (eos < 0 || eos as usize >= self.config.vocab)
        {
            return Err(TensorError::EosOutOfRange {
                eos,
                vocab: self.config.vocab,
            });
        }
        spec.sampling.check()
    }
}

impl KvState {
    /// Writes each row's token limit (`left`, then 0 for the padding rows) into the state's
    /// limits input, when it changed since the last write (synchronously: not inside a
    /// capture).
    fn write_limits<D: graft_core::Device>(&mut self, device: &D, left: &[usize]) -> Result<()> {
        let want = (0..self.bucket).map(|r| {
            left.get(r)
                .map_or(0, |&l| i32::try_from(l).unwrap_or(i32::MAX))
        });
        if want.clone().eq(self.limits_host.iter().copied()) {
            return Ok(());
        }
        let want: Vec<i32> = want.collect();
        self.limits.write_i32(device, &want)?;
        self.limits_host = want;
        Ok(())
    }
}
