//! The pool against a trivially correct model (proptest, with shrinking), plus unit tests.
//!
//! The model is a sorted list of segments and a list of live ranges. From them it computes the
//! free gaps, and from the gaps exactly what the pool must do: best fit (smallest gap that fits,
//! lowest address among equals), whether it grows, by how much, and the block size handed out.

use std::collections::BTreeSet;

use graft_core::device::{DeviceError, DeviceOp, DevicePtr};
use graft_core::pool::{Block, BlockId, Checkpoint, Pool, PoolError, PoolStats};
use proptest::prelude::*;
use proptest::sample::Index;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Where the fake device's first segment goes.
const BASE: u64 = 1 << 32;

/// A device that hands out segment addresses from a counter.
#[derive(Debug, Default)]
struct FakeDevice {
    next: u64,
    /// Bytes left between consecutive segments (0: segments are adjacent).
    gap: u64,
    fail_next: bool,
    grows: Vec<usize>,
    frees: Vec<(DevicePtr, usize)>,
}

impl FakeDevice {
    fn new(gap: u64) -> FakeDevice {
        FakeDevice {
            next: BASE,
            gap,
            ..FakeDevice::default()
        }
    }

    fn grow(&mut self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        self.grows.push(bytes);
        if std::mem::take(&mut self.fail_next) {
            return Err(DeviceError::Injected {
                op: DeviceOp::SegmentAlloc,
            });
        }
        let addr = self.next;
        self.next += bytes as u64 + self.gap;
        Ok(DevicePtr(addr))
    }

    fn free(&mut self, ptr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        self.frees.push((ptr, bytes));
        Ok(())
    }
}

fn alloc(pool: &mut Pool, dev: &mut FakeDevice, bytes: usize) -> Result<Block, PoolError> {
    pool.alloc(bytes, &mut |b| dev.grow(b))
}

fn round(len: usize) -> usize {
    len.max(1).next_multiple_of(512)
}

fn is_large(size: usize) -> bool {
    size > MIB
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MSeg {
    addr: u64,
    size: usize,
    large: bool,
}

impl MSeg {
    fn end(&self) -> u64 {
        self.addr + self.size as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Live {
    id: BlockId,
    addr: u64,
    size: usize,
    /// The length originally asked for (at most `size`).
    req: usize,
}

#[derive(Debug)]
struct Saved {
    cp: Checkpoint,
    live: Vec<Live>,
    segs: Vec<u64>,
}

#[derive(Debug, Default)]
struct Model {
    segs: Vec<MSeg>,
    live: Vec<Live>,
    saved: Vec<Saved>,
    max_id: Option<BlockId>,
    peak_allocated: usize,
    peak_reserved: usize,
}

impl Model {
    fn seg_of(&self, addr: u64) -> Option<MSeg> {
        self.segs
            .iter()
            .copied()
            .find(|s| s.addr <= addr && addr < s.end())
    }

    /// Free gaps (addr, size, segment), address order.
    fn gaps(&self) -> Vec<(u64, usize, MSeg)> {
        let mut out = Vec::new();
        for seg in &self.segs {
            let mut inside: Vec<(u64, u64)> = self
                .live
                .iter()
                .filter(|l| seg.addr <= l.addr && l.addr < seg.end())
                .map(|l| (l.addr, l.addr + l.size as u64))
                .collect();
            inside.sort_unstable();
            let mut cursor = seg.addr;
            for (a, e) in inside.into_iter().chain([(seg.end(), seg.end())]) {
                if a > cursor {
                    out.push((cursor, (a - cursor) as usize, *seg));
                }
                cursor = cursor.max(e);
            }
        }
        out
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            reserved: self.segs.iter().map(|s| s.size).sum(),
            allocated: self.live.iter().map(|l| l.size).sum(),
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            live_blocks: self.live.len(),
            segments: self.segs.len(),
        }
    }

    fn note_peaks(&mut self) {
        let s = self.stats();
        self.peak_allocated = self.peak_allocated.max(s.allocated);
        self.peak_reserved = self.peak_reserved.max(s.reserved);
    }

    /// Checks that `id` is fresh: above every id seen so far.
    fn fresh(&mut self, id: BlockId) -> Result<(), TestCaseError> {
        prop_assert!(self.max_id.is_none_or(|m| id > m), "id {id} reused");
        self.max_id = Some(id);
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Extra {
    /// A range starting in a free gap: gap index, offset index, length index, and whether it
    /// runs past the gap (into a live block, or past the segment's end) by up to 4 KiB.
    FreeRange(Index, Index, Index, bool),
    /// The last 512 bytes of a segment plus 512 more: never inside one segment.
    Straddle(Index),
    /// Below every segment.
    Outside,
    /// A copy of a live range: placed only if the original is not placed before it.
    Duplicate(Index),
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Free(Index),
    Checkpoint,
    Rollback {
        which: Index,
        checked: bool,
    },
    Restore {
        keep: u64,
        use_req: bool,
        extra: Option<(Extra, Index)>,
    },
    FailNextGrow,
    ReleaseUnused,
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        5 => 1usize..4096,
        3 => 4096usize..=MIB,
        2 => (MIB + 1)..=24 * MIB,
        1 => prop::sample::select(vec![
            0,
            512,
            513,
            MIB - 1,
            MIB,
            MIB + 1,
            2 * MIB,
            10 * MIB - 1,
            10 * MIB,
            11 * MIB,
            19 * MIB,
            20 * MIB,
        ]),
    ]
}

fn extra_strategy() -> impl Strategy<Value = Extra> {
    prop_oneof![
        4 => (any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(g, o, l)| Extra::FreeRange(g, o, l, false)),
        2 => (any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(g, o, l)| Extra::FreeRange(g, o, l, true)),
        1 => any::<Index>().prop_map(Extra::Straddle),
        1 => Just(Extra::Outside),
        1 => any::<Index>().prop_map(Extra::Duplicate),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => size_strategy().prop_map(Op::Alloc),
        6 => any::<Index>().prop_map(Op::Free),
        2 => Just(Op::Checkpoint),
        2 => (any::<Index>(), any::<bool>())
            .prop_map(|(which, checked)| Op::Rollback { which, checked }),
        2 => (any::<u64>(), any::<bool>(), prop::option::of((extra_strategy(), any::<Index>())))
            .prop_map(|(keep, use_req, extra)| Op::Restore { keep, use_req, extra }),
        1 => Just(Op::FailNextGrow),
        1 => Just(Op::ReleaseUnused),
    ]
}

type Snapshot = (Vec<(Block, bool)>, Vec<(DevicePtr, usize)>, PoolStats);

fn snapshot(pool: &Pool) -> Snapshot {
    (pool.blocks(), pool.segments(), pool.stats())
}

/// Layout without ids: (addr, size, allocated).
fn layout(pool: &Pool) -> Vec<(DevicePtr, usize, bool)> {
    pool.blocks()
        .into_iter()
        .map(|(b, a)| (b.addr, b.size, a))
        .collect()
}

/// Everything checked after every step.
fn check(pool: &Pool, model: &Model) -> Result<(), TestCaseError> {
    if let Err(e) = pool.check_invariants() {
        prop_assert!(false, "invariant broken: {e}");
    }
    let segs: Vec<(DevicePtr, usize)> = model
        .segs
        .iter()
        .map(|s| (DevicePtr(s.addr), s.size))
        .collect();
    prop_assert_eq!(pool.segments(), segs);

    // The model's own sanity: live ranges disjoint and inside one segment each.
    let mut ranges: Vec<(u64, u64)> = model
        .live
        .iter()
        .map(|l| (l.addr, l.addr + l.size as u64))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        prop_assert!(w[0].1 <= w[1].0, "live ranges overlap: {:?}", w);
    }
    for l in &model.live {
        let seg = model.seg_of(l.addr);
        prop_assert!(
            seg.is_some_and(|s| l.addr + l.size as u64 <= s.end()),
            "live range {l:?} outside every segment"
        );
        prop_assert!(l.size >= round(l.req));
    }

    // Blocks tile the segments, free blocks are coalesced.
    let blocks = pool.blocks();
    let mut bi = blocks.iter().peekable();
    for s in &model.segs {
        let mut cursor = s.addr;
        let mut prev_free = false;
        while cursor < s.end() {
            let Some((b, allocated)) = bi.next() else {
                return Err(TestCaseError::fail(format!("segment {s:?} not tiled")));
            };
            prop_assert_eq!(b.addr.0, cursor);
            prop_assert!(
                *allocated || !prev_free,
                "adjacent free blocks at {}",
                b.addr
            );
            prop_assert_eq!(*allocated, b.id != BlockId::FREE);
            prev_free = !allocated;
            cursor += b.size as u64;
        }
        prop_assert_eq!(cursor, s.end());
    }
    prop_assert!(bi.next().is_none());

    // Exactly the model's live set is allocated.
    let got: BTreeSet<(u64, BlockId, usize)> = blocks
        .iter()
        .filter(|(_, a)| *a)
        .map(|(b, _)| (b.addr.0, b.id, b.size))
        .collect();
    let want: BTreeSet<(u64, BlockId, usize)> =
        model.live.iter().map(|l| (l.addr, l.id, l.size)).collect();
    prop_assert_eq!(got, want);
    prop_assert_eq!(pool.stats(), model.stats());
    Ok(())
}

/// What the pool must do for an allocation of `req` bytes.
enum Expect {
    /// A free gap fits: (addr, size).
    Fit(u64, usize),
    /// Grow by this many bytes.
    Grow(usize),
}

fn expect_alloc(model: &Model, req: usize) -> Expect {
    let size = round(req);
    let large = is_large(size);
    let best = model
        .gaps()
        .into_iter()
        .filter(|(_, len, seg)| seg.large == large && *len >= size)
        .min_by_key(|(addr, len, _)| (*len, *addr));
    match best {
        Some((addr, len, _)) => Expect::Fit(addr, handed_out(size, len)),
        None => Expect::Grow(if !large {
            2 * MIB
        } else if size < 10 * MIB {
            20 * MIB
        } else {
            size.next_multiple_of(2 * MIB)
        }),
    }
}

/// The block size handed out for a rounded request taken from a free block of `free` bytes.
fn handed_out(size: usize, free: usize) -> usize {
    let rest = free - size;
    let split = if is_large(size) {
        rest > MIB
    } else {
        rest >= 512
    };
    if split { size } else { free }
}

fn step_alloc(
    pool: &mut Pool,
    dev: &mut FakeDevice,
    model: &mut Model,
    req: usize,
) -> Result<(), TestCaseError> {
    let size = round(req);
    let before = snapshot(pool);
    let grows = dev.grows.len();
    let will_fail = dev.fail_next;
    let expect = expect_alloc(model, req);
    let res = alloc(pool, dev, req);
    match expect {
        Expect::Fit(addr, bsize) => {
            prop_assert_eq!(dev.grows.len(), grows, "grew although a gap fits");
            let b = res.map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!((b.addr.0, b.size), (addr, bsize));
            model.fresh(b.id)?;
            model.live.push(Live {
                id: b.id,
                addr,
                size: bsize,
                req,
            });
        }
        Expect::Grow(seg_bytes) => {
            prop_assert_eq!(&dev.grows[grows..], &[seg_bytes][..]);
            if will_fail {
                prop_assert_eq!(
                    res,
                    Err(PoolError::Grow {
                        bytes: seg_bytes,
                        source: DeviceError::Injected {
                            op: DeviceOp::SegmentAlloc
                        },
                    })
                );
                prop_assert_eq!(snapshot(pool), before, "failed grow changed the pool");
            } else {
                let b = res.map_err(|e| TestCaseError::fail(e.to_string()))?;
                let seg_addr = dev.next - dev.gap - seg_bytes as u64;
                let bsize = handed_out(size, seg_bytes);
                prop_assert_eq!((b.addr.0, b.size), (seg_addr, bsize));
                model.fresh(b.id)?;
                model.segs.push(MSeg {
                    addr: seg_addr,
                    size: seg_bytes,
                    large: is_large(size),
                });
                model.live.push(Live {
                    id: b.id,
                    addr: seg_addr,
                    size: bsize,
                    req,
                });
            }
        }
    }
    model.note_peaks();
    Ok(())
}

fn step_free(
    pool: &mut Pool,
    dev: &mut FakeDevice,
    model: &mut Model,
    which: Index,
) -> Result<(), TestCaseError> {
    if model.live.is_empty() {
        return Ok(());
    }
    let l = model.live.remove(which.index(model.live.len()));
    prop_assert_eq!(pool.free(l.id), Ok(l.size));
    // A second free of the same id is detected and changes nothing.
    let before = snapshot(pool);
    prop_assert_eq!(pool.free(l.id), Err(PoolError::UnknownBlock { id: l.id }));
    prop_assert_eq!(snapshot(pool), before);

    // The freed bytes are reusable at once: the block now lies in a free gap of at least its
    // size in a segment of its class, so the same request is served without growing. Serving
    // and freeing it again leaves the layout as it was (free space is the maximal gaps).
    let seg = model.seg_of(l.addr).expect("model segment");
    if seg.large == is_large(l.size) {
        let Expect::Fit(addr, size) = expect_alloc(model, l.size) else {
            return Err(TestCaseError::fail("model: freed block not reusable"));
        };
        let layout_before = layout(pool);
        let grows = dev.grows.len();
        let b = alloc(pool, dev, l.size).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(dev.grows.len(), grows, "freed bytes not reused");
        prop_assert_eq!((b.addr.0, b.size), (addr, size));
        model.fresh(b.id)?;
        // The pool's peak saw this block.
        model.peak_allocated = model.peak_allocated.max(model.stats().allocated + b.size);
        prop_assert_eq!(pool.free(b.id), Ok(b.size));
        prop_assert_eq!(layout(pool), layout_before);
    }
    if model.live.is_empty() {
        // Everything freed: every segment is one free block.
        let blocks = pool.blocks();
        prop_assert_eq!(blocks.len(), model.segs.len());
        prop_assert!(blocks.iter().all(|(_, a)| !a));
    }
    Ok(())
}

fn step_rollback(
    pool: &mut Pool,
    model: &mut Model,
    which: Index,
    checked: bool,
) -> Result<(), TestCaseError> {
    if model.saved.is_empty() {
        return Ok(());
    }
    let saved = &model.saved[which.index(model.saved.len())];
    let missing = saved
        .segs
        .iter()
        .copied()
        .find(|a| model.seg_of(*a).is_none_or(|s| s.addr != *a));
    if checked {
        let before = snapshot(pool);
        let res = pool.try_rollback(&saved.cp);
        match missing {
            None => prop_assert_eq!(res, Ok(())),
            Some(seg) => {
                prop_assert_eq!(
                    res,
                    Err(PoolError::StaleCheckpoint {
                        segment: DevicePtr(seg)
                    })
                );
                prop_assert_eq!(snapshot(pool), before);
                return Ok(());
            }
        }
    } else {
        pool.rollback(&saved.cp);
    }
    // Blocks of segments released since are left out.
    let live: Vec<Live> = saved
        .live
        .iter()
        .copied()
        .filter(|l| model.seg_of(l.addr).is_some())
        .collect();
    model.live = live;
    model.note_peaks();
    Ok(())
}

fn step_restore(
    pool: &mut Pool,
    model: &mut Model,
    keep: u64,
    use_req: bool,
    extra: Option<(Extra, Index)>,
) -> Result<(), TestCaseError> {
    let mut input: Vec<(DevicePtr, usize, usize)> = model
        .live
        .iter()
        .enumerate()
        .filter(|(i, _)| keep & (1 << (i % 64)) != 0)
        .map(|(_, l)| {
            let len = if use_req { l.req } else { l.size };
            (DevicePtr(l.addr), len, 0)
        })
        .collect();
    if let Some((extra, pos)) = extra {
        let range = match extra {
            Extra::FreeRange(g, o, len, over) => {
                let gaps = model.gaps();
                if gaps.is_empty() {
                    None
                } else {
                    let (addr, size, _) = gaps[g.index(gaps.len())];
                    let off = o.index(size / 512) as u64 * 512;
                    let room = size - off as usize;
                    let len = if over {
                        room + 1 + len.index(4 * KIB)
                    } else {
                        len.index(room + 1)
                    };
                    Some((DevicePtr(addr + off), len))
                }
            }
            Extra::Straddle(s) if !model.segs.is_empty() => {
                let seg = model.segs[s.index(model.segs.len())];
                Some((DevicePtr(seg.end() - 512), 1024))
            }
            Extra::Duplicate(i) if !model.live.is_empty() => {
                let l = model.live[i.index(model.live.len())];
                Some((DevicePtr(l.addr), l.size))
            }
            Extra::Outside => Some((DevicePtr(BASE - 64 * KIB as u64), 512)),
            _ => None,
        };
        if let Some((addr, len)) = range {
            let at = pos.index(input.len() + 1);
            input.insert(at, (addr, len, 1));
        }
    }

    // The model's placement: in input order, inside one segment, disjoint from earlier ones.
    let mut placed: Vec<(u64, u64)> = Vec::new();
    let mut expected: Vec<Option<(u64, usize)>> = Vec::new();
    for &(addr, len, _) in &input {
        let start = addr.0;
        let end = start + round(len) as u64;
        let inside = model.segs.iter().any(|s| s.addr <= start && end <= s.end());
        let overlaps = placed.iter().any(|&(a, e)| a < end && start < e);
        if inside && !overlaps {
            placed.push((start, end));
            expected.push(Some((start, (end - start) as usize)));
        } else {
            expected.push(None);
        }
    }
    let old: Vec<BlockId> = model.live.iter().map(|l| l.id).collect();
    let pairs: Vec<(DevicePtr, usize)> = input.iter().map(|&(a, l, _)| (a, l)).collect();
    let got = pool.restore(&pairs);
    prop_assert_eq!(got.len(), input.len());
    let mut live = Vec::new();
    for ((g, e), &(_, len, _)) in got.iter().zip(&expected).zip(&input) {
        prop_assert_eq!(g.map(|b| (b.addr.0, b.size)), *e);
        if let Some(b) = g {
            model.fresh(b.id)?;
            live.push(Live {
                id: b.id,
                addr: b.addr.0,
                size: b.size,
                req: len,
            });
        }
    }
    model.live = live;
    model.note_peaks();
    // Every id issued before is stale.
    for id in old {
        prop_assert_eq!(pool.free(id), Err(PoolError::UnknownBlock { id }));
    }
    Ok(())
}

fn step_release_unused(
    pool: &mut Pool,
    dev: &mut FakeDevice,
    model: &mut Model,
) -> Result<(), TestCaseError> {
    let unused: Vec<MSeg> = model
        .segs
        .iter()
        .copied()
        .filter(|s| {
            !model
                .live
                .iter()
                .any(|l| s.addr <= l.addr && l.addr < s.end())
        })
        .collect();
    let frees = dev.frees.len();
    let res = pool.release_unused(&mut |p, b| dev.free(p, b));
    prop_assert_eq!(res, Ok(unused.iter().map(|s| s.size).sum::<usize>()));
    let want: Vec<(DevicePtr, usize)> =
        unused.iter().map(|s| (DevicePtr(s.addr), s.size)).collect();
    prop_assert_eq!(&dev.frees[frees..], &want[..]);
    model.segs.retain(|s| !unused.contains(s));
    Ok(())
}

fn run(gap: bool, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(if gap { 2 * MIB as u64 } else { 0 });
    let mut model = Model::default();
    check(&pool, &model)?;
    for op in ops {
        match op {
            Op::Alloc(req) => step_alloc(&mut pool, &mut dev, &mut model, req)?,
            Op::Free(which) => step_free(&mut pool, &mut dev, &mut model, which)?,
            Op::Checkpoint => {
                let cp = pool.checkpoint();
                let mut from_cp: Vec<(u64, BlockId, usize)> =
                    cp.allocated().map(|b| (b.addr.0, b.id, b.size)).collect();
                let mut want: Vec<(u64, BlockId, usize)> =
                    model.live.iter().map(|l| (l.addr, l.id, l.size)).collect();
                from_cp.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(from_cp, want);
                model.saved.push(Saved {
                    cp,
                    live: model.live.clone(),
                    segs: model.segs.iter().map(|s| s.addr).collect(),
                });
            }
            Op::Rollback { which, checked } => {
                step_rollback(&mut pool, &mut model, which, checked)?
            }
            Op::Restore {
                keep,
                use_req,
                extra,
            } => step_restore(&mut pool, &mut model, keep, use_req, extra)?,
            Op::FailNextGrow => dev.fail_next = true,
            Op::ReleaseUnused => step_release_unused(&mut pool, &mut dev, &mut model)?,
        }
        check(&pool, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_model(gap in any::<bool>(), ops in prop::collection::vec(op_strategy(), 1..48)) {
        run(gap, ops)?;
    }
}

// ---- unit tests ----

#[test]
fn classes_and_segment_sizes() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 0).unwrap();
    assert_eq!(a.size, 512);
    assert_eq!(dev.grows, [2 * MIB]);
    // 1 MiB is still small, and fits the small segment.
    let b = alloc(&mut pool, &mut dev, MIB).unwrap();
    assert_eq!((b.addr, b.size), (a.addr.offset(512), MIB));
    assert_eq!(dev.grows, [2 * MIB]);
    // One byte more is large: a 20 MiB segment.
    let c = alloc(&mut pool, &mut dev, MIB + 1).unwrap();
    assert_eq!(c.size, MIB + 512);
    assert_eq!(dev.grows, [2 * MIB, 20 * MIB]);
    // A 10 MiB request fits the large segment's remainder.
    let d = alloc(&mut pool, &mut dev, 10 * MIB).unwrap();
    assert_eq!(d.addr, c.addr.offset(c.size));
    // 30 MiB: dedicated segment of exactly 30 MiB; 31 MiB: rounded to 32 MiB and, since the
    // 1 MiB remainder is too small to split, the whole segment is handed out.
    let e = alloc(&mut pool, &mut dev, 30 * MIB).unwrap();
    let f = alloc(&mut pool, &mut dev, 31 * MIB).unwrap();
    assert_eq!(dev.grows, [2 * MIB, 20 * MIB, 30 * MIB, 32 * MIB]);
    assert_eq!((e.size, f.size), (30 * MIB, 32 * MIB));
    // Small requests never use the large segments' free space.
    let g = alloc(&mut pool, &mut dev, 4096).unwrap();
    let (small_seg, _) = pool.segments()[0];
    assert!(g.addr.0 >= small_seg.0 && g.addr.0 < small_seg.0 + 2 * MIB as u64);
    assert_eq!(pool.stats().segments, 4);
    pool.check_invariants().unwrap();
}

#[test]
fn split_and_coalesce() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 1000).unwrap();
    let b = alloc(&mut pool, &mut dev, 2000).unwrap();
    let c = alloc(&mut pool, &mut dev, 3000).unwrap();
    assert_eq!((a.size, b.size, c.size), (1024, 2048, 3072));
    assert_eq!(b.addr, a.addr.offset(1024));
    assert_eq!(pool.blocks().len(), 4);
    assert_eq!(pool.free(b.id), Ok(2048));
    assert_eq!(pool.blocks().len(), 4);
    assert_eq!(pool.free(a.id), Ok(1024));
    // a and b merged.
    assert_eq!(
        pool.blocks()[0],
        (
            Block {
                id: BlockId::FREE,
                addr: a.addr,
                size: 3072
            },
            false
        )
    );
    assert_eq!(pool.free(c.id), Ok(3072));
    assert_eq!(
        pool.blocks(),
        [(
            Block {
                id: BlockId::FREE,
                addr: a.addr,
                size: 2 * MIB
            },
            false
        )]
    );
    assert_eq!(pool.stats().allocated, 0);
    assert_eq!(pool.stats().peak_allocated, 6144);
}

#[test]
fn adjacent_segments_do_not_coalesce() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, MIB).unwrap();
    let b = alloc(&mut pool, &mut dev, MIB).unwrap();
    let c = alloc(&mut pool, &mut dev, MIB).unwrap(); // second segment, adjacent
    assert_eq!(c.addr, b.addr.offset(MIB));
    for id in [a.id, b.id, c.id] {
        pool.free(id).unwrap();
    }
    assert_eq!(pool.blocks().len(), 2);
    pool.check_invariants().unwrap();
}

#[test]
fn best_fit_takes_the_smallest_fitting_block() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let mut holes = Vec::new();
    for size in [4096, 2048, 8192] {
        holes.push(alloc(&mut pool, &mut dev, size).unwrap());
        alloc(&mut pool, &mut dev, 512).unwrap(); // separator
    }
    for h in &holes {
        pool.free(h.id).unwrap();
    }
    let x = alloc(&mut pool, &mut dev, 1500).unwrap();
    assert_eq!(x.addr, holes[1].addr);
    let y = alloc(&mut pool, &mut dev, 3000).unwrap();
    assert_eq!(y.addr, holes[0].addr);
    let z = alloc(&mut pool, &mut dev, 8192).unwrap();
    assert_eq!((z.addr, z.size), (holes[2].addr, 8192));
    assert_eq!(dev.grows.len(), 1);
}

#[test]
fn unknown_and_stale_ids_are_errors() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 100).unwrap();
    assert_eq!(
        pool.free(BlockId::FREE),
        Err(PoolError::UnknownBlock { id: BlockId::FREE })
    );
    pool.free(a.id).unwrap();
    let err = pool.free(a.id).unwrap_err();
    assert_eq!(err, PoolError::UnknownBlock { id: a.id });
    assert!(err.to_string().starts_with("block#"), "{err}");
    let b = alloc(&mut pool, &mut dev, 100).unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!(b.addr, a.addr);
    let placed = pool.restore(&[(b.addr, 100)]);
    let c = placed[0].unwrap();
    assert_eq!((c.addr, c.size), (b.addr, 512));
    assert_eq!(pool.free(b.id), Err(PoolError::UnknownBlock { id: b.id }));
    assert_eq!(pool.free(c.id), Ok(512));
    assert!(pool.block(c.id).is_none());
}

#[test]
fn restore_widens_unaligned_ranges() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 100).unwrap();
    let placed = pool.restore(&[
        (a.addr.offset(100), 1000),
        (a.addr.offset(2048), 0),
        (a.addr.offset(2 * MIB - 512), 513),
        (a.addr.offset(1024), 1),
    ]);
    let sizes: Vec<Option<(DevicePtr, usize)>> =
        placed.iter().map(|b| b.map(|b| (b.addr, b.size))).collect();
    assert_eq!(
        sizes,
        [
            Some((a.addr, 1536)),
            Some((a.addr.offset(2048), 512)),
            None,
            None
        ]
    );
    assert_eq!(pool.stats().allocated, 2048);
    assert_eq!(pool.stats().live_blocks, 2);
    pool.check_invariants().unwrap();
}

#[test]
fn failed_grow_leaves_the_pool_unchanged() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    alloc(&mut pool, &mut dev, MIB).unwrap();
    let before = snapshot(&pool);
    dev.fail_next = true;
    let err = alloc(&mut pool, &mut dev, 2 * MIB).unwrap_err();
    assert_eq!(
        err,
        PoolError::Grow {
            bytes: 20 * MIB,
            source: DeviceError::Injected {
                op: DeviceOp::SegmentAlloc
            }
        }
    );
    assert_eq!(snapshot(&pool), before);
    assert!(err.to_string().contains("fault injected"), "{err}");
}

#[test]
fn bad_segments_and_oversized_requests_are_rejected() {
    let mut pool = Pool::new();
    let err = pool.alloc(100, &mut |_| Ok(DevicePtr(0x1001))).unwrap_err();
    assert_eq!(
        err,
        PoolError::BadSegment {
            addr: DevicePtr(0x1001),
            bytes: 2 * MIB
        }
    );
    pool.alloc(100, &mut |_| Ok(DevicePtr(0x10_0000))).unwrap();
    let err = pool
        .alloc(2 * MIB, &mut |_| Ok(DevicePtr(0x20_0000)))
        .unwrap_err();
    assert_eq!(
        err,
        PoolError::BadSegment {
            addr: DevicePtr(0x20_0000),
            bytes: 20 * MIB
        }
    );
    let err = pool
        .alloc(3 * MIB, &mut |_| Ok(DevicePtr(u64::MAX - 511)))
        .unwrap_err();
    assert!(matches!(err, PoolError::BadSegment { .. }));
    let err = pool.alloc(usize::MAX, &mut |_| unreachable!()).unwrap_err();
    assert_eq!(err, PoolError::TooLarge { bytes: usize::MAX });
    assert_eq!(pool.stats().segments, 1);
    pool.check_invariants().unwrap();
}

#[test]
fn release_all_frees_every_segment_and_reports_the_first_error() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(2 * MIB as u64);
    alloc(&mut pool, &mut dev, 100).unwrap();
    alloc(&mut pool, &mut dev, 5 * MIB).unwrap();
    let c = alloc(&mut pool, &mut dev, 16 * MIB).unwrap();
    let segs = pool.segments();
    assert_eq!(segs.len(), 3);
    let mut calls = Vec::new();
    let res = pool.release_all(&mut |p, b| {
        calls.push((p, b));
        if calls.len() >= 2 {
            Err(DeviceError::Injected {
                op: DeviceOp::SegmentFree,
            })
        } else {
            Ok(())
        }
    });
    assert_eq!(calls, segs);
    assert_eq!(
        res,
        Err(PoolError::Release {
            addr: segs[1].0,
            bytes: segs[1].1,
            source: DeviceError::Injected {
                op: DeviceOp::SegmentFree
            }
        })
    );
    let s = pool.stats();
    assert_eq!(
        (s.reserved, s.allocated, s.live_blocks, s.segments),
        (0, 0, 0, 0)
    );
    assert_eq!(s.peak_reserved, (2 + 20 + 16) * MIB);
    assert!(pool.blocks().is_empty());
    assert_eq!(pool.free(c.id), Err(PoolError::UnknownBlock { id: c.id }));
    assert_eq!(pool.release_all(&mut |_, _| unreachable!()), Ok(()));
}

#[test]
fn release_unused_gives_back_only_free_segments() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 100).unwrap();
    let b = alloc(&mut pool, &mut dev, 5 * MIB).unwrap();
    pool.free(b.id).unwrap();
    let mut calls = Vec::new();
    let released = pool.release_unused(&mut |p, n| {
        calls.push((p, n));
        Ok(())
    });
    assert_eq!(released, Ok(20 * MIB));
    assert_eq!(calls, [(b.addr, 20 * MIB)]);
    assert_eq!(pool.segments(), [(a.addr, 2 * MIB)]);
    assert_eq!(pool.stats().reserved, 2 * MIB);
    pool.check_invariants().unwrap();
}

#[test]
fn rollback_is_exact_and_checked() {
    let mut pool = Pool::new();
    let mut dev = FakeDevice::new(0);
    let a = alloc(&mut pool, &mut dev, 100).unwrap();
    let b = alloc(&mut pool, &mut dev, 200).unwrap();
    let cp = pool.checkpoint();
    let before = pool.blocks();
    pool.free(a.id).unwrap();
    let c = alloc(&mut pool, &mut dev, 3 * MIB).unwrap();
    pool.rollback(&cp);
    let mut after = pool.blocks();
    // The new large segment stays, entirely free.
    assert_eq!(
        after.pop(),
        Some((
            Block {
                id: BlockId::FREE,
                addr: c.addr,
                size: 20 * MIB
            },
            false
        ))
    );
    assert_eq!(after, before);
    assert_eq!(pool.free(c.id), Err(PoolError::UnknownBlock { id: c.id }));
    assert_eq!(pool.block(b.id), Some(b));
    // A checkpoint of another pool is refused.
    let other = Pool::new().checkpoint();
    assert_eq!(pool.try_rollback(&other), Err(PoolError::ForeignCheckpoint));
    pool.rollback(&other);
    assert_eq!(pool.block(b.id), Some(b));
    // A checkpoint naming a released segment is stale.
    let cp2 = pool.checkpoint();
    pool.free(a.id).unwrap();
    pool.free(b.id).unwrap();
    pool.release_unused(&mut |_, _| Ok(())).unwrap();
    assert_eq!(
        pool.try_rollback(&cp2),
        Err(PoolError::StaleCheckpoint { segment: a.addr })
    );
    let next = alloc(&mut pool, &mut dev, 100).unwrap();
    assert!(next.id > c.id);
}

#[test]
fn rollback_does_not_mistake_a_new_segment_at_a_reused_address() {
    let mut pool = Pool::new();
    let a = pool.alloc(100, &mut |_| Ok(DevicePtr(0x10_0000))).unwrap();
    let cp = pool.checkpoint();
    pool.free(a.id).unwrap();
    assert_eq!(pool.release_unused(&mut |_, _| Ok(())), Ok(2 * MIB));
    // The device hands the same address out again: a different segment.
    let b = pool.alloc(5000, &mut |_| Ok(DevicePtr(0x10_0000))).unwrap();
    assert_eq!(
        pool.try_rollback(&cp),
        Err(PoolError::StaleCheckpoint {
            segment: DevicePtr(0x10_0000)
        })
    );
    assert_eq!(pool.block(b.id), Some(b));
    pool.rollback(&cp);
    assert_eq!(
        pool.blocks(),
        [(
            Block {
                id: BlockId::FREE,
                addr: DevicePtr(0x10_0000),
                size: 2 * MIB
            },
            false
        )]
    );
    assert_eq!(pool.free(a.id), Err(PoolError::UnknownBlock { id: a.id }));
}
