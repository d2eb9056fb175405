//! The engine's prefill: admission into a row, and each step's prefill launch. One launch
//! takes the next chunk of the request being prefilled and, after a prompt's last chunk, the
//! first chunks of the next requests as long as each fits whole within the largest bucket's
//! tokens ([`Decoder::prefill_segments`], up to [`PREFILL_SEGMENTS`] of them where the model
//! has the fused attention): prompts whose prefixes are shared blocks, with little left to
//! prefill, share one read of the weights. The requests occupy the rows after the running
//! ones, in order, and join the running ones in that order.

use candle_core::Tensor;

use super::{Engine, Event, Prefilling, Runner, Running, StepError, model};
use crate::paged::BlockTable;
use crate::prefill::{PREFILL_SEGMENTS, PrefillSegment};
use graft_candle_kernels::SampleParams;

impl Engine<'_> {
    /// Takes the request at the head of the queue into cache row `row`, when (on a paged
    /// cache) its prompt's blocks are free: its prefill starts after the blocks its prefix
    /// shares. `None` when nothing is admitted.
    pub(super) fn admit_at(&mut self, row: usize) -> Result<Option<Prefilling>, StepError> {
        let Some(q) = self.waiting.front() else {
            return Ok(None);
        };
        let id = q.request.id;
        let fail = |e| StepError::Prefill {
            id,
            source: model(e),
        };
        let prompt = q.request.prompt.clone();
        let Some(table) = self
            .admit_blocks(&prompt)
            .map_err(|e| fail(candle_core::Error::wrap(e)))?
        else {
            return Ok(None);
        };
        let done = table.as_ref().map_or(0, BlockTable::cached_tokens);
        self.cached_tokens += done;
        if let Some(t) = &table {
            self.cache.set_blocks(row, t.blocks()).map_err(fail)?;
            self.cache.set_position(row, done as u32).map_err(fail)?;
        }
        Ok(self.waiting.pop_front().map(|q| Prefilling {
            request: q.request,
            row,
            done,
            made: q.made,
            table,
        }))
    }

    /// The step's prefill launch (see the module documentation), with at most `limit`
    /// sequences in rows.
    pub(super) fn prefill_chunk(
        &mut self,
        limit: usize,
        events: &mut Vec<Event>,
    ) -> Result<(), StepError> {
        let Some(mut first) = self.prefilling.take() else {
            return Ok(());
        };
        let id = first.request.id;
        let fail = |e| StepError::Prefill {
            id,
            source: model(e),
        };
        // The request being prefilled moves down to the row after the running ones (some
        // may have finished), so that the chunk's requests occupy consecutive rows.
        let row = self.running.len();
        if first.row != row {
            self.cache.move_row(first.row, row).map_err(fail)?;
            if self.pool.is_some() {
                self.cache.set_blocks(first.row, &[]).map_err(fail)?;
            }
            first.row = row;
        }
        let largest = self.config.prefill_buckets.largest();
        let whole = |p: &Prefilling| (p.request.prompt.len() - p.done).min(largest);
        let most = if self.model.fused_attention {
            PREFILL_SEGMENTS
        } else {
            1
        };
        let mut budget = largest - whole(&first);
        let mut parts = vec![first];
        // More requests while the last part ends its prompt and the next's chunk fits whole.
        while parts.len() < most
            && self.running.len() + parts.len() < limit
            && parts
                .last()
                .is_some_and(|p| p.done + whole(p) == p.request.prompt.len())
            && self
                .waiting
                .front()
                .is_some_and(|q| self.left_to_prefill(&q.request.prompt).min(largest) <= budget)
        {
            let row = self.running.len() + parts.len();
            let Some(p) = self.admit_at(row)? else {
                break;
            };
            budget -= whole(&p);
            parts.push(p);
        }
        self.launch(parts, events)
    }

    /// The tokens of `prompt` an admission now would prefill: those after the blocks its
    /// prefix would share.
    fn left_to_prefill(&self, prompt: &[u32]) -> usize {
        prompt.len()
            - self
                .pool
                .as_ref()
                .map_or(0, |pool| pool.cached_prefix(prompt))
    }

    /// Prefills one chunk of each of `parts` (in consecutive rows after the running ones) in
    /// one launch, then moves the requests whose prompts are done to the running ones.
    fn launch(&mut self, parts: Vec<Prefilling>, events: &mut Vec<Event>) -> Result<(), StepError> {
        let id = parts[0].request.id;
        let fail = |e| StepError::Prefill {
            id,
            source: model(e),
        };
        let largest = self.config.prefill_buckets.largest();
        let mut tokens = Vec::new();
        let mut segments = Vec::with_capacity(parts.len());
        for p in &parts {
            let len = (p.request.prompt.len() - p.done).min(largest);
            tokens.extend_from_slice(&p.request.prompt[p.done..p.done + len]);
            segments.push(PrefillSegment {
                row: p.row,
                len,
                sampling: SampleParams {
                    index: p.made as u32,
                    ..p.request.sampling
                },
            });
            // A padded decode step may have stepped this row: put it back where the chunk
            // goes.
            if self.cache.positions()[p.row] as usize != p.done {
                self.cache
                    .set_position(p.row, p.done as u32)
                    .map_err(fail)?;
            }
        }
        let padded = match &self.runner {
            Runner::Eager => tokens,
            Runner::Graft { .. } => graft_candle::pad(&self.config.prefill_buckets, &tokens, 0).1,
        };
        let tokens = Tensor::new(padded.as_slice(), self.model.device()).map_err(fail)?;
        let next = match &mut self.runner {
            Runner::Eager => self
                .model
                .prefill_segments_forward(&self.cache, &segments, &tokens)
                .map_err(model),
            Runner::Graft { graft, prefill, .. } => {
                graft.mark_step_begin();
                self.model
                    .prefill_segments(graft, *prefill, &self.cache, &segments, &tokens)
                    .map(|mut s| s.outputs.remove(0))
            }
        }
        .map_err(|source| StepError::Prefill { id, source })?;
        let next = next.to_vec1::<u32>().map_err(fail)?;
        for ((mut p, segment), first) in parts.into_iter().zip(&segments).zip(next) {
            p.done += segment.len;
            // The launch is issued: later prompts may share the blocks it filled.
            if let (Some(pool), Some(table)) = (self.pool.as_mut(), p.table.as_mut()) {
                pool.written(table, p.done)
                    .map_err(|e| fail(candle_core::Error::wrap(e)))?;
            }
            if p.done < p.request.prompt.len() {
                // The last part only: its prompt goes on next step.
                self.prefilling = Some(p);
                continue;
            }
            self.joined(p, first, events).map_err(fail)?;
        }
        Ok(())
    }

    /// Request `p`, its prompt prefilled and `first` its next token: it finishes, or joins the
    /// running sequences in the row after them.
    fn joined(
        &mut self,
        p: Prefilling,
        first: u32,
        events: &mut Vec<Event>,
    ) -> candle_core::Result<()> {
        let id = p.request.id;
        events.push(Event::Token {
            id,
            token: first,
            index: p.made,
        });
        if p.made + 1 >= p.request.max_new || self.config.eos.contains(&first) {
            events.push(Event::Finished { id });
            return self.release(p.table, p.row);
        }
        let row = self.running.len();
        if p.row != row {
            self.cache.move_row(p.row, row)?;
            if self.pool.is_some() {
                self.cache.set_blocks(p.row, &[])?;
            }
        }
        let mut history = p.request.prompt;
        history.push(first);
        self.admissions += 1;
        self.running.push(Running {
            id,
            last: first,
            generated: p.made + 1,
            max_new: p.request.max_new,
            sampling: p.request.sampling,
            history,
            draft: None,
            table: p.table,
            admitted: self.admissions,
        });
        Ok(())
    }
}
