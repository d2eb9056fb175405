//! A continuous-batching serving loop over one ported [`Decoder`] and its serving
//! [`KvCache`]: requests join and leave at every step, prompts are prefilled in chunks padded
//! to token-count buckets, running sequences decode together in a batch padded to a batch
//! bucket, and under graft every prefill bucket and every decode bucket is one recorded path
//! of the same tree.
//!
//! Every call starts a step of graft's tree (`mark_step_begin`): a prefill chunk and a decode
//! step are each a root path of the tree, so each bucket records once. Without it a call
//! would record as the child of whichever call ran before it in the same step, one graph per
//! pair of buckets. Nothing is invalidated by it: every output is the caller's own tensor.
//!
//! The running sequences live in cache rows `0..n`, in the order of [`Engine`]'s list; when
//! one finishes, the last moves into its row (a device copy of its keys and values). The
//! request being prefilled lives in row `n` (or above, after finishes) and joins the batch
//! when its last chunk gives its first token. A padded decode step also steps the idle rows
//! above `n`: their keys and values are never read, and the prefilling row's position is
//! set back before its next chunk.
//!
//! On a paged cache ([`Decoder::new_paged_cache`]) a row holds a block table instead of keys
//! and values: moving a sequence moves its table row, a prompt shares the cached blocks of
//! its prefix, and admission and preemption count blocks (`pages.rs`).
//!
//! With [`ServeConfig::speculate`], the running sequences take verify passes of their drafts
//! (prompt lookup or a draft model) instead of decode steps (`speculate.rs`): the same
//! tokens, up to k + 1 a sequence a step.

mod error;
mod pages;
mod plan;
mod prefill;
mod speculate;

use std::collections::VecDeque;

use candle_core::{DType, Tensor};

use graft_candle::{Buckets, CandleGraft, Error, StepId, StepOutcome};
use graft_candle_kernels::SAMPLE_WORDS;
pub use graft_candle_kernels::SampleParams;

use crate::paged::{BlockPool, BlockTable};
use crate::speculate::{AdaptiveDraft, DraftError, DraftModel, DraftRow, VerifyRow};
use crate::{Decoder, KvCache};

pub use error::{Refused, Rejected, StepError};
pub use plan::plan;
pub use plan::{MemoryPlan, kv_rows};
pub use speculate::Speculate;

/// A request: generate up to `max_new` tokens after `prompt`, each picked by `sampling`.
#[derive(Clone, PartialEq, Debug)]
pub struct Request {
    /// Yours; events name it.
    pub id: u64,
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// How many tokens to generate at most (an end token stops sooner).
    pub max_new: usize,
    /// How each token is picked, on the device, inside the recorded step: requests that
    /// sample differently share a batch and its recording. Its `index` is ignored: the
    /// engine sets it to the token's number, so a seed gives the same tokens whatever runs
    /// beside the request (as far as the kernels are batch-invariant).
    pub sampling: SampleParams,
}

/// What the engine does with requests.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Batch sizes decode steps are padded to; a batch above the largest runs eagerly at its
    /// real size (graft's `AboveLargestBucket`). At most the cache's sequences.
    pub decode_buckets: Buckets,
    /// Token counts prefill chunks are padded to; a longer prompt is prefilled in chunks of
    /// the largest. At most the cache's `max_seq`.
    pub prefill_buckets: Buckets,
    /// Tokens that end a sequence (none: sequences end at their `max_new`).
    pub eos: Vec<u32>,
    /// At most this many sequences decode at once (`None`: as many as the cache holds).
    /// Requests beyond wait in the queue.
    pub max_running: Option<usize>,
    /// Speculative decoding of the running sequences (`None`: off): see [`Speculate`].
    pub speculate: Option<Speculate>,
}

/// What a step produced.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Event {
    /// Request `id`'s token number `index` (0 is the first, from its prefill).
    Token { id: u64, token: u32, index: usize },
    /// Request `id` is done; its row is free.
    Finished { id: u64 },
}

/// How steps run.
#[derive(Debug)]
enum Runner {
    /// candle eager at the real sizes: no padding.
    Eager,
    /// graft-candle, padded to the buckets.
    Graft {
        graft: Box<CandleGraft>,
        prefill: StepId,
        decode: StepId,
        /// Speculation's verify pass, one recording per decode bucket and draft count.
        verify: StepId,
        /// Speculation's rounds with a draft model (its steps and the verify pass), one
        /// recording per decode bucket and draft count.
        round: StepId,
    },
}

/// A request waiting for a row (and, on a paged cache, for its prompt's blocks).
#[derive(Debug)]
struct Queued {
    /// As submitted, or, after a preemption, with the tokens it made appended to its prompt.
    request: Request,
    /// The tokens it made before a preemption: its next token's number.
    made: usize,
}

#[derive(Debug)]
struct Prefilling {
    request: Request,
    row: usize,
    done: usize,
    /// The tokens made before a preemption.
    made: usize,
    /// Its blocks, on a paged cache.
    table: Option<BlockTable>,
}

#[derive(Debug)]
struct Running {
    id: u64,
    last: u32,
    /// The next token's number (tokens made so far).
    generated: usize,
    max_new: usize,
    sampling: SampleParams,
    /// The prompt and every token made: prompt lookup's text, and a preempted sequence's
    /// prompt.
    history: Vec<u32>,
    /// The draft count's chooser, made when the sequence first speculates.
    draft: Option<AdaptiveDraft>,
    /// Its blocks, on a paged cache: every token before `last`, then `last` once a decode
    /// step's blocks are given ([`Engine::grow`]).
    table: Option<BlockTable>,
    /// The engine's admission count when it was admitted: preemption takes the newest.
    admitted: u64,
}

/// A continuous-batching engine (see the module documentation).
#[derive(Debug)]
pub struct Engine<'m> {
    model: &'m Decoder,
    cache: KvCache,
    runner: Runner,
    config: ServeConfig,
    waiting: VecDeque<Queued>,
    prefilling: Option<Prefilling>,
    running: Vec<Running>,
    /// A paged cache's blocks (`None` on static rows).
    pool: Option<BlockPool>,
    /// Admissions so far.
    admissions: u64,
    /// Prompt tokens whose keys and values shared blocks held at admission.
    cached_tokens: usize,
    /// Preemptions so far.
    preemptions: usize,
    /// Speculation's drafts from a smaller model instead of prompt lookup.
    draft_model: Option<DraftModel<'m>>,
}

/// Wraps a candle error from the engine's own bookkeeping.
fn model(source: candle_core::Error) -> Error {
    Error::Model { source }
}

impl<'m> Engine<'m> {
    /// An engine that runs every step with candle eagerly, at the real batch and chunk sizes.
    pub fn eager(
        model: &'m Decoder,
        cache: KvCache,
        config: ServeConfig,
    ) -> Result<Engine<'m>, Error> {
        Engine::new(model, cache, Runner::Eager, config)
    }

    /// An engine that runs every step under `graft`, padded to the buckets: it registers a
    /// `prefill`, a `decode`, a `verify` and a `round` step (speculation's, used only when it
    /// is on).
    pub fn graphed(
        model: &'m Decoder,
        cache: KvCache,
        mut graft: CandleGraft,
        config: ServeConfig,
    ) -> Result<Engine<'m>, Error> {
        let prefill = graft.register_bucketed("prefill", config.prefill_buckets.clone());
        let decode = graft.register_bucketed("decode", config.decode_buckets.clone());
        let verify = graft.register_bucketed("verify", config.decode_buckets.clone());
        let round = graft.register_bucketed("round", config.decode_buckets.clone());
        let runner = Runner::Graft {
            graft: Box::new(graft),
            prefill,
            decode,
            verify,
            round,
        };
        Engine::new(model, cache, runner, config)
    }

    fn new(
        model: &'m Decoder,
        cache: KvCache,
        runner: Runner,
        config: ServeConfig,
    ) -> Result<Engine<'m>, Error> {
        check_fits(&cache, &config)?;
        let pool = pool_of(&cache)?;
        Ok(Engine {
            model,
            cache,
            runner,
            config,
            waiting: VecDeque::new(),
            prefilling: None,
            running: Vec::new(),
            pool,
            admissions: 0,
            cached_tokens: 0,
            preemptions: 0,
            draft_model: None,
        })
    }

    /// Speculation ([`ServeConfig::speculate`]) drafts with `draft`, a smaller model of the
    /// same vocabulary, instead of prompt lookup: its greedy continuation of the sequence
    /// (see [`DraftModel`]). Eager: the draft's steps are not recorded. Put what its steps
    /// cost into [`Speculate::pass_costs`] ([`Speculate::draft_model`]).
    pub fn draft_with(&mut self, draft: &'m Decoder) -> Result<(), DraftError> {
        let vocab = self.model.spec().vocab;
        let (slots, max_seq) = (self.cache.max_batch(), self.cache.max_seq());
        self.draft_model = Some(DraftModel::new(draft, vocab, slots, max_seq)?);
        Ok(())
    }

    /// The cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// graft-candle underneath (`None` for an eager engine).
    pub fn graft(&self) -> Option<&CandleGraft> {
        match &self.runner {
            Runner::Graft { graft, .. } => Some(graft),
            Runner::Eager => None,
        }
    }

    /// Requests not finished: waiting, being prefilled or running.
    pub fn pending(&self) -> usize {
        self.waiting.len() + usize::from(self.prefilling.is_some()) + self.running.len()
    }

    /// Sequences decoding now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// On a paged cache, the prompt tokens admitted so far whose keys and values were
    /// already in shared blocks (their prefill was skipped); 0 on static rows.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// On a paged cache, the sequences preempted so far for want of blocks (each prefilled
    /// again later); 0 on static rows.
    pub fn preemptions(&self) -> usize {
        self.preemptions
    }

    /// Queues `request`, or gives it back with the reason it can never be served.
    pub fn submit(&mut self, request: Request) -> Result<(), Box<Refused>> {
        let max_seq = self.cache.max_seq();
        let (id, prompt, max_new) = (request.id, request.prompt.len(), request.max_new);
        let s = request.sampling;
        let why = if prompt == 0 {
            Some(Rejected::EmptyPrompt { id })
        } else if !s.temperature.is_finite() || s.top_p.is_nan() {
            Some(Rejected::BadSampling {
                id,
                temperature: s.temperature,
                top_p: s.top_p,
            })
        } else if max_new == 0 {
            Some(Rejected::NothingToGenerate { id })
        } else if prompt + max_new - 1 > max_seq {
            // The last token generated is never written to the cache: it needs one less.
            Some(Rejected::TooLong {
                id,
                prompt,
                max_new,
                needed: prompt + max_new - 1,
                max_seq,
            })
        } else {
            self.pool.as_ref().and_then(|pool| {
                let size = pool.block_size() as usize;
                let needed = (prompt + max_new - 1).div_ceil(size);
                (needed > pool.blocks() as usize).then_some(Rejected::MoreThanTheCache {
                    id,
                    needed,
                    blocks: pool.blocks() as usize,
                    block_size: size,
                })
            })
        };
        match why {
            Some(why) => Err(Box::new(Refused { why, request })),
            None => {
                self.waiting.push_back(Queued { request, made: 0 });
                Ok(())
            }
        }
    }

    /// Drops request `id` wherever it is (waiting, being prefilled or running), freeing its
    /// cache row at once; no event follows. Returns whether it was there. A client that goes
    /// away calls this.
    pub fn cancel(&mut self, id: u64) -> Result<bool, StepError> {
        let fail = |e| StepError::Cancel {
            id,
            source: model(e),
        };
        if let Some(at) = self.waiting.iter().position(|q| q.request.id == id) {
            self.waiting.remove(at);
            return Ok(true);
        }
        if self.prefilling.as_ref().is_some_and(|p| p.request.id == id)
            && let Some(p) = self.prefilling.take()
        {
            // Its row is above the running ones: nothing to move.
            self.release(p.table, p.row).map_err(fail)?;
            return Ok(true);
        }
        let Some(row) = self.running.iter().position(|r| r.id == id) else {
            return Ok(false);
        };
        self.vacate(row).map_err(fail)?;
        Ok(true)
    }

    /// Takes running row `row` out: the last running row moves into it, its blocks (on a
    /// paged cache) go back and the row left behind is idle. Returns the sequence.
    fn vacate(&mut self, row: usize) -> candle_core::Result<Running> {
        let last = self.running.len() - 1;
        self.cache.move_row(last, row)?;
        let mut gone = self.running.swap_remove(row);
        self.release(gone.table.take(), last)?;
        Ok(gone)
    }

    /// Under graft, records every prefill and decode bucket now (and, with speculation, a
    /// verify pass of every decode bucket and draft count), with dummy tokens from position 0,
    /// so that no request waits for a recording; then starts every sequence of the cache
    /// over. Returns the calls made. The engine must be idle.
    pub fn capture(&mut self) -> Result<usize, Error> {
        if self.pending() > 0 {
            return Err(model(candle_core::Error::Msg(
                "capture while requests are pending: capture before serving".into(),
            )));
        }
        let Runner::Graft {
            graft,
            prefill,
            decode,
            verify,
            round,
        } = &mut self.runner
        else {
            return Ok(0);
        };
        let device = self.model.device().clone();
        // On a paged cache the prefills record in row 0 over the first blocks, whose cached
        // prefixes (from earlier requests) they overwrite: the pool starts over.
        if let Some(size) = self.cache.block_size() {
            let blocks = self.config.prefill_buckets.largest().div_ceil(size) as u32;
            let ids: Vec<u32> = (0..blocks).collect();
            self.cache.set_blocks(0, &ids).map_err(model)?;
            self.pool = pool_of(&self.cache)?;
        }
        let mut calls = 0;
        for &bucket in self.config.prefill_buckets.sizes() {
            let tokens = Tensor::zeros(bucket, DType::U32, &device).map_err(model)?;
            calls += until_recorded(|| {
                self.cache.reset().map_err(model)?;
                graft.mark_step_begin();
                self.model
                    .prefill(
                        graft,
                        *prefill,
                        &self.cache,
                        0,
                        &tokens,
                        bucket,
                        SampleParams::GREEDY,
                    )
                    .map(|s| s.outcome)
            })?;
        }
        for &bucket in self.config.decode_buckets.sizes() {
            let tokens = Tensor::zeros(bucket, DType::U32, &device).map_err(model)?;
            let greedy = SampleParams::GREEDY.words().repeat(bucket);
            let params =
                Tensor::from_vec(greedy, (bucket, SAMPLE_WORDS), &device).map_err(model)?;
            calls += until_recorded(|| {
                self.cache.reset().map_err(model)?;
                graft.mark_step_begin();
                self.model
                    .decode_sampled(graft, *decode, &self.cache, &tokens, &params)
                    .map(|s| s.outcome)
            })?;
        }
        // Speculation's passes: a sequence in row 0 (the others padding) at every width, with
        // the draft model's steps where it runs rounds.
        let max_draft = self.config.speculate.as_ref().map_or(0, |s| s.max_draft);
        let mut draft = self.draft_model.as_mut().filter(|d| d.runs_rounds());
        for &bucket in self.config.decode_buckets.sizes() {
            for width in 2..=max_draft + 1 {
                let tokens = vec![0u32; width];
                calls += until_recorded(|| {
                    self.cache.reset().map_err(model)?;
                    graft.mark_step_begin();
                    if let Some(d) = draft.as_deref_mut() {
                        // The round's sequence: two tokens so far.
                        self.cache.set_position(0, 1).map_err(model)?;
                        let row = [DraftRow {
                            row: 0,
                            history: &tokens[..2],
                            drafts: width - 1,
                            sampling: SampleParams::GREEDY,
                        }];
                        return d
                            .round(
                                graft,
                                *round,
                                self.model,
                                &self.cache,
                                &row,
                                (bucket, width),
                            )
                            .map(|pass| pass.outcome);
                    }
                    let row = [VerifyRow {
                        row: 0,
                        tokens: &tokens,
                        sampling: SampleParams::GREEDY,
                    }];
                    self.model
                        .verify_rows(graft, *verify, &self.cache, &row, (bucket, width))
                        .map(|pass| pass.outcome)
                })?;
            }
        }
        self.cache.reset().map_err(model)?;
        if self.cache.block_size().is_some() {
            self.cache.set_blocks(0, &[]).map_err(model)?;
        }
        Ok(calls)
    }

    /// One step: a decode step of the running sequences (if any), then prefill chunks of the
    /// requests at the head of the queue (if rows are free): the first's next chunk, and,
    /// after a prompt's last chunk, the next request's while the step's chunks stay within
    /// the largest prefill bucket's tokens. Returns the tokens made and the requests finished.
    pub fn step(&mut self) -> Result<Vec<Event>, StepError> {
        let mut events = Vec::new();
        let limit = self
            .config
            .max_running
            .map_or(self.cache.max_batch(), |m| m.min(self.cache.max_batch()));
        self.grow()?;
        if self.prefilling.is_none() && self.running.len() < limit {
            let row = self.running.len();
            self.prefilling = self.admit_at(row)?;
        }
        if !self.running.is_empty() {
            self.speculate(&mut events)?;
        }
        if self.prefilling.is_some() {
            self.prefill_chunk(limit, &mut events)?;
        }
        Ok(events)
    }

    fn decode(&mut self, events: &mut Vec<Event>) -> Result<(), StepError> {
        let n = self.running.len();
        let rows: Vec<u32> = self.running.iter().map(|r| r.last).collect();
        let (batch, padded) = match &self.runner {
            Runner::Eager => (n, rows),
            Runner::Graft { .. } => graft_candle::pad(&self.config.decode_buckets, &rows, 0),
        };
        let fail = |source| StepError::Decode { batch, source };
        // Each row's sampling at its next token's number; padding rows greedy.
        let mut params = Vec::with_capacity(batch * SAMPLE_WORDS);
        for r in &self.running {
            let at = SampleParams {
                index: r.generated as u32,
                ..r.sampling
            };
            params.extend(at.words());
        }
        params.resize(batch * SAMPLE_WORDS, 0);
        for row in params.chunks_exact_mut(SAMPLE_WORDS).skip(n) {
            row.copy_from_slice(&SampleParams::GREEDY.words());
        }
        // Idle rows a padded step covers advance with it: start any that would overflow over
        // (the row being prefilled never does: its position is below its prompt's length).
        let max_seq = self.cache.max_seq() as u32;
        for (row, &p) in self
            .cache
            .positions()
            .iter()
            .enumerate()
            .take(batch)
            .skip(n)
        {
            if p >= max_seq {
                self.cache
                    .set_position(row, 0)
                    .map_err(|e| fail(model(e)))?;
            }
        }
        let device = self.model.device();
        let tokens = Tensor::new(padded.as_slice(), device).map_err(|e| fail(model(e)))?;
        let params =
            Tensor::from_vec(params, (batch, SAMPLE_WORDS), device).map_err(|e| fail(model(e)))?;
        let next = match &mut self.runner {
            Runner::Eager => self
                .model
                .sample(&self.cache, &tokens, &params)
                .map_err(model),
            Runner::Graft { graft, decode, .. } => {
                graft.mark_step_begin();
                self.model
                    .decode_sampled(graft, *decode, &self.cache, &tokens, &params)
                    .map(|mut s| s.outputs.remove(0))
            }
        }
        .map_err(fail)?;
        let next = next.to_vec1::<u32>().map_err(|e| fail(model(e)))?;
        for (r, &token) in self.running.iter_mut().zip(&next) {
            r.made(token, events);
        }
        self.retire(events).map_err(|e| fail(model(e)))
    }

    /// Finished sequences leave; the last running row fills each hole (highest first, so a
    /// moved row is never one that still has to leave).
    fn retire(&mut self, events: &mut Vec<Event>) -> candle_core::Result<()> {
        for row in (0..self.running.len()).rev() {
            let r = &self.running[row];
            if r.generated >= r.max_new || self.config.eos.contains(&r.last) {
                events.push(Event::Finished { id: r.id });
                self.vacate(row)?;
            }
        }
        Ok(())
    }
}

/// The block pool of a paged cache (`None` on static rows).
fn pool_of(cache: &KvCache) -> Result<Option<BlockPool>, Error> {
    let (Some(blocks), Some(size)) = (cache.blocks(), cache.block_size()) else {
        return Ok(None);
    };
    let fits = |n: usize| u32::try_from(n).map_err(|e| model(candle_core::Error::wrap(e)));
    BlockPool::new(fits(blocks)?, fits(size)?)
        .map(Some)
        .map_err(|e| model(candle_core::Error::wrap(e)))
}

/// The buckets must fit the cache.
fn check_fits(cache: &KvCache, config: &ServeConfig) -> Result<(), Error> {
    let (rows, max_seq) = (cache.max_batch(), cache.max_seq());
    if config.decode_buckets.largest() > rows {
        return Err(model(candle_core::Error::Msg(format!(
            "the largest decode bucket ({}) exceeds the kv cache's {rows} sequences: lower it or plan a larger cache",
            config.decode_buckets.largest()
        ))));
    }
    if let (Some(blocks), Some(size)) = (cache.blocks(), cache.block_size())
        && blocks * size < config.prefill_buckets.largest()
    {
        return Err(model(candle_core::Error::Msg(format!(
            "the paged kv cache's {blocks} blocks of {size} positions hold fewer than the largest prefill bucket ({}), which `capture` records in one sequence: give the cache more blocks or lower the bucket",
            config.prefill_buckets.largest()
        ))));
    }
    if config.prefill_buckets.largest() > max_seq {
        return Err(model(candle_core::Error::Msg(format!(
            "the largest prefill bucket ({}) exceeds the kv cache's max_seq ({max_seq}): lower it",
            config.prefill_buckets.largest()
        ))));
    }
    Ok(())
}

/// Calls `call` until it records or replays (at most 4 calls: warmups first); returns the
/// calls made.
fn until_recorded(mut call: impl FnMut() -> Result<StepOutcome, Error>) -> Result<usize, Error> {
    for calls in 1..=4 {
        let outcome = call()?;
        if matches!(
            outcome,
            StepOutcome::Recorded(_) | StepOutcome::Replayed(_) | StepOutcome::Eager(_)
        ) {
            return Ok(calls);
        }
    }
    Ok(4)
}
