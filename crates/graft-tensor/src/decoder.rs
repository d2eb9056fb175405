//! The benchmark decoder: a pre-LayerNorm transformer decoder (learned positions, GELU-tanh
//! MLP, fp32) with random weights from a fixed seed, decoding one token per sequence per step
//! against a static KV cache.
//!
//! One step: tokens `[bucket]` (i32) and the position (an i32 device scalar) in, the greedy
//! next tokens `[bucket]` out; the step also writes the new keys and values at the position
//! and increments it on the device, so step N's output tokens are step N+1's input and the
//! host never reads anything. Shapes never change with the position (attention covers cache
//! rows `0..=pos` by reading `pos` on the device), so one recorded graph serves every step.
//!
//! Batches are padded to a bucket (graft's [`Buckets`], by default [`default_buckets`]);
//! each bucket has its own [`KvState`] (several may share one cache arena,
//! [`Decoder::cache_for`]) and is its own signature key, hence its own branch of graft's tree. The same step runs three ways:
//! [`Decoder::step_graft`] (one registered function per step, body = the whole step),
//! [`Decoder::step_eager`] (the same ops, no graft), and [`Decoder::capture_raw`] (the same
//! step captured once as a plain graph with the device's capture calls, no tree). Sampled
//! steps and many tokens per launch (a device-side loop, [`Decoder::generate_graft`]) are in
//! `decoder/generate.rs`.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use graft_core::backend::CoreOnly;
use graft_core::{
    BodyError, Bucket, Buckets, Buffer, CaptureMode, Ctx, Device, FunctionId, FunctionSpec, Graft,
    Outcome, Output,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::backend::Backend;
use crate::collective::Collective;
use crate::error::{Result, TensorError};
use crate::ops;
use crate::philox::{RNG_WORDS, rng_parts, rng_words};
use crate::sampling::Sampling;
use crate::tensor::{Alloc, DType, EagerAlloc, Keep, Meta, Tensor};

mod generate;

pub use generate::{Generated, LoopSpec};

/// The token of the device's sealed capture and launch calls, which the raw-graph baseline
/// ([`Decoder::capture_raw`]) makes itself: graft-core's token for graft's benchmarks.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

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

    fn validate(&self) -> Result<()> {
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

/// Where each parameter sits in the weight arena (element offsets, 64-element aligned).
#[derive(Clone, Debug, Default)]
struct Layout {
    entries: Vec<(usize, Vec<usize>)>,
    names: Vec<String>,
    total: usize,
}

impl Layout {
    fn push(&mut self, name: String, shape: &[usize]) {
        let at = self.total.next_multiple_of(64);
        self.total = at + shape.iter().product::<usize>();
        self.entries.push((at, shape.to_vec()));
        self.names.push(name);
    }
}

/// One block's parameters (views into the arena). Matrices are `[in, out]`.
#[derive(Clone, Debug)]
struct LayerWeights {
    ln1_g: Tensor,
    ln1_b: Tensor,
    /// `[d, 3d]`: the q, k and v projections side by side.
    wqkv: Tensor,
    bqkv: Tensor,
    wo: Tensor,
    bo: Tensor,
    ln2_g: Tensor,
    ln2_b: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

/// Every parameter, as views into one arena.
#[derive(Clone, Debug)]
struct Weights {
    tok_emb: Tensor,
    pos_emb: Tensor,
    layers: Vec<LayerWeights>,
    lnf_g: Tensor,
    lnf_b: Tensor,
    lm_w: Tensor,
    lm_b: Tensor,
}

/// How each parameter is initialised.
#[derive(Clone, Copy)]
enum Init {
    Ones,
    Zeros,
    Uniform(f32),
}

/// How a tensor-parallel rank holds a parameter (Megatron's split): whole, its share of the
/// columns of each of `n` side-by-side groups (q, k and v; the MLP's first layer), or its
/// share of the rows (the products whose partial sums the all-reduce adds up).
#[derive(Clone, Copy)]
enum Split {
    Whole,
    Columns(usize),
    Rows,
}

/// The parameters of the whole model, in arena order, with how each is made and split.
fn layout_of(c: &DecoderConfig) -> (Layout, Vec<(Init, Split)>) {
    let mut l = Layout::default();
    let mut init = Vec::new();
    let (d, f) = (c.d_model, c.ffn);
    let mut add = |l: &mut Layout, name: String, shape: &[usize], i: Init, split: Split| {
        l.push(name, shape);
        init.push((i, split));
    };
    let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f32).sqrt());
    let bias = Init::Uniform(0.02);
    let (whole, qkv, cols, rows) = (
        Split::Whole,
        Split::Columns(3),
        Split::Columns(1),
        Split::Rows,
    );
    add(
        &mut l,
        "tok_emb".into(),
        &[c.vocab, d],
        Init::Uniform(0.5),
        whole,
    );
    add(
        &mut l,
        "pos_emb".into(),
        &[c.ctx, d],
        Init::Uniform(0.5),
        whole,
    );
    for i in 0..c.layers {
        let p = |n: &str| format!("layers.{i}.{n}");
        add(&mut l, p("ln1.gamma"), &[d], Init::Ones, whole);
        add(&mut l, p("ln1.beta"), &[d], Init::Zeros, whole);
        add(&mut l, p("wqkv"), &[d, 3 * d], lin(d), qkv);
        add(&mut l, p("bqkv"), &[3 * d], bias, qkv);
        add(&mut l, p("wo"), &[d, d], lin(d), rows);
        add(&mut l, p("bo"), &[d], bias, whole);
        add(&mut l, p("ln2.gamma"), &[d], Init::Ones, whole);
        add(&mut l, p("ln2.beta"), &[d], Init::Zeros, whole);
        add(&mut l, p("w1"), &[d, f], lin(d), cols);
        add(&mut l, p("b1"), &[f], bias, cols);
        add(&mut l, p("w2"), &[f, d], lin(f), rows);
        add(&mut l, p("b2"), &[d], bias, whole);
    }
    add(&mut l, "lnf.gamma".into(), &[d], Init::Ones, whole);
    add(&mut l, "lnf.beta".into(), &[d], Init::Zeros, whole);
    add(&mut l, "lm_head.w".into(), &[d, c.vocab], lin(d), whole);
    add(&mut l, "lm_head.b".into(), &[c.vocab], bias, whole);
    (l, init)
}

/// Rank `rank`'s share (of `world`) of the whole model's parameters `host` laid out by
/// `layout`: its own layout and values.
fn shard_host(
    layout: &Layout,
    splits: &[(Init, Split)],
    host: &[f32],
    rank: usize,
    world: usize,
) -> (Layout, Vec<f32>) {
    let mut local = Layout::default();
    let mut parts: Vec<Vec<f32>> = Vec::with_capacity(splits.len());
    for ((name, (at, shape)), (_, split)) in layout.names.iter().zip(&layout.entries).zip(splits) {
        let whole = &host[*at..at + shape.iter().product::<usize>()];
        let n = *shape.last().unwrap_or(&1);
        let (values, shape) = match *split {
            Split::Whole => (whole.to_vec(), shape.clone()),
            Split::Columns(groups) => {
                let share = n / groups / world;
                let mut v = Vec::with_capacity(whole.len() / world);
                for row in whole.chunks(n) {
                    for group in row.chunks(n / groups) {
                        v.extend_from_slice(&group[rank * share..(rank + 1) * share]);
                    }
                }
                let mut shape = shape.clone();
                *shape.last_mut().unwrap_or(&mut 0) = groups * share;
                (v, shape)
            }
            Split::Rows => {
                let rows = shape[0] / world;
                let v = whole[rank * rows * n..(rank + 1) * rows * n].to_vec();
                (v, vec![rows, n])
            }
        };
        local.push(name.clone(), &shape);
        parts.push(values);
    }
    let mut values = vec![0.0f32; local.total];
    for ((at, _), part) in local.entries.iter().zip(parts) {
        values[*at..at + part.len()].copy_from_slice(&part);
    }
    (local, values)
}

impl Weights {
    /// Views of `layout` into `arena`, in the order `layout_of` pushed them.
    fn views(arena: &Tensor, layout: &Layout, layers: usize) -> Result<Weights> {
        let mut it = layout.entries.iter();
        let mut next = || -> Result<Tensor> {
            let (at, shape) = it.next().ok_or(TensorError::Config {
                what: "the weight layout has fewer entries than the model",
            })?;
            arena.view(*at, shape)
        };
        let tok_emb = next()?;
        let pos_emb = next()?;
        let mut ls = Vec::with_capacity(layers);
        for _ in 0..layers {
            ls.push(LayerWeights {
                ln1_g: next()?,
                ln1_b: next()?,
                wqkv: next()?,
                bqkv: next()?,
                wo: next()?,
                bo: next()?,
                ln2_g: next()?,
                ln2_b: next()?,
                w1: next()?,
                b1: next()?,
                w2: next()?,
                b2: next()?,
            });
        }
        Ok(Weights {
            tok_emb,
            pos_emb,
            layers: ls,
            lnf_g: next()?,
            lnf_b: next()?,
            lm_w: next()?,
            lm_b: next()?,
        })
    }
}

/// The decoder: configuration, weights (one static arena from [`Graft::alloc`]) and the
/// device's kernels, loaded when it is built and unloaded when it is dropped.
pub struct Decoder<D: Backend> {
    device: D,
    kernels: D::Ops,
    config: DecoderConfig,
    layout: Layout,
    arena: Tensor,
    weights: Weights,
    /// Tensor-parallel: this rank's communicator (`None`: the whole model on one device).
    shard: Option<Arc<dyn Collective>>,
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

/// The per-bucket decoding state: the KV caches (static, `[layers, 2, bucket, ctx, d]` in one
/// arena), the position (an i32 device scalar) and the sampling generator's state (`[4]` u32,
/// see [`crate::philox`]), plus the host's count of steps taken.
pub struct KvState {
    bucket: usize,
    pos: Tensor,
    /// The generator's key and offset (static): sampled steps draw from it and advance it.
    rng: Tensor,
    /// `[bucket]` i32 (static): each row's token limit, the input of a token loop.
    limits: Tensor,
    /// What `limits` holds, so that a launch writes it only when it changes.
    limits_host: Vec<i32>,
    cache: Tensor,
    /// (K, V) views per layer, each `[bucket, ctx, d]`.
    kv: Vec<(Tensor, Tensor)>,
    steps: usize,
    ctx: usize,
    /// Scratch for graft's outputs, reused so replays do not allocate.
    outs: Vec<Output<Meta>>,
}

impl fmt::Debug for KvState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvState")
            .field("bucket", &self.bucket)
            .field("steps", &self.steps)
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

impl KvState {
    /// The bucket (padded batch size) this state serves.
    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// Steps taken since the last reset (the device position, as the host counts it).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Steps the state can take between resets (the context length).
    pub fn capacity(&self) -> usize {
        self.ctx
    }

    /// The position tensor (`[1]` i32 on the device).
    pub fn position(&self) -> &Tensor {
        &self.pos
    }

    /// The sampling generator's state (`[4]` u32 on the device: key lo, key hi, offset lo,
    /// offset hi; see [`crate::philox`]).
    pub fn rng(&self) -> &Tensor {
        &self.rng
    }

    /// Seeds the sampling generator: key `seed`, offset 0 (written synchronously; not inside
    /// a capture). Sampled steps then draw the same numbers however they run (eagerly,
    /// replayed, or in a device loop). A new state starts seeded with 0.
    pub fn seed<D: Device>(&mut self, device: &D, seed: u64) -> Result<()> {
        self.rng.write_u32(device, &rng_words(seed, 0))
    }

    /// The generator's seed and its next step's offset, read from the device.
    pub fn rng_state<D: Device>(&self, device: &D) -> Result<(u64, u64)> {
        let v = self.rng.to_vec_u32(device)?;
        let mut words = [0u32; RNG_WORDS];
        words.copy_from_slice(&v);
        Ok(rng_parts(words))
    }

    /// Starts a new sequence: position 0 (written synchronously; not inside a capture). The
    /// cache needs no clearing: attention reads only rows `0..=pos`, each written first.
    pub fn reset<D: Device>(&mut self, device: &D) -> Result<()> {
        self.pos.write_i32(device, &[0])?;
        self.steps = 0;
        Ok(())
    }

    fn check_room(&self) -> Result<()> {
        if self.steps >= self.ctx {
            return Err(TensorError::ContextFull {
                bucket: self.bucket,
                ctx: self.ctx,
            });
        }
        Ok(())
    }

    /// The cache views to use for buffers a body received: the state's own when the body got
    /// the state's cache in place (a static input always is), else fresh views of `cache`.
    fn views_for<'s>(&'s self, cache: &Buffer) -> Result<Cow<'s, [(Tensor, Tensor)]>> {
        if cache.same_storage(self.cache.buffer()) {
            return Ok(Cow::Borrowed(&self.kv));
        }
        let t = Tensor::from_buffer(cache.clone(), self.cache.shape(), DType::F32)?;
        Ok(Cow::Owned(kv_views(&t)?))
    }
}

/// The (K, V) views per layer of a `[layers, 2, bucket, ctx, d]` cache.
fn kv_views(cache: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
    let &[layers, 2, bucket, ctx, d] = cache.shape() else {
        return Err(TensorError::Config {
            what: "a cache must have the shape [layers, 2, bucket, ctx, d]",
        });
    };
    let per = bucket * ctx * d;
    let shape = [bucket, ctx, d];
    (0..layers)
        .map(|l| {
            Ok((
                cache.view(2 * l * per, &shape)?,
                cache.view((2 * l + 1) * per, &shape)?,
            ))
        })
        .collect()
}

/// A decoder step captured once as a plain graph on the device, without graft's tree: the
/// raw-graph baseline. The graph reads the tokens from [`RawGraph::tokens`] and writes the
/// next tokens back there, so launching it repeatedly decodes. Holds every buffer the step
/// allocated (none may be reused while the graph lives).
pub struct RawGraph<D: Device> {
    device: D,
    graph: D::Graph,
    tokens: Tensor,
    bucket: usize,
    _kept: Vec<Buffer>,
}

impl<D: Device> fmt::Debug for RawGraph<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawGraph")
            .field("bucket", &self.bucket)
            .field("buffers", &self._kept.len())
            .finish_non_exhaustive()
    }
}

impl<D: Device> RawGraph<D> {
    /// The token buffer the graph reads and overwrites (`[bucket]` i32).
    pub fn tokens(&self) -> &Tensor {
        &self.tokens
    }

    /// Launches one step on `state` (the state it was captured with).
    pub fn step(&self, state: &mut KvState) -> Result<()> {
        if state.bucket != self.bucket {
            return Err(TensorError::BucketMismatch {
                tokens: self.bucket,
                state: state.bucket,
            });
        }
        state.check_room()?;
        self.device.launch(CORE, &self.graph)?;
        state.steps += 1;
        Ok(())
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
    fn local_dims(&self) -> (usize, usize) {
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

    fn check_tokens(&self, state: &KvState, tokens: &Tensor) -> Result<()> {
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
    fn check_call(&self, state: &KvState, tokens: &Tensor) -> Result<()> {
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
    fn body_inputs<'s>(&'s self, st: &'s KvState, ins: &[Buffer]) -> Result<BodyInputs<'s>> {
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

    /// Captures one step on `state` as a plain graph with the device's own capture calls (no
    /// tree, no liveness checks): the raw-graph baseline. Memory comes from `alloc` and is
    /// held by the returned graph. `tokens` (`[bucket]` i32) becomes the graph's token buffer:
    /// each launch reads it and writes the next tokens back into it. The capture runs
    /// nothing: the state's position is unchanged.
    pub fn capture_raw<A: Alloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        state: &KvState,
        tokens: &Tensor,
    ) -> Result<RawGraph<D>> {
        let kept = self.capture_open(alloc, state, tokens)?;
        let device = self.device.clone();
        let graph = device.end_capture(CORE)?;
        Ok(RawGraph {
            device,
            graph,
            tokens: tokens.clone(),
            bucket: state.bucket,
            _kept: kept,
        })
    }

    /// Begins a capture and records one step into it (the next tokens copied over `tokens`),
    /// leaving the capture open for the caller to end ([`Device::end_capture`], or
    /// [`Device::end_capture_into`] to update an executable in place); returns the buffers
    /// the step uses, which must outlive the graph. Aborts the capture on error.
    pub fn capture_open<A: Alloc<D> + ?Sized>(
        &self,
        alloc: &mut A,
        state: &KvState,
        tokens: &Tensor,
    ) -> Result<Vec<Buffer>> {
        self.check_tokens(state, tokens)?;
        let device = &self.device;
        device.begin_capture(CORE, CaptureMode::ThreadLocal)?;
        let mut keep = Keep::new(alloc);
        let body = (|| -> Result<()> {
            let next = self.forward(&mut keep, tokens, &state.pos, &self.weights, &state.kv)?;
            device.copy(CORE, tokens.ptr()?, next.ptr()?, tokens.bytes())?;
            Ok(())
        })();
        let kept = keep.into_kept();
        if let Err(e) = body {
            // The body's error is the one to report; the abort only cleans up.
            let _ = device.abort_capture(CORE);
            return Err(e);
        }
        Ok(kept)
    }

    /// Tensor-parallel: sums a partial product over the ranks (nothing on one device).
    fn all_reduce(&self, partial: &Tensor) -> Result<()> {
        match &self.shard {
            Some(comm) => comm.all_reduce_sum(partial),
            None => Ok(()),
        }
    }

    /// The step itself: embed, blocks, final norm, logits, greedy argmax, position + 1.
    fn forward<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
    ) -> Result<Tensor> {
        let logits = self.logits(cx, tokens, pos, w, kv)?;
        ops::argmax_step(
            &self.kernels,
            cx,
            &logits,
            Some(&w.lm_b),
            pos,
            self.config.ctx as i32,
        )
    }

    /// The step, picking the next tokens as `sampling` says: greedy is [`Decoder::forward`]'s
    /// argmax (which leaves the generator `rng` as it is), otherwise a sampling step drawing
    /// from `rng` and advancing it. Position + 1 either way.
    #[allow(clippy::too_many_arguments)]
    fn forward_sampled<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
        rng: &Tensor,
        sampling: Sampling,
    ) -> Result<Tensor> {
        if sampling.is_greedy() {
            return self.forward(cx, tokens, pos, w, kv);
        }
        let logits = self.logits(cx, tokens, pos, w, kv)?;
        let limit = self.config.ctx as i32;
        let k = &self.kernels;
        ops::sample_step(k, cx, &logits, Some(&w.lm_b), pos, rng, limit, sampling)
    }

    /// Embed, blocks, final norm and the LM head's product: the logits `[bucket, vocab]`
    /// (without the LM head's bias, which the token pick adds).
    fn logits<A: Alloc<D> + ?Sized>(
        &self,
        cx: &mut A,
        tokens: &Tensor,
        pos: &Tensor,
        w: &Weights,
        kv: &[(Tensor, Tensor)],
    ) -> Result<Tensor> {
        let c = &self.config;
        let k = &self.kernels;
        let (_, heads) = self.local_dims();
        let first = w
            .layers
            .first()
            .map_or((&w.lnf_g, &w.lnf_b), |l| (&l.ln1_g, &l.ln1_b));
        let (mut x, mut h) = ops::embed_norm(
            k, cx, tokens, &w.tok_emb, &w.pos_emb, pos, first.0, first.1, c.eps,
        )?;
        // Biases ride in the kernel after each product (attention, the residual add + norm,
        // the argmax), so a product is one GEMM; only the MLP's GELU needs its own epilogue.
        for (i, (l, (k_cache, v_cache))) in w.layers.iter().zip(kv).enumerate() {
            let qkv = ops::linear(k, cx, &h, &l.wqkv, None, None, false)?;
            drop(h);
            let a = ops::attention_step(k, cx, &qkv, Some(&l.bqkv), k_cache, v_cache, pos, heads)?;
            drop(qkv);
            let o = ops::linear(k, cx, &a, &l.wo, None, None, false)?;
            drop(a);
            self.all_reduce(&o)?;
            let (x1, h2) = ops::add_norm(k, cx, &x, &o, Some(&l.bo), &l.ln2_g, &l.ln2_b, c.eps)?;
            drop(o);
            let g = ops::linear(k, cx, &h2, &l.w1, Some(&l.b1), None, true)?;
            drop(h2);
            let f = ops::linear(k, cx, &g, &l.w2, None, None, false)?;
            drop(g);
            self.all_reduce(&f)?;
            let (gamma, beta) = match w.layers.get(i + 1) {
                Some(n) => (&n.ln1_g, &n.ln1_b),
                None => (&w.lnf_g, &w.lnf_b),
            };
            (x, h) = ops::add_norm(k, cx, &x1, &f, Some(&l.b2), gamma, beta, c.eps)?;
        }
        drop(x);
        ops::linear(k, cx, &h, &w.lm_w, None, None, false)
    }
}

/// What a decode body reads from its inputs ([`Decoder::body_inputs`]).
struct BodyInputs<'s> {
    tokens: Tensor,
    pos: Tensor,
    weights: Cow<'s, Weights>,
    kv: Cow<'s, [(Tensor, Tensor)]>,
}

/// What graft did in a call that should have returned `expected` outputs (in `outs`), or why
/// it failed.
fn check_outputs(
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
