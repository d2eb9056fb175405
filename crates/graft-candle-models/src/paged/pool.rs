//! [`BlockPool`]: the blocks' reference counts, contents and cache entries, the free blocks
//! in the order they are handed out, and the index of cached full blocks by chained hash.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{BlockTable, CopyOnWrite, PagedError, ROOT, chain};

/// The ids the pools of this process carry, one each.
static POOL_IDS: AtomicU64 = AtomicU64::new(0);

/// The blocks of a paged KV cache and the tables of the sequences using them (see the
/// [module documentation](super)). Every method either does all it says or returns an error
/// and changes nothing.
#[derive(Debug)]
pub struct BlockPool {
    id: u64,
    block_size: u32,
    total: u32,
    /// The blocks handed out at least once, ids `0..blocks.len()`; the ids above it were
    /// never used.
    pub(super) blocks: Vec<Block>,
    /// Free blocks holding nothing cached.
    pub(super) empty: Vec<u32>,
    /// Free cached blocks by the stamp of their freeing: least recently freed first.
    pub(super) evictable: BTreeMap<u64, u32>,
    /// The next freeing's stamp.
    clock: u64,
    /// The cached full blocks by chained hash: `index[h] == b` exactly when block `b`'s
    /// `cached` has hash `h`.
    pub(super) index: HashMap<u64, u32>,
    /// The chained hash: always [`chain`], but for the tests that make it collide.
    pub(super) hash: fn(u64, &[u32]) -> u64,
}

/// One block's host-side state.
#[derive(Debug)]
pub(super) struct Block {
    /// The (table, position) pairs referring to it.
    pub(super) refs: usize,
    /// The tokens whose keys and values it holds (its content), in order.
    pub(super) tokens: Vec<u32>,
    /// Its cache entry, for a full block in the index.
    pub(super) cached: Option<Cached>,
    /// While it is free and cached: its key in `evictable`.
    pub(super) stamp: u64,
}

/// A cached full block's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cached {
    /// Its chained hash (its key in the index).
    pub(super) hash: u64,
    /// The block before it in the table that filled it (`None` for a first block), itself
    /// cached.
    pub(super) parent: Option<u32>,
}

/// What a prompt would take: the cached blocks of its prefix and the blocks it needs besides.
struct Plan {
    /// The cached blocks holding the prompt's leading full blocks.
    hits: Vec<u32>,
    /// Hits now free, which the prompt takes off the free list.
    revived: usize,
    /// The blocks of the rest of the prompt.
    fresh: usize,
}

impl Plan {
    /// The free blocks the prompt takes.
    fn needed(&self) -> usize {
        self.revived + self.fresh
    }
}

impl BlockPool {
    /// A pool of `blocks` blocks (ids `0..blocks`) of `block_size` tokens each, all free.
    /// Its memory grows with the blocks it hands out, not with `blocks`.
    pub fn new(blocks: u32, block_size: u32) -> Result<BlockPool, PagedError> {
        if blocks == 0 || block_size == 0 {
            return Err(PagedError::EmptyPool { blocks, block_size });
        }
        Ok(BlockPool {
            id: POOL_IDS.fetch_add(1, Ordering::Relaxed),
            block_size,
            total: blocks,
            blocks: Vec::new(),
            empty: Vec::new(),
            evictable: BTreeMap::new(),
            clock: 0,
            index: HashMap::new(),
            hash: chain,
        })
    }

    /// The tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The pool's blocks, free or not.
    pub fn blocks(&self) -> u32 {
        self.total
    }

    /// The blocks no table refers to (cached or not): what admission control compares with.
    pub fn free_blocks(&self) -> usize {
        let never_used = self.total as usize - self.blocks.len();
        never_used + self.empty.len() + self.evictable.len()
    }

    /// Whether [`BlockPool::allocate`] of `tokens` would succeed now.
    pub fn can_allocate(&self, tokens: &[u32]) -> bool {
        self.plan(tokens).needed() <= self.free_blocks()
    }

    /// The leading tokens of `tokens` whose blocks [`BlockPool::allocate`] would share now
    /// (its [`BlockTable::cached_tokens`]).
    pub fn cached_prefix(&self, tokens: &[u32]) -> usize {
        self.plan(tokens).hits.len() * self.block_size as usize
    }

    /// A new sequence's table for its prompt `tokens`. Its leading full blocks are shared
    /// with the cached blocks holding the same prefix (never the block of the prompt's last
    /// token: the prefill computes that token, for its logits); the rest are free blocks,
    /// handed out in the pool's order. The device writes the keys and values of the tokens
    /// from [`BlockTable::cached_tokens`] on; its full blocks join the cache as
    /// [`BlockPool::written`] says they are written.
    pub fn allocate(&mut self, tokens: &[u32]) -> Result<BlockTable, PagedError> {
        let plan = self.plan(tokens);
        self.room(plan.needed())?;
        let size = self.block_size as usize;
        let cached = plan.hits.len() * size;
        let mut blocks = plan.hits;
        blocks.reserve(plan.fresh);
        for &b in &blocks {
            self.share(b);
        }
        for chunk in tokens[cached..].chunks(size) {
            // Never refused: `room` counted these blocks.
            let b = self.take()?;
            self.blocks[b as usize].tokens.extend_from_slice(chunk);
            blocks.push(b);
        }
        Ok(BlockTable {
            pool: self.id,
            blocks,
            tokens: tokens.len(),
            cached,
            written: cached,
        })
    }

    /// The device holds the keys and values of `table`'s first `tokens` tokens (or has been
    /// issued their writes, ahead of anything issued later that reads them): the full blocks
    /// among them join the cache, where later prompts with the same prefix find them. Only
    /// what is written is ever shared, so a table freed part way (a sequence preempted or
    /// cancelled during its prefill) leaves no block behind for a prompt to read unwritten.
    /// Saying fewer tokens than before changes nothing; more than the table holds is refused
    /// ([`PagedError::PastTheTable`]).
    pub fn written(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), PagedError> {
        self.check(table)?;
        if tokens > table.tokens {
            return Err(PagedError::PastTheTable {
                written: tokens,
                tokens: table.tokens,
            });
        }
        let size = self.block_size as usize;
        for i in table.written / size..tokens / size {
            let parent = i.checked_sub(1).map(|p| table.blocks[p]);
            self.cache(table.blocks[i], parent);
        }
        table.written = table.written.max(tokens);
        Ok(())
    }

    /// Appends `token` to `table`'s sequence. When its last block is full (or it has none)
    /// the token starts a free block. When its last block is partial and shared with another
    /// table (after [`BlockPool::fork`]), the table gets a free block holding a copy of it
    /// first, and the returned [`CopyOnWrite`] is the copy the device must make before it
    /// writes the token's keys and values; the shared block is left as it was. A block the
    /// token fills joins the cache once [`BlockPool::written`] says the token is written.
    pub fn append(
        &mut self,
        table: &mut BlockTable,
        token: u32,
    ) -> Result<Option<CopyOnWrite>, PagedError> {
        self.check(table)?;
        let size = self.block_size as usize;
        let fill = table.tokens % size;
        let mut copy = None;
        let block = match table.blocks.last_mut() {
            Some(last) if fill > 0 => {
                let src = *last;
                if self.blocks[src as usize].refs > 1 {
                    let dst = self.take()?;
                    self.blocks[dst as usize].tokens = self.blocks[src as usize].tokens.clone();
                    self.blocks[src as usize].refs -= 1;
                    *last = dst;
                    copy = Some(CopyOnWrite { src, dst });
                }
                *last
            }
            _ => {
                let b = self.take()?;
                table.blocks.push(b);
                b
            }
        };
        self.blocks[block as usize].tokens.push(token);
        table.tokens += 1;
        Ok(copy)
    }

    /// A second table sharing every block of `table` (and its tokens): beam search, parallel
    /// sampling, a speculative branch. Takes no free block; the first append to a shared
    /// partial last block copies it (see [`BlockPool::append`]).
    pub fn fork(&mut self, table: &BlockTable) -> Result<BlockTable, PagedError> {
        self.check(table)?;
        for &b in &table.blocks {
            self.blocks[b as usize].refs += 1;
        }
        Ok(BlockTable {
            pool: self.id,
            blocks: table.blocks.clone(),
            tokens: table.tokens,
            cached: table.tokens,
            written: table.written,
        })
    }

    /// Gives `table`'s blocks back. A block no other table refers to becomes free; a cached
    /// one stays cached (a later prompt may revive it) until it is handed out again. A table
    /// of another pool is refused ([`PagedError::ForeignTable`]) and dropped: its blocks stay
    /// held in the pool that made it.
    pub fn free(&mut self, table: BlockTable) -> Result<(), PagedError> {
        self.check(&table)?;
        // Last to first: a block is freed, and so evicted, before its parent.
        for &b in table.blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.refs -= 1;
            if block.refs == 0 {
                if block.cached.is_some() {
                    block.stamp = self.clock;
                    self.evictable.insert(self.clock, b);
                    self.clock += 1;
                } else {
                    self.empty.push(b);
                }
            }
        }
        Ok(())
    }

    /// The cached blocks holding `tokens`' leading full blocks, each checked exactly (its
    /// tokens, and its parent being the previous hit), and what the rest needs.
    fn plan(&self, tokens: &[u32]) -> Plan {
        let size = self.block_size as usize;
        // The block holding the last token is computed, never shared.
        let shareable = tokens.len().saturating_sub(1) / size;
        let mut hits: Vec<u32> = Vec::new();
        let mut hash = ROOT;
        for chunk in tokens.chunks_exact(size).take(shareable) {
            hash = (self.hash)(hash, chunk);
            let parent = hits.last().copied();
            match self.index.get(&hash) {
                Some(&b)
                    if self.blocks[b as usize].tokens == chunk
                        && self.blocks[b as usize]
                            .cached
                            .is_some_and(|c| c.parent == parent) =>
                {
                    hits.push(b);
                }
                _ => break,
            }
        }
        let revived = hits
            .iter()
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count();
        let fresh = tokens.len().div_ceil(size) - hits.len();
        Plan {
            hits,
            revived,
            fresh,
        }
    }

    /// Refuses a call needing `needed` free blocks when fewer are free.
    fn room(&self, needed: usize) -> Result<(), PagedError> {
        let free = self.free_blocks();
        if needed > free {
            return Err(PagedError::OutOfBlocks { needed, free });
        }
        Ok(())
    }

    /// Refuses a table made by another pool.
    fn check(&self, table: &BlockTable) -> Result<(), PagedError> {
        if table.pool != self.id {
            return Err(PagedError::ForeignTable {
                table: table.pool,
                pool: self.id,
            });
        }
        Ok(())
    }

    /// One more reference to the cached block `b`, taking it off the free list if it was
    /// free.
    fn share(&mut self, b: u32) {
        let block = &mut self.blocks[b as usize];
        if block.refs == 0 {
            self.evictable.remove(&block.stamp);
        }
        block.refs += 1;
    }

    /// A free block for new content, referred to once and empty: one holding nothing cached,
    /// else a never used one, else the cached block freed least recently, evicted from the
    /// cache. Changes nothing when none is free.
    fn take(&mut self) -> Result<u32, PagedError> {
        let b = if let Some(b) = self.empty.pop() {
            b
        } else if self.blocks.len() < self.total as usize {
            self.blocks.push(Block {
                refs: 0,
                tokens: Vec::with_capacity(self.block_size as usize),
                cached: None,
                stamp: 0,
            });
            (self.blocks.len() - 1) as u32
        } else if let Some((_, b)) = self.evictable.pop_first() {
            if let Some(entry) = self.blocks[b as usize].cached.take() {
                self.index.remove(&entry.hash);
                tracing::debug!(
                    block = b,
                    hash = entry.hash,
                    "paged kv cache: evicted the least recently freed cached block"
                );
            }
            b
        } else {
            return Err(PagedError::OutOfBlocks { needed: 1, free: 0 });
        };
        let block = &mut self.blocks[b as usize];
        block.refs = 1;
        block.tokens.clear();
        Ok(b)
    }

    /// Caches the full block `b`, whose parent in its table is `parent`, if its parent is
    /// cached (or it has none) and no block holds its hash's place yet.
    fn cache(&mut self, b: u32, parent: Option<u32>) {
        let parent_hash = match parent {
            None => ROOT,
            Some(p) => match self.blocks[p as usize].cached {
                Some(entry) => entry.hash,
                None => return,
            },
        };
        let hash = (self.hash)(parent_hash, &self.blocks[b as usize].tokens);
        if let Entry::Vacant(place) = self.index.entry(hash) {
            place.insert(b);
            self.blocks[b as usize].cached = Some(Cached { hash, parent });
        }
    }
}
