//! The decoder ([`Decoder`]): built from a seed (one static weight arena), its states and
//! tokens, and one step through graft or eagerly.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use graft_core::{
    BodyError, Bucket, Buckets, Buffer, Ctx, FunctionId, FunctionSpec, Graft, Outcome, Output,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::config::{DecoderConfig, default_buckets};
use super::state::{KvState, kv_views};
use super::weights::{Init, Layout, Weights, layout_of, shard_host};
use crate::backend::Backend;
use crate::collective::Collective;
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::philox::{RNG_WORDS, rng_words};
use crate::tensor::{Alloc, EagerAlloc, Meta, Tensor};

/// The decoder: configuration, weights (one static arena from [`Graft::alloc`]) and the
/// device's kernels, loaded when it is built and unloaded when it is dropped.
pub struct Decoder<D: Backend> {
    pub(super) device: D,
    pub(super) kernels: D::Ops,
    pub(super) config: DecoderConfig,
    pub(super) layout: Layout,
    pub(super) arena: Tensor,
    pub(super) weights: Weights,
    /// Tensor-parallel: this rank's communicator (`None`: the whole model on one device).
    pub(super) shard: Option<Arc<dyn Collective>>,
}

impl<D: Backend> fmt::Debug for Decoder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("device", &self.device.describe())
            .field("config", &self.config)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl<D: Backend> Decoder<D> {
    /// Builds the model with random weights from `seed` in one arena allocated through
    /// `alloc` (e.g. a [`Graft`], whose [`Graft::alloc`] memory lives across steps) and marked
    /// static, and loads the device's kernels ([`Backend::load_ops`]: compiled once, with
    /// cuBLAS set up, so nothing is created during a capture).
    pub fn new<A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        config: DecoderConfig,
        seed: u64,
    ) -> Result<Decoder<D>> {
        Decoder::build(alloc, config, seed, None)
    }

    /// One rank of the same model (same `config` and `seed`) split tensor-parallel over
    /// `comm.world()` devices, Megatron-style: this rank holds its share of the attention
    /// heads (the columns of q, k and v, the rows of the output projection) and of the MLP's
    /// hidden columns (the columns of its first layer, the rows of its second), and its KV
    /// caches hold its heads only. The partial products of the output projection and of the
    /// MLP's second layer are summed over the ranks by an all-reduce on `comm`, inside the
    /// step (so graft records it into the step's graph); everything else is replicated, so
    /// every rank computes the same tokens. `heads` and `ffn` must be multiples of the world.
    pub fn new_sharded<A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        config: DecoderConfig,
        seed: u64,
        comm: Arc<dyn Collective>,
    ) -> Result<Decoder<D>> {
        let world = comm.world();
        if world == 0 || !config.heads.is_multiple_of(world) || !config.ffn.is_multiple_of(world) {
            return Err(TensorError::Config {
                what: "heads and ffn must be multiples of the number of ranks",
            });
        }
        Decoder::build(alloc, config, seed, Some(comm))
    }

    fn build<A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        config: DecoderConfig,
        seed: u64,
        shard: Option<Arc<dyn Collective>>,
    ) -> Result<Decoder<D>> {
        config.validate()?;
        let device = alloc.device().clone();
        let kernels = device.load_ops()?;
        let (layout, init) = layout_of(&config);
        let mut host = vec![0.0f32; layout.total];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        for ((at, shape), (how, _)) in layout.entries.iter().zip(&init) {
            let n: usize = shape.iter().product();
            let dst = &mut host[*at..at + n];
            match *how {
                Init::Ones => dst.fill(1.0),
                Init::Zeros => dst.fill(0.0),
                Init::Uniform(s) => dst
                    .iter_mut()
                    .for_each(|v| *v = (rng.random::<f32>() * 2.0 - 1.0) * s),
            }
        }
        let (layout, host) = match &shard {
            Some(comm) => shard_host(&layout, &init, &host, comm.rank(), comm.world()),
            None => (layout, host),
        };
        let arena = Tensor::from_f32(alloc, &[layout.total], &host)?;
        arena.buffer().mark_static();
        let weights = Weights::views(&arena, &layout, config.layers)?;
        Ok(Decoder {
            device,
            kernels,
            config,
            layout,
            arena,
            weights,
            shard,
        })
    }

    /// The model width and heads this device holds: all of them, or a rank's share.
    pub(super) fn local_dims(&self) -> (usize, usize) {
        let world = self.shard.as_ref().map_or(1, |c| c.world());
        (self.config.d_model / world, self.config.heads / world)
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The weight arena (one static buffer).
    pub fn weights(&self) -> &Tensor {
        &self.arena
    }

    /// Every parameter by name, as a view into the arena: `tok_emb` `[vocab, d]`, `pos_emb`
    /// `[ctx, d]`; per block `layers.{i}.` + `ln1.gamma`, `ln1.beta`, `wqkv` `[d, 3d]` (the
    /// q, k and v projections side by side), `bqkv` `[3d]`, `wo`, `bo`, `ln2.gamma`, `ln2.beta`, `w1` `[d, ffn]`, `b1`, `w2`
    /// `[ffn, d]`, `b2`; then `lnf.gamma`, `lnf.beta`, `lm_head.w` `[d, vocab]`,
    /// `lm_head.b`. Matrices are `[in, out]` (a layer computes `x · w + b`).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.layout
            .names
            .iter()
            .zip(&self.layout.entries)
            .map(|(name, (at, shape))| Ok((name.clone(), self.arena.view(*at, shape)?)))
            .collect()
    }

    /// Registers the decode step with `graft` with the default buckets: inputs (tokens,
    /// position, weights, caches), the last three static; the bucket is `keys[0]`.
    pub fn register(&self, graft: &mut Graft<D, Meta>) -> FunctionId {
        self.register_with(graft, default_buckets())
    }

    /// [`Decoder::register`] with these buckets.
    pub fn register_with(&self, graft: &mut Graft<D, Meta>, buckets: Buckets) -> FunctionId {
        graft.register(
            "decode_step",
            FunctionSpec::inference([1, 2, 3]).buckets(buckets),
        )
    }

    /// A static cache arena for states of up to `bucket` rows (see [`Decoder::state_in`]).
    pub fn cache_for<A: EagerAlloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        bucket: usize,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (d, _) = self.local_dims();
        let cache = Tensor::empty(alloc, &[c.layers, 2, bucket, c.ctx, d], DType::F32)?;
        cache.buffer().mark_static();
        Ok(cache)
    }

    /// A fresh state for `bucket` with its own cache (caches and position from `alloc`,
    /// marked static), at position 0.
    pub fn new_state<A: EagerAlloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        bucket: usize,
    ) -> Result<KvState> {
        let cache = self.cache_for(alloc, bucket.max(1))?;
        self.state_in(alloc, &cache, bucket)
    }

    /// A fresh state for `bucket` whose cache lives at the start of `arena` (from
    /// [`Decoder::cache_for`] with at least `bucket` rows): states made from one arena share
    /// its memory, so only one of them holds a live sequence at a time (a serving engine's
    /// per-bucket graphs over one cache). The position comes from `alloc`.
    pub fn state_in<A: EagerAlloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        arena: &Tensor,
        bucket: usize,
    ) -> Result<KvState> {
        let c = &self.config;
        let (d, _) = self.local_dims();
        let shape = [c.layers, 2, bucket, c.ctx, d];
        if bucket == 0 {
            return Err(TensorError::EmptyBatch);
        }
        let cache = arena.view(0, &shape)?;
        let pos = Tensor::from_i32(alloc, &[1], &[0])?;
        pos.buffer().mark_static();
        let rng = Tensor::from_u32(alloc, &[RNG_WORDS], &rng_words(0, 0))?;
        rng.buffer().mark_static();
        let limits_host = vec![0; bucket];
        let limits = Tensor::from_i32(alloc, &[bucket], &limits_host)?;
        limits.buffer().mark_static();
        let kv = kv_views(&cache)?;
        Ok(KvState {
            bucket,
            pos,
            rng,
            limits,
            limits_host,
            cache,
            kv,
            steps: 0,
            ctx: c.ctx,
            outs: Vec::with_capacity(1),
        })
    }

    /// The first tokens of a batch, padded with token 0 to its default bucket, as a
    /// `[bucket]` i32 tensor from `alloc` (written synchronously: not inside a capture).
    pub fn tokens<A: EagerAlloc<D> + ?Sized>(&self, alloc: &mut A, ids: &[i32]) -> Result<Tensor> {
        match default_buckets().pick(ids.len()) {
            Bucket::Padded(bucket) => self.tokens_in(alloc, ids, bucket),
            Bucket::Above { size, largest } => Err(TensorError::BatchTooLarge {
                batch: size,
                max: largest,
            }),
        }
    }

    /// The first tokens of a batch padded with token 0 to `bucket` rows.
    pub fn tokens_in<A: EagerAlloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        ids: &[i32],
        bucket: usize,
    ) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(TensorError::EmptyBatch);
        }
        if ids.len() > bucket {
            return Err(TensorError::BatchTooLarge {
                batch: ids.len(),
                max: bucket,
            });
        }
        for (row, &id) in ids.iter().enumerate() {
            if id < 0 || id as usize >= self.config.vocab {
                return Err(TensorError::TokenOutOfRange {
                    row,
                    id,
                    vocab: self.config.vocab,
                });
            }
        }
        let mut padded = ids.to_vec();
        padded.resize(bucket, 0);
        Tensor::from_i32(alloc, &[bucket], &padded)
    }

    pub(super) fn check_tokens(&self, state: &KvState, tokens: &Tensor) -> Result<()> {
        if tokens.dtype() != DType::I32 {
            return Err(TensorError::DType {
                op: "decode_step",
                operand: "tokens",
                expected: DType::I32,
                found: tokens.dtype(),
            });
        }
        match *tokens.shape() {
            [b] if b == state.bucket => Ok(()),
            [b] => Err(TensorError::BucketMismatch {
                tokens: b,
                state: state.bucket,
            }),
            _ => Err(TensorError::Shape {
                op: "decode_step",
                operand: "tokens",
                expected: vec![state.bucket],
                found: tokens.shape().to_vec(),
            }),
        }
    }

    /// One step through graft: `fid` (from [`Decoder::register`]) is called with the tokens,
    /// the position, the weights and the caches, and the bucket as signature key; graft warms
    /// it up, records it or replays it. Returns the next tokens (`[bucket]` i32, graft memory:
    /// pass them to the next step).
    pub fn step_graft(
        &self,
        graft: &mut Graft<D, Meta>,
        fid: FunctionId,
        state: &mut KvState,
        tokens: &Tensor,
    ) -> Result<Tensor> {
        self.step_graft_outcome(graft, fid, state, tokens)
            .map(|(next, _)| next)
    }

    /// [`Decoder::step_graft`], also returning what graft did (warmed up, recorded, replayed
    /// or ran eagerly), as [`Graft::capture_buckets`] needs.
    pub fn step_graft_outcome(
        &self,
        graft: &mut Graft<D, Meta>,
        fid: FunctionId,
        state: &mut KvState,
        tokens: &Tensor,
    ) -> Result<(Tensor, Outcome)> {
        self.check_call(state, tokens)?;
        let mut outs = std::mem::take(&mut state.outs);
        let st: &KvState = state;
        let inputs = [
            tokens.buffer(),
            st.pos.buffer(),
            self.arena.buffer(),
            st.cache.buffer(),
        ];
        let called = graft.call_into(
            fid,
            &inputs,
            &[st.bucket as u64],
            |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<Meta>>, BodyError> {
                let ins = self.body_inputs(st, ctx.inputs())?;
                let next = self.forward(ctx, &ins.tokens, &ins.pos, &ins.weights, &ins.kv)?;
                Ok(vec![next.into_output()])
            },
            &mut outs,
        );
        let result = check_outputs(called, &outs, "decode_step", 1)
            .and_then(|outcome| Ok((Tensor::from_output(outs[0].clone())?, outcome)));
        outs.clear();
        state.outs = outs;
        let (next, outcome) = result?;
        state.steps += 1;
        Ok((next, outcome))
    }

    /// Checks what every graft entry point checks of its tokens and state: the tokens are
    /// the state's bucket's, a whole buffer, and the state has room for a step.
    pub(super) fn check_call(&self, state: &KvState, tokens: &Tensor) -> Result<()> {
        self.check_tokens(state, tokens)?;
        state.check_room()?;
        if !tokens.is_whole_buffer() {
            return Err(TensorError::NotWholeBuffer {
                operand: "tokens",
                offset: tokens.offset(),
                bytes: tokens.bytes(),
                buffer: tokens.buffer().len(),
            });
        }
        Ok(())
    }

    /// The tensors of a body's inputs: tokens, position, weights and caches (the first four
    /// inputs of every registered decode function), as views of the buffers the body got.
    pub(super) fn body_inputs<'s>(
        &'s self,
        st: &'s KvState,
        ins: &[Buffer],
    ) -> Result<BodyInputs<'s>> {
        let weights = if ins[2].same_storage(self.arena.buffer()) {
            Cow::Borrowed(&self.weights)
        } else {
            let arena = Tensor::from_buffer(ins[2].clone(), &[self.layout.total], DType::F32)?;
            Cow::Owned(Weights::views(&arena, &self.layout, self.config.layers)?)
        };
        Ok(BodyInputs {
            tokens: Tensor::from_buffer(ins[0].clone(), &[st.bucket], DType::I32)?,
            pos: Tensor::from_buffer(ins[1].clone(), &[1], DType::I32)?,
            weights,
            kv: st.views_for(&ins[3])?,
        })
    }

    /// One step eagerly, without graft: the same ops, allocating from `alloc` (e.g. a
    /// [`Graft`]'s eager pool). Returns the next tokens.
    pub fn step_eager<A: Alloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        state: &mut KvState,
        tokens: &Tensor,
    ) -> Result<Tensor> {
        self.check_tokens(state, tokens)?;
        state.check_room()?;
        let next = self.forward(alloc, tokens, &state.pos, &self.weights, &state.kv)?;
        state.steps += 1;
        Ok(next)
    }
}

/// What a decode body reads from its inputs ([`Decoder::body_inputs`]).
pub(super) struct BodyInputs<'s> {
    pub(super) tokens: Tensor,
    pub(super) pos: Tensor,
    pub(super) weights: Cow<'s, Weights>,
    pub(super) kv: Cow<'s, [(Tensor, Tensor)]>,
}

/// What graft did in a call that should have returned `expected` outputs (in `outs`), or why
/// it failed.
pub(super) fn check_outputs(
    called: Result<Outcome, graft_core::CallError>,
    outs: &[Output<Meta>],
    function: &'static str,
    expected: usize,
) -> Result<Outcome> {
    let outcome = called?;
    if outs.len() != expected {
        return Err(TensorError::Outputs {
            function,
            expected,
            found: outs.len(),
        });
    }
    Ok(outcome)
}
