//! Where the decode ops find each sequence's cache positions. A cache is `[blocks, kv_heads,
//! block_size, head_dim]`; sequence b's position p lives in block `table[b][p / block_size]`
//! at offset `p % block_size` (a paged cache, its table `[batch, max_blocks]` u32). A static
//! cache is the case of one block per sequence: its max_seq is the block size, and its rows
//! (or, without rows, each sequence's own row b) are the table. The CUDA kernels find the
//! same place (the cache write through `graft_cache_place` in the kernels' prelude; the
//! attention by looking each chunk's blocks up once and adding the offset), so one kernel of
//! each serves both layouts.

use candle_core::{Result, Tensor};

use crate::{KernelError, check};

/// How an op's caller says where each sequence's positions are.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lookup<'a> {
    /// A static cache `[rows, kv_heads, max_seq, head_dim]`: `[batch]` u32 rows, or `None`
    /// (sequence b in row b; the cache then has `batch` rows).
    Rows(Option<&'a Tensor>),
    /// A paged cache: the block table, `[batch, max_blocks]` u32.
    Pages(&'a Tensor),
}

impl<'a> Lookup<'a> {
    /// The table the kernels read (rows are a table of one block per sequence).
    pub(crate) fn table(self) -> Option<&'a Tensor> {
        match self {
            Lookup::Rows(rows) => rows,
            Lookup::Pages(table) => Some(table),
        }
    }

    /// The index of `cache` (`[blocks, kv_heads, block_size, head_dim]`, its rank checked by
    /// the caller) for `batch` sequences, the table checked (u32 on `like`'s device,
    /// contiguous, its shape; without rows the cache has a row per sequence, else at least
    /// one).
    pub(crate) fn index(
        self,
        op: &'static str,
        like: &Tensor,
        cache: &Tensor,
        batch: usize,
    ) -> Result<Index> {
        let (blocks, block_size) = (cache.dims()[0], cache.dims()[2]);
        if blocks == 0 && !matches!(self, Lookup::Rows(None)) {
            return Err(check::shape(
                op,
                "k_cache",
                cache,
                "[rows or blocks, kv_heads, max_seq or block_size, head_dim], with rows or blocks",
            ));
        }
        let (max_blocks, paged) = match self {
            Lookup::Rows(None) => {
                if blocks != batch {
                    return Err(check::shape(
                        op,
                        "k_cache",
                        cache,
                        "[batch (or any rows, with rows), kv_heads, max_seq, head_dim]",
                    ));
                }
                (1, false)
            }
            Lookup::Rows(Some(rows)) => {
                check::indices(op, "rows", rows, like)?;
                if rows.dims() != [batch] {
                    return Err(check::shape(op, "rows", rows, "[batch]"));
                }
                check::contiguous(op, "rows", rows)?;
                (1, false)
            }
            Lookup::Pages(table) => {
                check::indices(op, "the block table", table, like)?;
                let &[b, max_blocks] = table.dims() else {
                    return Err(check::shape(
                        op,
                        "the block table",
                        table,
                        "[batch, max_blocks]",
                    ));
                };
                if b != batch || max_blocks == 0 {
                    return Err(check::shape(
                        op,
                        "the block table",
                        table,
                        "[batch, max_blocks], max_blocks > 0",
                    ));
                }
                check::contiguous(op, "the block table", table)?;
                (max_blocks, true)
            }
        };
        Ok(Index {
            max_blocks,
            blocks,
            block_size,
            paged,
        })
    }
}

/// The sizes of a cache lookup (the op holds the table itself).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Index {
    /// Block ids per sequence (1 for a static cache).
    pub(crate) max_blocks: usize,
    /// The caches' blocks (dim 0: a static cache's rows).
    pub(crate) blocks: usize,
    /// Positions per block (dim 2: a static cache's max_seq).
    pub(crate) block_size: usize,
    /// Whether the table is a paged cache's (its errors name blocks, not rows; the attention
    /// looks each position up).
    pub(crate) paged: bool,
}

impl Index {
    /// Positions a sequence may use: `max_blocks * block_size`.
    pub(crate) fn max_seq(&self) -> usize {
        self.max_blocks * self.block_size
    }

    /// The cache row (of head_dim elements) of KV head `h` (of `kv_heads`) at position `p`
    /// (below [`Index::max_seq`]) of sequence `b`, on the host: `table` is the op's table as
    /// a vector (`None`: sequence b's own block b). An error where the table names a block
    /// past the cache.
    pub(crate) fn place(
        &self,
        op: &'static str,
        table: Option<&[u32]>,
        b: usize,
        p: usize,
        kv_heads: usize,
        h: usize,
    ) -> std::result::Result<usize, KernelError> {
        let block = match table {
            None => b,
            Some(t) => {
                let id = t[b * self.max_blocks + p / self.block_size];
                if id as usize >= self.blocks {
                    return Err(if self.paged {
                        KernelError::BlockPastCache {
                            op,
                            sequence: b,
                            block: id,
                            blocks: self.blocks,
                        }
                    } else {
                        KernelError::RowPastCache {
                            op,
                            query: b,
                            row: id,
                            rows: self.blocks,
                        }
                    });
                }
                id as usize
            }
        };
        Ok((block * kv_heads + h) * self.block_size + p % self.block_size)
    }
}
