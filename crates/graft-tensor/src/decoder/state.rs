//! The per-bucket decoding state ([`KvState`]): KV caches, device position, the sampling
//! generator's state and the host's count of steps.

use std::borrow::Cow;
use std::fmt;

use graft_core::{Buffer, Device, Output};

use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::philox::{RNG_WORDS, rng_parts, rng_words};
use crate::tensor::{Meta, Tensor};

/// The per-bucket decoding state: the KV caches (static, `[layers, 2, bucket, ctx, d]` in one
/// arena), the position (an i32 device scalar) and the sampling generator's state (`[4]` u32,
/// see [`crate::philox`]), plus the host's count of steps taken.
pub struct KvState {
    pub(super) bucket: usize,
    pub(super) pos: Tensor,
    /// The generator's key and offset (static): sampled steps draw from it and advance it.
    pub(super) rng: Tensor,
    /// `[bucket]` i32 (static): each row's token limit, the input of a token loop.
    pub(super) limits: Tensor,
    /// What `limits` holds, so that a launch writes it only when it changes.
    pub(super) limits_host: Vec<i32>,
    pub(super) cache: Tensor,
    /// (K, V) views per layer, each `[bucket, ctx, d]`.
    pub(super) kv: Vec<(Tensor, Tensor)>,
    pub(super) steps: usize,
    pub(super) ctx: usize,
    /// Scratch for graft's outputs, reused so replays do not allocate.
    pub(super) outs: Vec<Output<Meta>>,
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

    pub(super) fn check_room(&self) -> Result<()> {
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
    pub(super) fn views_for<'s>(&'s self, cache: &Buffer) -> Result<Cow<'s, [(Tensor, Tensor)]>> {
        if cache.same_storage(self.cache.buffer()) {
            return Ok(Cow::Borrowed(&self.kv));
        }
        let t = Tensor::from_buffer(cache.clone(), self.cache.shape(), DType::F32)?;
        Ok(Cow::Owned(kv_views(&t)?))
    }
}

/// The (K, V) views per layer of a `[layers, 2, bucket, ctx, d]` cache.
pub(super) fn kv_views(cache: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
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
