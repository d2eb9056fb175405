//! The engine on a paged cache ([`Decoder::new_paged_cache`](crate::Decoder::new_paged_cache)):
//! a [`BlockPool`] hands out the blocks, shares the cached blocks of a prompt's prefix (its
//! prefill starts after them), and counts what admission may take. A request is admitted when
//! its prompt's blocks are free; before each decode step every running sequence gets the
//! block its next token needs, and when none is free the newest sequence (the one being
//! prefilled first, then the running one admitted last) is preempted: its blocks go back and
//! it waits at the head of the queue to be prefilled again, prompt and tokens so far, and go
//! on from its next token. A request that fits the cache alone is never failed for blocks.

use super::{Engine, Queued, Request, StepError, model};
use crate::paged::{BlockTable, PagedError};

impl Engine<'_> {
    /// The blocks of `prompt` for an admission: `Some(None)` on static rows, `Some(table)`
    /// when the pool has them, `None` when the request must wait.
    pub(super) fn admit_blocks(
        &mut self,
        prompt: &[u32],
    ) -> Result<Option<Option<BlockTable>>, PagedError> {
        match &mut self.pool {
            None => Ok(Some(None)),
            Some(pool) if pool.can_allocate(prompt) => Ok(Some(Some(pool.allocate(prompt)?))),
            Some(_) => Ok(None),
        }
    }

    /// Gives every running sequence the block its next token's keys and values go to (its
    /// last token, at its position), preempting the newest sequences while none is free. A
    /// sequence's table holds the tokens before its position until it grows (then one more),
    /// so a preemption, which moves the last running sequence into the preempted one's row,
    /// leaves no sequence behind ungrown.
    pub(super) fn grow(&mut self) -> Result<(), StepError> {
        let batch = self.running.len();
        let fail = |e| StepError::Decode {
            batch,
            source: model(e),
        };
        self.note_written()
            .map_err(|e| fail(candle_core::Error::wrap(e)))?;
        loop {
            let positions = self.cache.positions();
            let ungrown = self.running.iter().enumerate().find(|(row, r)| {
                r.table
                    .as_ref()
                    .is_some_and(|t| t.len() <= positions[*row] as usize)
            });
            let (Some((row, _)), Some(pool)) = (ungrown, self.pool.as_mut()) else {
                return Ok(());
            };
            let r = &mut self.running[row];
            let Some(table) = r.table.as_mut() else {
                return Ok(());
            };
            let before = table.blocks().len();
            match pool.append(table, r.last) {
                Ok(copy) => {
                    if let Some(c) = copy {
                        self.cache.copy_block(c.src, c.dst).map_err(fail)?;
                    }
                    if copy.is_some() || table.blocks().len() != before {
                        self.cache.set_blocks(row, table.blocks()).map_err(fail)?;
                    }
                }
                // The newest goes (this sequence itself when it is).
                Err(PagedError::OutOfBlocks { .. }) => self.preempt_newest().map_err(fail)?,
                Err(e) => return Err(fail(candle_core::Error::wrap(e))),
            }
        }
    }

    /// Tells the pool what the steps so far wrote: each running sequence's tokens before its
    /// position (its last token's keys and values come with its next step), so that their
    /// full blocks are cached for later prompts. A prefill's tokens are told after its launch.
    fn note_written(&mut self) -> Result<(), PagedError> {
        let Some(pool) = self.pool.as_mut() else {
            return Ok(());
        };
        let positions = self.cache.positions();
        for (r, &p) in self.running.iter_mut().zip(&positions) {
            if let Some(table) = r.table.as_mut() {
                pool.written(table, p as usize)?;
            }
        }
        Ok(())
    }

    /// Preempts the request being prefilled, or else the running sequence admitted last: its
    /// blocks go back and it waits at the head of the queue.
    fn preempt_newest(&mut self) -> candle_core::Result<()> {
        self.preemptions += 1;
        if let Some(p) = self.prefilling.take() {
            tracing::debug!(
                id = p.request.id,
                "preempted while prefilling: out of kv blocks"
            );
            self.release(p.table, p.row)?;
            self.waiting.push_front(Queued {
                request: p.request,
                made: p.made,
            });
            return Ok(());
        }
        let Some(row) = (0..self.running.len()).max_by_key(|&i| self.running[i].admitted) else {
            return Ok(());
        };
        let r = self.vacate(row)?;
        tracing::debug!(id = r.id, made = r.generated, "preempted: out of kv blocks");
        self.waiting.push_front(Queued {
            request: Request {
                id: r.id,
                prompt: r.history,
                max_new: r.max_new,
                sampling: r.sampling,
            },
            made: r.generated,
        });
        Ok(())
    }

    /// Gives `table`'s blocks back and leaves cache row `row` without blocks (idle).
    pub(super) fn release(
        &mut self,
        table: Option<BlockTable>,
        row: usize,
    ) -> candle_core::Result<()> {
        let (Some(pool), Some(table)) = (&mut self.pool, table) else {
            return Ok(());
        };
        pool.free(table).map_err(candle_core::Error::wrap)?;
        self.cache.set_blocks(row, &[])
    }

    /// The drafts a verify pass of running row `row` may take: on a paged cache, as many as
    /// its blocks hold past its last token (the pass writes them all; the accepted ones join
    /// its table after it, so no block is taken for a draft the pass rejects).
    pub(super) fn draft_room(&self, row: usize) -> usize {
        let position = self.cache.positions()[row] as usize;
        let room = match (&self.pool, &self.running[row].table) {
            (Some(pool), Some(table)) => table.blocks().len() * pool.block_size() as usize,
            _ => self.cache.max_seq(),
        };
        room.saturating_sub(position + 1)
    }

    /// Records the drafts a verify pass of running row `row` accepted in its table (their
    /// keys and values are in its last block, see [`Engine::draft_room`]).
    pub(super) fn accept_drafts(&mut self, row: usize, drafts: &[u32]) -> candle_core::Result<()> {
        let (Some(pool), Some(table)) = (&mut self.pool, self.running[row].table.as_mut()) else {
            return Ok(());
        };
        for &d in drafts {
            // Within the table's last block, which no other table shares: no copy, no block.
            pool.append(table, d).map_err(candle_core::Error::wrap)?;
        }
        Ok(())
    }
}
