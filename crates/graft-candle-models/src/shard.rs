//! Tensor parallelism, Megatron style: a [`Shard`] is one rank's part of a decoder split over
//! `world` ranks. Attention heads are split (the query, key and value projections by output
//! rows, the output projection by input columns), and so is the MLP (gate and up by rows,
//! down by columns); the norms are replicated, and so are the embedding and the output head
//! unless [`Shard::split_vocab`] splits them by vocabulary rows too. Each block then ends its
//! attention and its MLP with a partial sum that the rank's [`Collective`] sums over all ranks
//! (two all-reduces per block), so every rank holds the whole residual stream; a split
//! vocabulary adds two per step (the embedding's rows, and the logits, each rank's slice in
//! a zeroed row of the whole vocabulary).

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::spec::DecoderSpec;

/// The sum all-reduce a sharded decoder runs after each block's attention and MLP output
/// projections: over NCCL on the GPU ([`graft_candle::cuda::TpComm`], which implements it),
/// or in-process in tests.
pub trait Collective: Send + Sync + fmt::Debug {
    /// Sums `partial` (this rank's part) over all ranks and returns the sum, the same on
    /// every rank. May reduce in place and return `partial` itself. Every rank calls it with
    /// tensors of the same shape, in the same order.
    fn all_reduce_sum(&self, partial: Tensor) -> Result<Tensor>;
}

impl Collective for graft_candle::cuda::TpComm {
    /// Makes `partial` contiguous and sums it in place over NCCL, on candle's stream.
    fn all_reduce_sum(&self, partial: Tensor) -> Result<Tensor> {
        let partial = partial.contiguous()?;
        graft_candle::cuda::TpComm::all_reduce_sum(self, &partial)
            .map_err(candle_core::Error::wrap)?;
        Ok(partial)
    }
}

/// Rank `rank` of `world`: which part of each split weight it loads, and the collective that
/// sums the partial outputs.
#[derive(Clone, Debug)]
pub struct Shard {
    rank: usize,
    world: usize,
    comm: Arc<dyn Collective>,
    /// Whether the embedding and the output head are split by vocabulary rows.
    vocab: bool,
}

impl Shard {
    /// Rank `rank` of `world` ranks, summing over `comm`. Fails unless `rank < world`.
    pub fn new(rank: usize, world: usize, comm: Arc<dyn Collective>) -> Result<Shard> {
        if rank >= world {
            candle_core::bail!("rank {rank} of {world} ranks: the rank must be below the world");
        }
        Ok(Shard {
            rank,
            world,
            comm,
            vocab: false,
        })
    }

    /// The same rank with the embedding and the output head split by vocabulary rows too
    /// (each rank holds `vocab / world` of them; the world must divide the vocabulary): less
    /// memory per rank and half the head's read on two, for two more all-reduces a step
    /// (the embedding's `[batch, hidden]` and the logits' `[batch, vocab]`). Every rank must
    /// choose the same.
    pub fn split_vocab(self) -> Shard {
        Shard {
            vocab: true,
            ..self
        }
    }

    /// Whether the embedding and the output head are split by vocabulary rows.
    pub fn splits_vocab(&self) -> bool {
        self.vocab
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The spec of this rank's part of `spec`: its heads, key/value heads and MLP width
    /// divided by the world. Fails unless the world divides them, and for an output
    /// projection with a bias (which the sum would add `world` times).
    pub(crate) fn local(&self, spec: &DecoderSpec) -> Result<DecoderSpec> {
        let w = self.world;
        if !(spec.heads.is_multiple_of(w)
            && spec.kv_heads.is_multiple_of(w)
            && spec.intermediate.is_multiple_of(w))
        {
            candle_core::bail!(
                "{w} ranks do not divide num_attention_heads ({}), num_key_value_heads ({}) and intermediate_size ({}): use a world that divides all three",
                spec.heads,
                spec.kv_heads,
                spec.intermediate
            );
        }
        if self.vocab && !spec.vocab.is_multiple_of(w) {
            candle_core::bail!(
                "{w} ranks do not divide vocab_size ({}): split the vocabulary over a world that divides it, or leave it whole",
                spec.vocab
            );
        }
        if spec.o_bias {
            candle_core::bail!("tensor parallelism does not split an output projection bias");
        }
        Ok(DecoderSpec {
            heads: spec.heads / w,
            kv_heads: spec.kv_heads / w,
            intermediate: spec.intermediate / w,
            ..spec.clone()
        })
    }

    /// This rank's part of `t` along `dim` (the `rank`-th of `world` equal parts), copied
    /// into a tensor of its own so the whole can be freed.
    pub(crate) fn part(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let n = t.dim(dim)? / self.world;
        t.narrow(dim, self.rank * n, n)?.contiguous()
    }

    /// Sums `partial` over the ranks.
    pub(crate) fn reduce(&self, partial: Tensor) -> Result<Tensor> {
        self.comm.all_reduce_sum(partial)
    }

    /// The rows of `tokens` (`[batch]` u32) of an embedding table split by vocabulary rows,
    /// `part` this rank's (`[vocab / world, hidden]`): each rank gathers the tokens in its
    /// range and zeros for the others, and the ranks' rows are summed. Device ops between
    /// tensors only (a comparison with a host scalar would upload it inside a recording):
    /// the local index is clamped to the part with relus, and a token is this rank's where
    /// the clamp left it unchanged.
    pub(crate) fn embed(&self, part: &Tensor, tokens: &Tensor) -> Result<Tensor> {
        let n = part.dim(0)?;
        let last = (n - 1) as f64;
        // Token ids are below 2^24, so exact in f32.
        let local = tokens
            .to_dtype(DType::F32)?
            .affine(1.0, -((self.rank * n) as f64))?;
        let clamped = local
            .relu()?
            .affine(-1.0, last)?
            .relu()?
            .affine(-1.0, last)?;
        let mine = clamped.eq(&local)?.to_dtype(part.dtype())?;
        let rows = part
            .index_select(&clamped.to_dtype(DType::U32)?, 0)?
            .broadcast_mul(&mine.unsqueeze(1)?)?;
        self.reduce(rows)
    }

    /// The whole vocabulary's logits from this rank's slice (`[..., vocab / world]`, its
    /// rows of a split head): the slice placed in zeros at its offset and the ranks summed
    /// (adding zeros is exact, so every rank gets the same logits a whole head gives).
    pub(crate) fn gather_vocab(&self, local: &Tensor) -> Result<Tensor> {
        let dims = local.dims();
        let n = dims[dims.len() - 1];
        let zeros = |count: usize| {
            let mut shape = dims.to_vec();
            shape[dims.len() - 1] = count;
            Tensor::zeros(shape, local.dtype(), local.device())
        };
        let mut parts = Vec::with_capacity(3);
        if self.rank > 0 {
            parts.push(zeros(self.rank * n)?);
        }
        parts.push(local.clone());
        if self.rank + 1 < self.world {
            parts.push(zeros((self.world - self.rank - 1) * n)?);
        }
        self.reduce(Tensor::cat(&parts, dims.len() - 1)?)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Barrier, Mutex};

    use candle_core::{D, DType, Device};

    use super::*;
    use crate::llama::{self, Sizes};

    /// An in-process all-reduce of threads, one per rank: each puts its part in its slot,
    /// then every rank sums all slots in rank order (the same sum on every rank).
    #[derive(Debug)]
    struct Slots {
        barrier: Barrier,
        parts: Mutex<Vec<Option<Tensor>>>,
    }

    #[derive(Debug)]
    struct ThreadSum {
        rank: usize,
        slots: Arc<Slots>,
    }

    impl Collective for ThreadSum {
        fn all_reduce_sum(&self, partial: Tensor) -> Result<Tensor> {
            self.slots.parts.lock().unwrap()[self.rank] = Some(partial);
            self.slots.barrier.wait();
            let sum = {
                let parts = self.slots.parts.lock().unwrap();
                let mut all = parts.iter().flatten();
                let first = all.next().unwrap().clone();
                all.try_fold(first, |sum, p| sum + p)?
            };
            self.slots.barrier.wait();
            Ok(sum)
        }
    }

    /// `steps` greedy steps of a batch of two from fixed tokens: each step's logits and
    /// tokens.
    fn run(model: &crate::Decoder, steps: usize) -> Vec<(Vec<Vec<f32>>, Vec<u32>)> {
        let cache = model.new_cache(2, 16).unwrap();
        let mut tokens = Tensor::new(&[3u32, 200], model.device()).unwrap();
        (0..steps)
            .map(|_| {
                let logits = model.forward(&cache, &tokens).unwrap();
                tokens = logits.argmax(D::Minus1).unwrap();
                (logits.to_vec2().unwrap(), tokens.to_vec1().unwrap())
            })
            .collect()
    }

    #[test]
    fn two_shards_summed_give_the_whole_models_logits_and_tokens() {
        for split_vocab in [false, true] {
            two_shards(split_vocab);
        }
    }

    /// Two ranks, with the vocabulary split or whole (on `decode_step`'s chain either way),
    /// against the whole model.
    fn two_shards(split_vocab: bool) {
        let (sizes, seed, steps, world) = (Sizes::TINY, 7, 8, 2);
        let whole = llama::random(&sizes, seed, DType::F32, &Device::Cpu).unwrap();
        let expected = run(&whole, steps);
        let slots = Arc::new(Slots {
            barrier: Barrier::new(world),
            parts: Mutex::new(vec![None; world]),
        });
        let ranks: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let comm = Arc::new(ThreadSum {
                        rank,
                        slots: slots.clone(),
                    });
                    s.spawn(move || {
                        let mut shard = Shard::new(rank, world, comm).unwrap();
                        if split_vocab {
                            shard = shard.split_vocab();
                        }
                        let part =
                            llama::random_sharded(&sizes, seed, DType::F32, &Device::Cpu, shard)
                                .unwrap();
                        assert_eq!(part.spec().heads, sizes.heads / world);
                        assert_eq!(part.spec().intermediate, sizes.intermediate / world);
                        let rows = if split_vocab {
                            sizes.vocab / world
                        } else {
                            sizes.vocab
                        };
                        assert_eq!(part.embed.dim(0).unwrap(), rows);
                        // Whole or split, the vocabulary decodes on the chain, with the
                        // sums inside.
                        assert!(part.step.is_some());
                        run(&part, steps)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for got in &ranks {
            for (step, ((want_l, want_t), (got_l, got_t))) in expected.iter().zip(got).enumerate() {
                assert_eq!(
                    want_t, got_t,
                    "tokens of step {step} (vocabulary split: {split_vocab})"
                );
                let diff = want_l
                    .iter()
                    .flatten()
                    .zip(got_l.iter().flatten())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff < 1e-3,
                    "logits of step {step} differ by {diff} (vocabulary split: {split_vocab})"
                );
            }
        }
    }

    #[test]
    fn a_world_that_does_not_divide_the_heads_is_refused() {
        #[derive(Debug)]
        struct Alone;
        impl Collective for Alone {
            fn all_reduce_sum(&self, partial: Tensor) -> Result<Tensor> {
                Ok(partial)
            }
        }
        assert!(Shard::new(3, 3, Arc::new(Alone)).is_err());
        let shard = Shard::new(0, 3, Arc::new(Alone)).unwrap();
        let e = llama::random_sharded(&Sizes::TINY, 1, DType::F32, &Device::Cpu, shard)
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not divide"), "{e}");
    }
}
