//! A [`KvCache`] laid out in pages: keys and values in fixed-size blocks shared by every
//! sequence, each sequence's blocks listed in a block table on the device (a step's input
//! read in place, so one recording serves every table). Where the fused ops find a step's
//! cache slots in either layout ([`Lookup`]).

use std::sync::Mutex;

use candle_core::{Device, Result, Tensor};

use super::KvCache;

/// The paged layout's own state. The cache's tensors are `[blocks + 1, kv_heads,
/// block_size, head_dim]`: block `blocks` is the scratch block, which the table names wherever
/// a sequence has no block (so a write past a sequence's blocks never lands in another's) and
/// which a prefill's padding tokens write.
#[derive(Debug)]
pub(super) struct Pages {
    /// `[max_batch + 1, max_blocks]` u32: each sequence's blocks in order, then the scratch
    /// block; the last row (the scratch row) names only the scratch block.
    table: Tensor,
    block_size: usize,
    /// The blocks sequences may use (the scratch block is the next id).
    blocks: u32,
    /// Per sequence, the blocks its table row names before the scratch block: the host-side
    /// bound of its positions.
    given: Mutex<Vec<u32>>,
}

impl Pages {
    /// The layout of `max_batch` sequences of up to `max_seq` positions over `blocks` blocks
    /// of `block_size` positions, every sequence without a block.
    pub(super) fn new(
        max_batch: usize,
        max_seq: usize,
        blocks: usize,
        block_size: usize,
        device: &Device,
    ) -> Result<Pages> {
        if blocks == 0 || block_size == 0 {
            candle_core::bail!(
                "a paged kv cache needs at least one block of at least one position, got {blocks} blocks of {block_size}"
            );
        }
        let scratch = u32::try_from(blocks)
            .map_err(|_| candle_core::Error::Msg("the block count must fit in a u32".into()))?;
        let max_blocks = max_seq.div_ceil(block_size);
        let table = Tensor::full(scratch, (max_batch + 1, max_blocks), device)?;
        Ok(Pages {
            table,
            block_size,
            blocks: scratch,
            given: Mutex::new(vec![0; max_batch]),
        })
    }

    /// The stored shape of one layer's keys (or values).
    pub(super) fn stored(&self, kv_heads: usize, head_dim: usize) -> (usize, usize, usize, usize) {
        (
            self.blocks as usize + 1,
            kv_heads,
            self.block_size,
            head_dim,
        )
    }

    fn given(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        // Poisoned only by a panic while the guard was held, which leaves plain integers.
        self.given.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The positions sequence `row` has blocks for.
    pub(super) fn room(&self, row: usize) -> usize {
        self.given()[row] as usize * self.block_size
    }

    /// Checks that a step of the sequences at `positions` (rows `0..positions.len()`) writes
    /// only where their blocks are; a row without blocks is idle (it steps over the scratch
    /// block). One lock for the whole batch.
    pub(super) fn check_steps(&self, positions: &[u32]) -> Result<()> {
        let given = self.given();
        positions.iter().enumerate().try_for_each(|(row, &p)| {
            let room = given[row] as usize * self.block_size;
            match room {
                0 => Ok(()),
                _ => check_room(row, room, p as usize + 1),
            }
        })
    }

    pub(super) fn table(&self) -> &Tensor {
        &self.table
    }
}

/// Refuses a write to sequence `row` up to position `end` (exclusive) when its blocks hold
/// `room` positions.
pub(super) fn check_room(row: usize, room: usize, end: usize) -> Result<()> {
    if room >= end {
        return Ok(());
    }
    Err(candle_core::Error::Msg(format!(
        "sequence {row} of the paged kv cache has blocks for {room} positions and the step writes up to position {}: give it more blocks first (KvCache::set_blocks)",
        end - 1
    ))
    .bt())
}

/// Where the fused ops find a step's cache slots: the layout's lookup, with its tensors.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// Static rows: `[n]` u32 rows, or `None` for rows `0..n`.
    Rows(Option<Tensor>),
    /// A paged cache: `[n, max_blocks]` u32, each token's sequence's block table row.
    Pages(Tensor),
}

impl KvCache {
    /// A paged cache's tokens-per-block, `None` for static rows.
    pub fn block_size(&self) -> Option<usize> {
        self.pages.as_ref().map(|p| p.block_size)
    }

    /// A paged cache's blocks (the scratch block not counted), `None` for static rows.
    pub fn blocks(&self) -> Option<usize> {
        self.pages.as_ref().map(|p| p.blocks as usize)
    }

    /// The bytes of one block's keys and values (all layers); `None` for static rows.
    pub fn block_bytes(&self) -> Option<usize> {
        self.pages.as_ref().map(|p| {
            let per_layer = self.k[0].elem_count() / (p.blocks as usize + 1);
            2 * self.k.len() * per_layer * self.k[0].dtype().size_in_bytes()
        })
    }

    /// Gives sequence `row` of a paged cache the blocks `blocks`, in order (its position `p`
    /// is then in block `blocks[p / block_size]`); the rest of its table names the scratch
    /// block. A step may write and read only positions its blocks cover: a step or prefill
    /// past them is refused on the host. A sequence without blocks (every one at first, or
    /// after `set_blocks(row, &[])`) is idle: a decode step of a batch that covers it computes
    /// it over the scratch block, as it does a bucket's padding, and what it gives for it
    /// means nothing. An upload: call it between steps (the table is a step's input, read in
    /// place).
    pub fn set_blocks(&self, row: usize, blocks: &[u32]) -> Result<()> {
        let Some(p) = &self.pages else {
            candle_core::bail!(
                "set_blocks on a kv cache of static rows: make a paged one (Decoder::new_paged_cache)"
            );
        };
        let max_blocks = p.table.dim(1)?;
        let mut given = p.given();
        if row >= given.len() || blocks.len() > max_blocks {
            candle_core::bail!(
                "set_blocks({row}, {} blocks) on a paged kv cache of {} sequences of at most {max_blocks} blocks",
                blocks.len(),
                given.len()
            );
        }
        if let Some(&b) = blocks.iter().find(|&&b| b >= p.blocks) {
            candle_core::bail!(
                "set_blocks({row}, ..) names block {b} of a paged kv cache of {} blocks: name blocks below that",
                p.blocks
            );
        }
        let mut entries = blocks.to_vec();
        entries.resize(max_blocks, p.blocks);
        let entries = Tensor::from_vec(entries, (1, max_blocks), p.table.device())?;
        p.table.slice_set(&entries, 0, row)?;
        given[row] = blocks.len() as u32;
        Ok(())
    }

    /// Copies block `src`'s keys and values into block `dst`, every layer (a device copy,
    /// between steps): the copy-on-write a [`crate::paged::CopyOnWrite`] asks for.
    pub fn copy_block(&self, src: u32, dst: u32) -> Result<()> {
        let Some(p) = &self.pages else {
            candle_core::bail!("copy_block on a kv cache of static rows: make a paged one");
        };
        if src >= p.blocks || dst >= p.blocks {
            candle_core::bail!(
                "copy_block({src}, {dst}) on a paged kv cache of {} blocks",
                p.blocks
            );
        }
        let from = Tensor::new(&[src], p.table.device())?;
        for t in self.k.iter().chain(&self.v) {
            t.slice_set(&t.index_select(&from, 0)?, 0, dst as usize)?;
        }
        Ok(())
    }

    /// Where `n` tokens find their slots: in rows `rows` (`[n]` u32; the scratch row is
    /// `max_batch`), or in rows `0..n` without. Capturable: a paged cache gathers the rows'
    /// table rows on the device.
    pub(crate) fn lookup(&self, rows: Option<&Tensor>, n: usize) -> Result<Lookup> {
        Ok(match (&self.pages, rows) {
            (None, rows) => Lookup::Rows(rows.cloned()),
            (Some(p), Some(rows)) => Lookup::Pages(p.table.index_select(rows, 0)?),
            (Some(p), None) => Lookup::Pages(p.table.narrow(0, 0, n)?),
        })
    }

    /// Layer `layer`'s keys and values as the ops take them with `lookup`: rows `0..n` of a
    /// static cache without rows, else the whole tensors.
    pub(crate) fn layer_at(
        &self,
        layer: usize,
        lookup: &Lookup,
        n: usize,
    ) -> Result<(Tensor, Tensor)> {
        match lookup {
            Lookup::Rows(None) => self.layer(layer, n),
            _ => self.layer_all(layer),
        }
    }

    /// Copies sequence `from`'s table row onto sequence `to` (a paged cache's part of
    /// `move_row`: the keys and values stay in their blocks). Nothing for static rows.
    pub(super) fn move_table_row(&self, from: usize, to: usize) -> Result<()> {
        let Some(p) = &self.pages else {
            return Ok(());
        };
        let row = Tensor::new(&[from as u32], p.table.device())?;
        p.table.slice_set(&p.table.index_select(&row, 0)?, 0, to)?;
        let mut given = p.given();
        given[to] = given[from];
        Ok(())
    }
}
