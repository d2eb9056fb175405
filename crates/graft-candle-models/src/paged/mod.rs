//! The host-side bookkeeping of a paged KV cache with prefix sharing: fixed-size blocks, each
//! sequence's block table, a block allocator with reference counts, prefix sharing by a
//! chained hash of full blocks, and copy-on-write of a shared partial block. Only the
//! bookkeeping: nothing here touches a device (the serving engine keeps a pool beside a
//! paged [`crate::KvCache`] and writes what it says).
//!
//! A [`BlockPool`] owns block ids `0..blocks`, each holding up to `block_size` tokens' keys
//! and values on the device. A sequence's [`BlockTable`] lists its blocks in order; token `p`
//! lives in block `blocks()[p / block_size]` at offset `p % block_size`.
//!
//! - [`BlockPool::allocate`] makes a new sequence's table for its prompt, reusing the cached
//!   full blocks that hold the same prefix ([`BlockTable::cached_tokens`] says how many
//!   leading tokens the device already holds: its prefill skips them).
//! - [`BlockPool::append`] adds one token: a new block when the last is full; when the last
//!   block is partial and shared (after a fork) it is copied first, and the returned
//!   [`CopyOnWrite`] names the copy the device must make before writing the token.
//! - [`BlockPool::written`] says how many of a table's leading tokens the device holds: their
//!   full blocks join the cache, where later prompts find them. Nothing else is cached.
//! - [`BlockPool::fork`] shares every block of a table with a new one (beam search, parallel
//!   sampling, a speculative branch).
//! - [`BlockPool::free`] gives a table's blocks back. Freed full blocks stay cached, so a
//!   later prompt with the same prefix revives them, until their block is handed out again
//!   for other content.
//!
//! Misuse is impossible by construction or an error: a table is not `Clone` (only
//! [`BlockPool::fork`] makes a second one, counting its references) and `free` takes it by
//! value, so a table cannot be freed twice; each table carries its pool's id, and a pool
//! refuses a table made by another one ([`PagedError::ForeignTable`]). A table dropped
//! without `free` keeps its blocks held (a leak, never a block reused while referenced).
//!
//! Nothing is shared that could differ. A full block is cached under a hash chaining its
//! parent's hash (the block before it) with its tokens (FNV-1a 64 over the tokens'
//! little-endian bytes, starting from the parent's hash: deterministic across builds and
//! machines). A hash hit is then checked exactly: the cached block's tokens must equal the
//! prompt's and its parent must be the block the lookup matched just before (or none, for the
//! first), so a shared prefix equals the prompt's token for token, whatever the hash collides
//! with. A block is cached only when its parent is (a cached block's parents are cached all
//! the way up), and when two blocks of equal content fill, the first keeps the place. Nothing
//! is shared that was never written: a block joins the cache only when the caller says its
//! keys and values are written, so a table freed part way through its prefill (its sequence
//! preempted or cancelled) leaves its unwritten blocks uncached. (Caching a block as soon as
//! its tokens were known let a prompt that came back after a preemption during its prefill
//! share the blocks the prefill never reached, and decode from whatever they held.)
//!
//! Which free block is handed out: one holding nothing cached if there is one, else the
//! cached block freed least recently (its cache entry is dropped). A table's blocks are freed
//! last to first, so a block is always evicted before its parent and no cached block's parent
//! is ever reused under it.
//!
//! The caller's part: the device writes each token's keys and values where its table says
//! (after the copy an append returns, if any), and the caller says so
//! ([`BlockPool::written`]) only once those writes are done or issued ahead, in order on one
//! stream, of anything that may read them. Saying it late only shares less.

mod pool;
#[cfg(test)]
mod tests;

pub use pool::BlockPool;

/// The blocks of one sequence, in order, and its token count. Made by
/// [`BlockPool::allocate`] or [`BlockPool::fork`], changed by [`BlockPool::append`], given
/// back by [`BlockPool::free`]; only the pool that made it takes it.
#[derive(Debug)]
#[must_use = "a table holds its blocks until BlockPool::free takes it"]
pub struct BlockTable {
    /// The id of the pool that made it.
    pool: u64,
    blocks: Vec<u32>,
    tokens: usize,
    cached: usize,
    /// The leading tokens [`BlockPool::written`] said the device holds.
    written: usize,
}

impl BlockTable {
    /// The sequence's block ids, in order: the block table the device reads.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The sequence's token count.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the sequence has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The leading tokens whose keys and values the pool's blocks already held when this
    /// table was made: a multiple of the block size below the prompt's length for
    /// [`BlockPool::allocate`] (the prompt's last token is always computed, for its logits),
    /// every token for [`BlockPool::fork`]. The device writes the tokens after them.
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }
}

/// A copy the device must make before writing an appended token: block `src`'s keys and
/// values into block `dst`, every layer (the tokens the table held in the block are what
/// counts; the rest of the block may be copied or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOnWrite {
    /// The shared block, unchanged: other tables still read it.
    pub src: u32,
    /// The table's new last block, where the appended token goes.
    pub dst: u32,
}

/// What a [`BlockPool`] refused, and what to do. A refused call changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PagedError {
    /// [`BlockPool::new`] was asked for no blocks or blocks of no tokens.
    #[error(
        "a block pool needs at least one block of at least one token, got {blocks} blocks of {block_size} tokens: give both as at least 1"
    )]
    EmptyPool {
        /// The blocks asked for.
        blocks: u32,
        /// The tokens per block asked for.
        block_size: u32,
    },
    /// Not enough free blocks for the call.
    #[error(
        "out of kv cache blocks: {needed} needed, {free} free: free a finished sequence (BlockPool::free) or admit this one later (BlockPool::can_allocate)"
    )]
    OutOfBlocks {
        /// The free blocks the call needed (for a prompt, those its cached prefix does not
        /// cover, plus the cached ones it revives from the free list).
        needed: usize,
        /// The free blocks there were.
        free: usize,
    },
    /// [`BlockPool::written`] was told of more tokens than the table holds.
    #[error(
        "{written} tokens said written, but the block table holds {tokens}: say at most the tokens appended so far"
    )]
    PastTheTable {
        /// The tokens said written.
        written: usize,
        /// The tokens the table holds.
        tokens: usize,
    },
    /// A table was given to a pool that did not make it.
    #[error(
        "the block table was made by block pool {table} but given to block pool {pool}: give it to the pool that made it (a table given to free is dropped, its blocks stay held in its own pool)"
    )]
    ForeignTable {
        /// The id of the pool that made the table.
        table: u64,
        /// The id of the pool it was given to.
        pool: u64,
    },
}

/// FNV-1a 64's offset basis: the chain's start, the "parent hash" of a sequence's first
/// block.
const ROOT: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The hash of a full block whose parent hashed to `parent`: FNV-1a 64 over the tokens'
/// little-endian bytes, started from `parent` instead of the offset basis (so a first block's
/// hash is plain FNV-1a 64 of its bytes). Each step is a bijection of the state, so for given
/// tokens, different parents give different hashes.
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .fold(parent, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}
