//! The block pool against a trivially correct reference (proptest, with shrinking), plus plain
//! tests.
//!
//! The reference keeps each live sequence's token list and nothing else. A mirror of the
//! device keeps what each place of each block holds, and changes only as a caller following
//! the pool's contract changes the device: it writes a table's tokens from `cached_tokens` on
//! (a prompt's part way at first, as a prefill that may be preempted; appended tokens later),
//! tells the pool ([`BlockPool::written`]) as it writes, and makes each copy an append
//! returns. What a place holds is what a token's keys and values depend on, the whole sequence
//! up to that token. After every step every live table's written tokens, read through the
//! mirror, must spell its sequence, every cached block must hold the sequence its chain of
//! parents spells (nothing unwritten is ever shared, even after a table is freed part way),
//! the reference counts must be those the tables make, shared blocks must hold equal
//! prefixes, and the pool's own free lists and cache index must be consistent. A refused call
//! must leave the pool as it was. Half the runs use a hash that collides all the time, so that a hit is
//! trusted only as far as the pool checks it.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use proptest::sample::Index;

use super::pool::Cached;
use super::{BlockPool, BlockTable, CopyOnWrite, PagedError, ROOT, chain};

/// The pool's whole state, comparable: each block's (refs, tokens, cache entry, stamp), the
/// free lists and the index.
type Snapshot = (
    Vec<(usize, Vec<u32>, Option<Cached>, u64)>,
    Vec<u32>,
    BTreeMap<u64, u32>,
    BTreeMap<u64, u32>,
    usize,
);

fn snapshot(pool: &BlockPool) -> Snapshot {
    let blocks = pool
        .blocks
        .iter()
        .map(|b| (b.refs, b.tokens.clone(), b.cached, b.stamp))
        .collect();
    let index = pool.index.iter().map(|(&h, &b)| (h, b)).collect();
    (
        blocks,
        pool.empty.clone(),
        pool.evictable.clone(),
        index,
        pool.free_blocks(),
    )
}

/// The device's blocks as a caller that keeps the contract fills them: each place holds the
/// sequence up to the token written there (empty: never written).
struct Mirror {
    size: usize,
    blocks: Vec<Vec<Vec<u32>>>,
}

impl Mirror {
    fn new(pool: &BlockPool) -> Mirror {
        let size = pool.block_size() as usize;
        Mirror {
            size,
            blocks: vec![vec![Vec::new(); size]; pool.blocks() as usize],
        }
    }

    /// Writes the keys and values of `tokens`' token at `position`, into a block only
    /// `table` holds.
    fn write(&mut self, pool: &BlockPool, table: &BlockTable, tokens: &[u32], position: usize) {
        let b = table.blocks()[position / self.size] as usize;
        assert_eq!(pool.blocks[b].refs, 1, "a write into a shared block");
        self.blocks[b][position % self.size] = tokens[..=position].to_vec();
    }

    fn copy(&mut self, c: CopyOnWrite) {
        self.blocks[c.dst as usize] = self.blocks[c.src as usize].clone();
    }

    /// Whether every written place of `table` holds its sequence up to that place.
    fn holds(&self, table: &BlockTable, tokens: &[u32]) -> bool {
        (0..table.written).all(|p| {
            self.blocks[table.blocks()[p / self.size] as usize][p % self.size] == tokens[..=p]
        })
    }
}

/// A hash for the tests that collides all the time: 16 values, and parents that differ only
/// in their lowest bit give equal hashes.
fn weak(parent: u64, tokens: &[u32]) -> u64 {
    let sum: u64 = tokens.iter().map(|&t| u64::from(t) + 1).sum();
    ((parent >> 1).wrapping_mul(31) + sum) % 16
}

/// A step of the model test. Prompts are over three tokens, and most are a prefix of one of
/// a few stems and a short tail, so prefixes (and whole blocks) coincide often.
#[derive(Clone, Debug)]
enum Op {
    /// A prompt, and how much of what it does not share is written at once.
    Allocate(Vec<u32>, Index),
    Append(Index, u32),
    /// Writes the rest of a table and tells the pool.
    Write(Index),
    Fork(Index),
    Free(Index),
}

const STEMS: [[u32; 12]; 3] = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 1, 1, 1, 1, 2, 2, 2, 2],
    [2, 2, 0, 0, 1, 1, 2, 2, 0, 0, 1, 1],
];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..STEMS.len(), 0usize..=12, prop::collection::vec(0u32..3, 0..4), any::<Index>())
            .prop_map(|(stem, keep, tail, w)| Op::Allocate([&STEMS[stem][..keep], &tail].concat(), w)),
        1 => (prop::collection::vec(0u32..3, 0..8), any::<Index>())
            .prop_map(|(tokens, w)| Op::Allocate(tokens, w)),
        5 => (any::<Index>(), 0u32..3).prop_map(|(i, t)| Op::Append(i, t)),
        3 => any::<Index>().prop_map(Op::Write),
        2 => any::<Index>().prop_map(Op::Fork),
        3 => any::<Index>().prop_map(Op::Free),
    ]
}

/// Every check on the pool, the tables and the mirror after a step.
fn check(pool: &BlockPool, live: &[(BlockTable, Vec<u32>)], mirror: &Mirror) {
    let size = pool.block_size() as usize;
    let mut refs: HashMap<u32, usize> = HashMap::new();
    // Each block's holders: (live sequence, position in its table).
    let mut holders: HashMap<u32, Vec<(usize, usize)>> = HashMap::new();
    for (s, (table, tokens)) in live.iter().enumerate() {
        assert_eq!(table.len(), tokens.len());
        assert_eq!(table.blocks().len(), tokens.len().div_ceil(size));
        assert!(mirror.holds(table, tokens), "sequence {s} reads wrong");
        for (i, &b) in table.blocks().iter().enumerate() {
            *refs.entry(b).or_default() += 1;
            holders.entry(b).or_default().push((s, i));
        }
    }
    // Nothing unwritten is cached: each indexed block holds, place by place, the sequence
    // its chain of parents spells.
    for &b in pool.index.values() {
        let mut chain = vec![b];
        while let Some(parent) = pool.blocks[*chain.last().unwrap() as usize]
            .cached
            .and_then(|c| c.parent)
        {
            chain.push(parent);
        }
        let sequence: Vec<u32> = chain
            .iter()
            .rev()
            .flat_map(|&c| pool.blocks[c as usize].tokens.clone())
            .collect();
        let first = (chain.len() - 1) * size;
        for place in 0..size {
            assert_eq!(
                mirror.blocks[b as usize][place],
                sequence[..=first + place],
                "cached block {b} holds what was never written"
            );
        }
    }
    // Reference counts are the tables' references; free + referenced = total.
    for (b, block) in pool.blocks.iter().enumerate() {
        assert_eq!(block.refs, refs.get(&(b as u32)).copied().unwrap_or(0));
    }
    assert_eq!(pool.free_blocks() + refs.len(), pool.blocks() as usize);
    // A shared block sits at one position, and its holders agree on everything up to its
    // end: a full block with equal prefixes, or a partial one shared by a fork, which no
    // holder has appended to since.
    for places in holders.values() {
        let (s0, i0) = places[0];
        let end = |s: usize| live[s].1.len().min((i0 + 1) * size);
        for &(s, i) in places {
            assert_eq!(i, i0, "a block at two positions");
            assert_eq!(end(s), end(s0), "a block shared with different fills");
            assert_eq!(live[s].1[..end(s)], live[s0].1[..end(s0)]);
        }
    }
    // The free lists: `empty` the free uncached blocks, `evictable` the free cached ones
    // under their stamps.
    let mut free_empty: Vec<u32> = pool.empty.clone();
    free_empty.sort_unstable();
    let expect_empty: Vec<u32> = (0..pool.blocks.len() as u32)
        .filter(|&b| pool.blocks[b as usize].refs == 0 && pool.blocks[b as usize].cached.is_none())
        .collect();
    assert_eq!(free_empty, expect_empty);
    for (&stamp, &b) in &pool.evictable {
        let block = &pool.blocks[b as usize];
        assert_eq!((block.refs, block.stamp), (0, stamp));
        assert!(block.cached.is_some());
    }
    let cached_free = pool
        .blocks
        .iter()
        .filter(|b| b.refs == 0 && b.cached.is_some())
        .count();
    assert_eq!(pool.evictable.len(), cached_free);
    // The index: exactly the cached blocks, each full under its chained hash, its parent
    // cached, and (both free) freed after it.
    let cached = pool.blocks.iter().filter(|b| b.cached.is_some()).count();
    assert_eq!(pool.index.len(), cached);
    for (&hash, &b) in &pool.index {
        let block = &pool.blocks[b as usize];
        let entry = block.cached.expect("an indexed block is cached");
        assert_eq!(entry.hash, hash);
        assert_eq!(block.tokens.len(), size);
        let parent_hash = match entry.parent {
            None => ROOT,
            Some(p) => {
                let parent = &pool.blocks[p as usize];
                if block.refs == 0 && parent.refs == 0 {
                    assert!(
                        block.stamp < parent.stamp,
                        "a parent would be evicted first"
                    );
                }
                parent
                    .cached
                    .expect("a cached block's parent is cached")
                    .hash
            }
        };
        assert_eq!((pool.hash)(parent_hash, &block.tokens), hash);
    }
}

/// Applies `ops` to a pool of `blocks` blocks of `size` tokens (with the `weak` hash, or the
/// real one) and to the reference, checking everything after each step.
fn run(blocks: u32, size: u32, weak_hash: bool, ops: &[Op]) {
    let mut pool = BlockPool::new(blocks, size).unwrap();
    if weak_hash {
        pool.hash = weak;
    }
    let mut mirror = Mirror::new(&pool);
    let mut live: Vec<(BlockTable, Vec<u32>)> = Vec::new();
    let bs = size as usize;
    for op in ops {
        let before = snapshot(&pool);
        match op {
            Op::Allocate(tokens, w) => {
                let tokens = tokens.clone();
                let can = pool.can_allocate(&tokens);
                match pool.allocate(&tokens) {
                    Ok(mut table) => {
                        assert!(can, "can_allocate said no, allocate did it");
                        let cached = table.cached_tokens();
                        assert!(cached % bs == 0 && cached < tokens.len().max(1));
                        let written = cached + w.index(tokens.len() - cached + 1);
                        for p in cached..written {
                            mirror.write(&pool, &table, &tokens, p);
                        }
                        pool.written(&mut table, written).unwrap();
                        live.push((table, tokens));
                    }
                    Err(e) => {
                        assert!(!can, "can_allocate said yes, allocate refused: {e}");
                        let free = pool.free_blocks();
                        assert!(
                            matches!(e, PagedError::OutOfBlocks { needed, free: f } if f == free && needed > free)
                        );
                        assert_eq!(
                            snapshot(&pool),
                            before,
                            "a refused allocate changed the pool"
                        );
                    }
                }
            }
            Op::Append(i, token) => {
                if live.is_empty() {
                    continue;
                }
                let s = i.index(live.len());
                let (table, tokens) = &mut live[s];
                let fill = tokens.len() % bs;
                let shared_partial =
                    fill > 0 && pool.blocks[*table.blocks().last().unwrap() as usize].refs > 1;
                let needs_block = fill == 0 || shared_partial;
                let old_blocks = table.blocks().to_vec();
                match pool.append(table, *token) {
                    Ok(copy) => {
                        assert_eq!(copy.is_some(), shared_partial);
                        if let Some(c) = copy {
                            assert_eq!(c.src, *old_blocks.last().unwrap());
                            assert_eq!(c.dst, *table.blocks().last().unwrap());
                            mirror.copy(c);
                        }
                        tokens.push(*token);
                    }
                    Err(e) => {
                        assert!(needs_block && before.4 == 0, "append refused: {e}");
                        assert_eq!(e, PagedError::OutOfBlocks { needed: 1, free: 0 });
                        assert_eq!(table.blocks(), &old_blocks[..]);
                        assert_eq!(table.len(), tokens.len());
                        assert_eq!(snapshot(&pool), before, "a refused append changed the pool");
                    }
                }
            }
            Op::Write(i) => {
                if live.is_empty() {
                    continue;
                }
                let s = i.index(live.len());
                let (table, tokens) = &mut live[s];
                for p in table.written..tokens.len() {
                    mirror.write(&pool, table, tokens, p);
                }
                pool.written(table, tokens.len()).unwrap();
            }
            Op::Fork(i) => {
                // Only a written table is forked: its blocks are read by both from then on.
                let Some(s) = (!live.is_empty())
                    .then(|| i.index(live.len()))
                    .filter(|&s| live[s].0.written == live[s].1.len())
                else {
                    continue;
                };
                let table = pool.fork(&live[s].0).unwrap();
                assert_eq!(table.blocks(), live[s].0.blocks());
                assert_eq!(table.cached_tokens(), table.len());
                let tokens = live[s].1.clone();
                live.push((table, tokens));
            }
            Op::Free(i) => {
                if live.is_empty() {
                    continue;
                }
                let (table, _) = live.swap_remove(i.index(live.len()));
                pool.free(table).unwrap();
            }
        }
        check(&pool, &live, &mirror);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn paged_pool_matches_the_reference(
        blocks in 1u32..=32,
        size in 1u32..=4,
        weak_hash in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(blocks, size, weak_hash, &ops);
    }
}

#[test]
fn paged_prompts_share_a_1024_token_prefix_as_64_blocks() {
    let mut pool = BlockPool::new(256, 16).unwrap();
    let prefix: Vec<u32> = (0..1024).map(|i| i * 7 % 1000).collect();
    let a = [&prefix[..], &[1, 2, 3]].concat();
    let b = [&prefix[..], &[4, 5, 6, 7, 8]].concat();
    let mut ta = pool.allocate(&a).unwrap();
    assert_eq!(ta.cached_tokens(), 0);
    assert_eq!(pool.free_blocks(), 256 - 65);
    pool.written(&mut ta, a.len()).unwrap();
    let mut tb = pool.allocate(&b).unwrap();
    assert_eq!(tb.cached_tokens(), 1024);
    assert_eq!(ta.blocks()[..64], tb.blocks()[..64]);
    assert_ne!(ta.blocks()[64], tb.blocks()[64]);
    assert_eq!(pool.free_blocks(), 256 - 66);
    assert!(
        tb.blocks()[..64]
            .iter()
            .all(|&b| pool.blocks[b as usize].refs == 2)
    );
    // Freed, the prefix stays cached: a third prompt revives it.
    pool.written(&mut tb, b.len()).unwrap();
    pool.free(ta).unwrap();
    pool.free(tb).unwrap();
    assert_eq!(pool.free_blocks(), 256);
    let tc = pool.allocate(&a).unwrap();
    assert_eq!(tc.cached_tokens(), 1024);
    assert_eq!(pool.free_blocks(), 256 - 65);
}

/// A prompt whose prefill is preempted part way (its table freed with half its tokens
/// written) leaves only its written blocks cached: when it comes back it shares those and
/// prefills the rest. (Caching every full block at allocation shared the unwritten ones.)
#[test]
fn paged_a_table_freed_part_way_shares_only_what_was_written() {
    let mut pool = BlockPool::new(8, 2).unwrap();
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    let mut a = pool.allocate(&prompt).unwrap();
    pool.written(&mut a, 5).unwrap();
    // Saying fewer than before changes nothing.
    let before = snapshot(&pool);
    pool.written(&mut a, 3).unwrap();
    assert_eq!(snapshot(&pool), before);
    pool.free(a).unwrap();
    let again = pool.allocate(&prompt).unwrap();
    assert_eq!(again.cached_tokens(), 4);
}

#[test]
fn paged_copy_on_write_happens_exactly_on_a_shared_partial_block() {
    let mut pool = BlockPool::new(8, 4).unwrap();
    let mut a = pool.allocate(&[1, 2, 3, 4, 5]).unwrap();
    // Not shared: written in place.
    assert_eq!(pool.append(&mut a, 6), Ok(None));
    let mut b = pool.fork(&a).unwrap();
    let partial = a.blocks()[1];
    // Shared and partial: copied before the write, the shared block left as it was.
    let copy = pool.append(&mut b, 7).unwrap().unwrap();
    assert_eq!(copy.src, partial);
    assert_eq!(copy.dst, b.blocks()[1]);
    assert_eq!(pool.blocks[partial as usize].tokens, [5, 6]);
    assert_eq!(pool.blocks[copy.dst as usize].tokens, [5, 6, 7]);
    // The other holder is now its only one: in place again.
    assert_eq!(pool.append(&mut a, 8), Ok(None));
    assert_eq!(a.blocks()[1], partial);
    // A shared full last block is never copied: the token starts a new block.
    assert_eq!(pool.append(&mut a, 9), Ok(None));
    let mut c = pool.fork(&a).unwrap();
    assert_eq!(pool.append(&mut c, 10), Ok(None));
    assert_eq!(c.blocks()[..2], a.blocks()[..2]);
    assert_eq!(c.blocks().len(), 3);
}

#[test]
fn paged_a_prompt_never_shares_the_block_of_its_last_token() {
    let mut pool = BlockPool::new(8, 2).unwrap();
    let mut a = pool.allocate(&[1, 2, 3, 4]).unwrap();
    pool.written(&mut a, 4).unwrap();
    let mut b = pool.allocate(&[1, 2, 3, 4]).unwrap();
    pool.written(&mut b, 4).unwrap();
    assert_eq!(b.cached_tokens(), 2);
    assert_eq!(b.blocks()[0], a.blocks()[0]);
    assert_ne!(b.blocks()[1], a.blocks()[1]);
    // Equal content filled second keeps the first block's place in the cache.
    assert!(pool.blocks[b.blocks()[1] as usize].cached.is_none());
    let one = pool.allocate(&[1]).unwrap();
    assert_eq!(one.cached_tokens(), 0);
}

#[test]
fn paged_a_hash_hit_under_another_parent_is_not_shared() {
    let mut pool = BlockPool::new(16, 1).unwrap();
    pool.hash = weak;
    // Under `weak`, [1] and [2] as first blocks hash to 0 and 1, and so the block [1] after
    // either hashes alike (2): the third prompt's must not be the first's.
    let mut a = pool.allocate(&[1, 1, 0]).unwrap();
    pool.written(&mut a, 3).unwrap();
    let mut b = pool.allocate(&[2, 0]).unwrap();
    pool.written(&mut b, 2).unwrap();
    let c = pool.allocate(&[2, 1, 0]).unwrap();
    assert_eq!(weak(ROOT, &[1]) ^ 1, weak(ROOT, &[2]));
    assert_eq!(
        pool.index.get(&weak(weak(ROOT, &[2]), &[1])),
        Some(&a.blocks()[1])
    );
    assert_eq!(c.cached_tokens(), 1);
    assert_eq!(c.blocks()[0], b.blocks()[0]);
    assert_ne!(c.blocks()[1], a.blocks()[1]);
}

#[test]
fn paged_the_least_recently_freed_cached_block_is_evicted_first() {
    let mut pool = BlockPool::new(4, 1).unwrap();
    let mut a = pool.allocate(&[1, 2]).unwrap();
    pool.written(&mut a, 2).unwrap();
    let mut b = pool.allocate(&[3, 4]).unwrap();
    pool.written(&mut b, 2).unwrap();
    let (a0, b0) = (a.blocks()[0], b.blocks()[0]);
    pool.free(a).unwrap();
    pool.free(b).unwrap();
    assert_eq!(pool.free_blocks(), 4);
    // Every block is cached and free; the new prompt takes a's blocks (freed first, its
    // second block before its first) and leaves b's prefix to be hit.
    let c = pool.allocate(&[5, 6]).unwrap();
    assert!(!c.blocks().contains(&b0));
    assert!(c.blocks().contains(&a0));
    assert!(!pool.can_allocate(&[1, 2, 3]));
    let d = pool.allocate(&[3, 9]).unwrap();
    assert_eq!((d.cached_tokens(), d.blocks()[0]), (1, b0));
}

#[test]
fn paged_refusals_say_what_happened_and_change_nothing() {
    assert_eq!(
        BlockPool::new(0, 16).unwrap_err(),
        PagedError::EmptyPool {
            blocks: 0,
            block_size: 16
        }
    );
    assert!(BlockPool::new(4, 0).is_err());
    let mut pool = BlockPool::new(2, 2).unwrap();
    let mut other = BlockPool::new(2, 2).unwrap();
    let mut a = pool.allocate(&[1, 2, 3]).unwrap();
    let before = snapshot(&pool);
    let err = pool.allocate(&[4, 5, 6]).unwrap_err();
    assert_eq!(err, PagedError::OutOfBlocks { needed: 2, free: 0 });
    assert_eq!(
        err.to_string(),
        "out of kv cache blocks: 2 needed, 0 free: free a finished sequence (BlockPool::free) or admit this one later (BlockPool::can_allocate)"
    );
    assert_eq!(snapshot(&pool), before);
    assert_eq!(pool.append(&mut a, 4), Ok(None));
    let before = snapshot(&pool);
    assert_eq!(
        pool.append(&mut a, 5),
        Err(PagedError::OutOfBlocks { needed: 1, free: 0 })
    );
    assert_eq!((a.len(), a.blocks().len()), (4, 2));
    assert_eq!(snapshot(&pool), before);
    let err = pool.written(&mut a, 5).unwrap_err();
    assert_eq!(
        err,
        PagedError::PastTheTable {
            written: 5,
            tokens: 4
        }
    );
    assert_eq!(
        err.to_string(),
        "5 tokens said written, but the block table holds 4: say at most the tokens appended so far"
    );
    assert_eq!(snapshot(&pool), before);
    assert!(matches!(
        other.append(&mut a, 5),
        Err(PagedError::ForeignTable { .. })
    ));
    assert!(matches!(
        other.fork(&a),
        Err(PagedError::ForeignTable { .. })
    ));
    assert!(matches!(
        other.free(a),
        Err(PagedError::ForeignTable { .. })
    ));
    // The foreign table's blocks stay held in its own pool.
    assert_eq!(snapshot(&pool), before);
    assert_eq!(other.free_blocks(), 2);
}

#[test]
fn paged_the_chained_hash_is_fnv1a_64() {
    // FNV-1a 64's published vector for "a".
    assert_eq!(
        [0x61u8].iter().fold(ROOT, |h, &b| (h ^ u64::from(b))
            .wrapping_mul(super::FNV_PRIME)),
        0xaf63_dc4c_8601_ec8c
    );
    let first = chain(ROOT, &[1, 2]);
    assert_eq!(first, 0xc9c2_8939_c996_68c6);
    assert_eq!(chain(first, &[3, 4]), 0x84c3_9a07_9fc0_8121);
    assert_eq!(chain(ROOT, &[]), ROOT);
}
