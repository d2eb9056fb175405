//! The pool against a trivially correct model (proptest, with shrinking), plus unit tests.
//!
//! The model is a map of allocated ranges, a set of mapped granules and a set of pinned
//! granules. From them it computes the free gaps, and from the gaps exactly what the pool must
//! do: best fit (smallest gap that fits, lowest address among equals), which granules it maps,
//! what `release_unused` unmaps. A fake backing checks every call against the device rules and
//! keeps its own set of mapped granules, which must always equal the pool's and the model's.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use graft_core::PoolError;
use graft_core::backend::CoreOnly;
use graft_core::testing::{Backing, Block, BlockId, Checkpoint, Pool};
use graft_core::{DeviceError, DeviceOp, DevicePtr};
use proptest::prelude::*;
use proptest::sample::Index;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Granularity of the fake backing in the model test: small, so blocks share granules.
const GRAN: usize = 2 * KIB;
/// Where the fake backing's reservations start; each new one is placed after the last.
const BASE: u64 = 1 << 32;

/// A backing that checks every call against the device rules and records what is mapped.
#[derive(Debug)]
struct FakeBacking {
    gran: usize,
    state: RefCell<FakeState>,
}

#[derive(Debug, Default)]
struct FakeState {
    next: u64,
    reservation: Option<(u64, usize)>,
    /// Mapped granules (addresses).
    mapped: BTreeSet<u64>,
    fail_next_map: bool,
    /// Rule violations seen (must stay empty).
    violations: Vec<String>,
    maps: usize,
    reserves: usize,
}

impl FakeBacking {
    fn new(gran: usize) -> FakeBacking {
        FakeBacking {
            gran,
            state: RefCell::new(FakeState {
                next: BASE,
                ..FakeState::default()
            }),
        }
    }

    fn granules(&self, addr: DevicePtr, bytes: usize) -> Vec<u64> {
        (0..bytes / self.gran)
            .map(|i| addr.0 + (i * self.gran) as u64)
            .collect()
    }

    /// Checks a map/unmap range; records a violation and returns an error when it is bad.
    fn check_range(&self, op: DeviceOp, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let mut st = self.state.borrow_mut();
        let inside = st
            .reservation
            .is_some_and(|(b, s)| addr.0 >= b && addr.0 + bytes as u64 <= b + s as u64);
        let aligned =
            bytes > 0 && bytes.is_multiple_of(self.gran) && addr.0.is_multiple_of(self.gran as u64);
        if !inside || !aligned {
            st.violations.push(format!("{op} {addr}+{bytes}"));
            return Err(DeviceError::InvalidArgument {
                op,
                what: "bad range",
            });
        }
        Ok(())
    }

    fn mapped(&self) -> BTreeSet<u64> {
        self.state.borrow().mapped.clone()
    }

    fn violations(&self) -> Vec<String> {
        self.state.borrow().violations.clone()
    }

    fn fail_next_map(&self) {
        self.state.borrow_mut().fail_next_map = true;
    }
}

impl Backing for FakeBacking {
    fn granularity(&self) -> usize {
        self.gran
    }

    fn reserve(&self, _: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let mut st = self.state.borrow_mut();
        if st.reservation.is_some() || !bytes.is_multiple_of(self.gran) {
            st.violations.push(format!("reserve {bytes}"));
        }
        let addr = st.next;
        st.next += bytes as u64 + self.gran as u64;
        st.reservation = Some((addr, bytes));
        st.reserves += 1;
        Ok(DevicePtr(addr))
    }

    fn release_reservation(
        &self,
        _: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let mut st = self.state.borrow_mut();
        if st.reservation != Some((addr.0, bytes)) || !st.mapped.is_empty() {
            st.violations.push(format!("release {addr}+{bytes}"));
        }
        st.reservation = None;
        Ok(())
    }

    fn map(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        self.check_range(DeviceOp::Map, addr, bytes)?;
        let gs = self.granules(addr, bytes);
        let mut st = self.state.borrow_mut();
        if std::mem::take(&mut st.fail_next_map) {
            return Err(DeviceError::OutOfMemory {
                op: DeviceOp::Map,
                bytes,
            });
        }
        if gs.iter().any(|g| st.mapped.contains(g)) {
            st.violations.push(format!("map twice {addr}+{bytes}"));
        }
        st.mapped.extend(gs);
        st.maps += 1;
        Ok(())
    }

    fn unmap(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        self.check_range(DeviceOp::Unmap, addr, bytes)?;
        let gs = self.granules(addr, bytes);
        let mut st = self.state.borrow_mut();
        for g in gs {
            if !st.mapped.remove(&g) {
                st.violations.push(format!("unmap unmapped {g:#x}"));
            }
        }
        Ok(())
    }
}

/// The trivially correct model.
#[derive(Debug, Clone, Default)]
struct Model {
    reservation: Option<(u64, usize)>,
    /// addr -> (size, id)
    allocated: BTreeMap<u64, (usize, BlockId)>,
    mapped: BTreeSet<u64>,
    pinned: BTreeSet<u64>,
    peak_mapped: usize,
    peak_allocated: usize,
}

fn round(bytes: usize) -> usize {
    bytes.max(1).next_multiple_of(512)
}

impl Model {
    fn gran_floor(&self, a: u64) -> u64 {
        let (b, _) = self.reservation.unwrap();
        b + (a - b) / GRAN as u64 * GRAN as u64
    }

    /// Granules touched by `[a, a+len)`.
    fn touched(&self, a: u64, len: usize) -> impl Iterator<Item = u64> {
        let first = self.gran_floor(a);
        let end = a + len as u64;
        (first..end).step_by(GRAN)
    }

    fn is_mapped(&self, a: u64, len: usize) -> bool {
        self.touched(a, len).all(|g| self.mapped.contains(&g))
    }

    /// Free gaps (addr, size), address order.
    fn gaps(&self) -> Vec<(u64, usize)> {
        let Some((base, size)) = self.reservation else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut cursor = base;
        for (&a, &(s, _)) in &self.allocated {
            if a > cursor {
                out.push((cursor, (a - cursor) as usize));
            }
            cursor = a + s as u64;
        }
        let end = base + size as u64;
        if end > cursor {
            out.push((cursor, (end - cursor) as usize));
        }
        out
    }

    fn allocated_bytes(&self) -> usize {
        self.allocated.values().map(|(s, _)| s).sum()
    }

    fn note_peaks(&mut self) {
        self.peak_mapped = self.peak_mapped.max(self.mapped.len() * GRAN);
        self.peak_allocated = self.peak_allocated.max(self.allocated_bytes());
    }
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Free(Index),
    Pin(Index, usize),
    ReleaseUnused,
    Checkpoint,
    Rollback,
    TryRollback,
    Restore(Vec<(Index, usize)>),
    ReleaseAll,
    FailNextMap,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => prop_oneof![0..=4 * KIB, 4 * KIB..=24 * KIB].prop_map(Op::Alloc),
        5 => any::<Index>().prop_map(Op::Free),
        1 => (any::<Index>(), 0..3 * KIB).prop_map(|(i, l)| Op::Pin(i, l)),
        2 => Just(Op::ReleaseUnused),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Rollback),
        1 => Just(Op::TryRollback),
        1 => prop::collection::vec((any::<Index>(), 0..2 * KIB), 0..5).prop_map(Op::Restore),
        1 => Just(Op::ReleaseAll),
        1 => Just(Op::FailNextMap),
    ]
}

/// Compares the pool, the model and the fake backing.
fn check(pool: &Pool, model: &Model, fake: &FakeBacking) -> Result<(), TestCaseError> {
    pool.check_invariants()
        .map_err(|e| TestCaseError::fail(format!("invariant: {e}")))?;
    prop_assert_eq!(fake.violations(), Vec::<String>::new());
    let allocated: BTreeMap<u64, (usize, BlockId)> = pool
        .blocks()
        .into_iter()
        .filter(|(_, a)| *a)
        .map(|(b, _)| (b.addr.0, (b.size, b.id)))
        .collect();
    prop_assert_eq!(&allocated, &model.allocated);
    let pool_mapped: BTreeSet<u64> = pool
        .mapped()
        .into_iter()
        .flat_map(|(a, len)| (a.0..a.0 + len as u64).step_by(GRAN))
        .collect();
    prop_assert_eq!(&pool_mapped, &model.mapped);
    prop_assert_eq!(&fake.mapped(), &model.mapped);
    let pinned: BTreeSet<u64> = pool
        .pinned()
        .into_iter()
        .flat_map(|(a, len)| (a.0..a.0 + len as u64).step_by(GRAN))
        .collect();
    prop_assert_eq!(&pinned, &model.pinned);
    for (&a, &(s, _)) in &model.allocated {
        prop_assert!(model.is_mapped(a, s), "allocated block {a:#x} not mapped");
    }
    let st = pool.stats();
    prop_assert_eq!(st.allocated, model.allocated_bytes());
    prop_assert_eq!(st.mapped, model.mapped.len() * GRAN);
    prop_assert_eq!(st.live_blocks, model.allocated.len());
    prop_assert_eq!(st.peak_mapped, model.peak_mapped);
    prop_assert_eq!(st.peak_allocated, model.peak_allocated);
    prop_assert_eq!(pool.reservation().map(|(a, s)| (a.0, s)), model.reservation);
    Ok(())
}

const RESERVATION: usize = 160 * KIB;

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let fake = FakeBacking::new(GRAN);
    let mut pool = Pool::new(RESERVATION);
    let mut model = Model::default();
    let mut cp: Option<(Checkpoint, Model)> = None;
    for op in ops {
        match op {
            Op::Alloc(bytes) => {
                let size = round(bytes);
                if model.reservation.is_none() {
                    let base = fake.state.borrow().next;
                    model.reservation = Some((base, RESERVATION));
                }
                let fit = model
                    .gaps()
                    .into_iter()
                    .filter(|&(_, s)| s >= size)
                    .min_by_key(|&(a, s)| (s, a));
                let failing = fake.state.borrow().fail_next_map;
                let res = pool.alloc(bytes, &fake);
                match fit {
                    None => prop_assert!(
                        matches!(res, Err(PoolError::ReservationExhausted { .. })),
                        "{res:?}"
                    ),
                    Some((addr, _)) => {
                        let new: Vec<u64> = model
                            .touched(addr, size)
                            .filter(|g| !model.mapped.contains(g))
                            .collect();
                        if failing && !new.is_empty() {
                            prop_assert!(matches!(res, Err(PoolError::Grow { .. })), "{res:?}");
                        } else {
                            let b = res.map_err(|e| TestCaseError::fail(e.to_string()))?;
                            prop_assert_eq!((b.addr.0, b.size), (addr, size));
                            model.mapped.extend(new);
                            model.allocated.insert(addr, (size, b.id));
                            model.note_peaks();
                        }
                    }
                }
                // A failure armed but not consumed (no new granule needed) stays armed in
                // the fake; disarm it so the model's expectation stays simple.
                fake.state.borrow_mut().fail_next_map = false;
            }
            Op::Free(i) => {
                if model.allocated.is_empty() {
                    prop_assert!(pool.free(BlockId(u64::MAX - 1)).is_err());
                    continue;
                }
                let (&a, &(s, id)) = model
                    .allocated
                    .iter()
                    .nth(i.index(model.allocated.len()))
                    .unwrap();
                prop_assert_eq!(pool.free(id), Ok(s));
                prop_assert_eq!(
                    pool.free(id),
                    Err(PoolError::UnknownBlock { id }),
                    "double free"
                );
                model.allocated.remove(&a);
            }
            Op::Pin(i, len) => {
                let Some((base, size)) = model.reservation else {
                    pool.pin(&[(DevicePtr(BASE), len)]);
                    continue;
                };
                let start = base + (i.index(size / 512) * 512) as u64;
                let len = len.min((base + size as u64 - start) as usize);
                pool.pin(&[(DevicePtr(start), len)]);
                if len > 0 {
                    let gs: Vec<u64> = model.touched(start, len).collect();
                    model.pinned.extend(gs);
                }
            }
            Op::ReleaseUnused => {
                let keep: BTreeSet<u64> = model
                    .allocated
                    .iter()
                    .flat_map(|(&a, &(s, _))| model.touched(a, s).collect::<Vec<_>>())
                    .chain(model.pinned.iter().copied())
                    .collect();
                let before = model.mapped.len();
                model.mapped.retain(|g| keep.contains(g));
                let released = (before - model.mapped.len()) * GRAN;
                prop_assert_eq!(pool.release_unused(&fake), Ok(released));
            }
            Op::Checkpoint => cp = Some((pool.checkpoint(), model.clone())),
            Op::Rollback | Op::TryRollback => {
                let Some((c, old)) = &cp else { continue };
                let same_reservation = old.reservation.is_some()
                    && old.reservation == model.reservation
                    && fake.state.borrow().reserves == 1;
                let stale = old
                    .allocated
                    .iter()
                    .any(|(&a, &(s, _))| !same_reservation || !model.is_mapped(a, s));
                if matches!(op, Op::TryRollback) {
                    let res = pool.try_rollback(c);
                    if stale {
                        prop_assert!(
                            matches!(res, Err(PoolError::StaleCheckpoint { .. })),
                            "{res:?}"
                        );
                        check(&pool, &model, &fake)?;
                        continue;
                    }
                    prop_assert_eq!(res, Ok(()));
                } else {
                    pool.rollback(c);
                }
                model.allocated = if same_reservation {
                    old.allocated
                        .iter()
                        .filter(|&(&a, &(s, _))| model.is_mapped(a, s))
                        .map(|(&a, &v)| (a, v))
                        .collect()
                } else {
                    BTreeMap::new()
                };
                model.note_peaks();
            }
            Op::Restore(picks) => {
                let Some((base, size)) = model.reservation else {
                    prop_assert_eq!(pool.restore(&[(DevicePtr(BASE), 16)]), vec![None]);
                    continue;
                };
                let live: Vec<(DevicePtr, usize)> = picks
                    .iter()
                    .map(|(i, len)| {
                        let a = base + i.index(size) as u64;
                        (DevicePtr(a), *len)
                    })
                    .collect();
                let placed = pool.restore(&live);
                let mut new = BTreeMap::new();
                for (&(addr, len), got) in live.iter().zip(&placed) {
                    let start = addr.0 - addr.0 % 512;
                    let end = (addr.0 + len.max(1) as u64).next_multiple_of(512);
                    let ok = end <= base + size as u64
                        && model.is_mapped(start, (end - start) as usize)
                        && !new.iter().any(|(&s, &(l, _)): (&u64, &(usize, BlockId))| {
                            s < end && start < s + l as u64
                        });
                    match got {
                        Some(b) if ok => {
                            prop_assert_eq!((b.addr.0, b.size as u64), (start, end - start));
                            new.insert(start, (b.size, b.id));
                        }
                        None if !ok => {}
                        other => prop_assert!(false, "restore of {addr}+{len}: {other:?}"),
                    }
                }
                model.allocated = new;
                model.note_peaks();
            }
            Op::ReleaseAll => {
                prop_assert_eq!(pool.release_all(&fake), Ok(()));
                model.reservation = None;
                model.allocated.clear();
                model.mapped.clear();
                model.pinned.clear();
                fake.state.borrow_mut().reserves = 0;
            }
            Op::FailNextMap => fake.fail_next_map(),
        }
        check(&pool, &model, &fake)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}

// ----- unit tests ---------------------------------------------------------------------------

/// A fake with the simulator's 2 MiB granularity.
fn fake2m() -> FakeBacking {
    FakeBacking::new(2 * MIB)
}

#[test]
fn siblings_of_growing_size_reuse_the_range_in_place() {
    // The defect this pool fixes: after a common root, eight branches allocate 4..32 MiB of
    // scratch in turn. Memory must end at the largest single path.
    let fake = fake2m();
    let mut pool = Pool::new(256 << 30);
    let root = pool.alloc(4 * KIB, &fake).unwrap();
    for round in 0..3 {
        for k in 1..=8usize {
            let k = if round == 0 { k } else { 9 - k };
            let scratch = pool.alloc(k * 4 * MIB, &fake).unwrap();
            let out = pool.alloc(KIB, &fake).unwrap();
            assert_eq!(
                scratch.addr,
                root.addr.offset(4 * KIB),
                "scratch reuses the same range"
            );
            pool.free(scratch.id).unwrap();
            pool.free(out.id).unwrap();
        }
    }
    let largest = (4 * KIB + 32 * MIB + KIB).next_multiple_of(2 * MIB);
    assert_eq!(pool.stats().mapped, largest);
    assert_eq!(pool.stats().peak_mapped, largest);
    assert_eq!(pool.stats().mapped_ranges, 1);
    assert_eq!(fake.state.borrow().reserves, 1);
    pool.check_invariants().unwrap();
}

#[test]
fn a_failed_map_leaves_the_pool_unchanged() {
    let fake = fake2m();
    let mut pool = Pool::new(64 * MIB);
    let a = pool.alloc(MIB, &fake).unwrap();
    let before = (pool.blocks(), pool.mapped(), pool.stats());
    fake.fail_next_map();
    let err = pool.alloc(8 * MIB, &fake).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Grow {
                source: DeviceError::OutOfMemory { .. },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!((pool.blocks(), pool.mapped(), pool.stats()), before);
    assert_eq!(fake.mapped().len(), 1);
    // Memory already mapped needs no map: a failure armed now does not fire.
    fake.fail_next_map();
    let b = pool.alloc(MIB, &fake).unwrap();
    assert_eq!(b.addr, a.addr.offset(MIB));
    pool.check_invariants().unwrap();
}

#[test]
fn requests_beyond_the_reservation_say_what_to_raise() {
    let fake = fake2m();
    let mut pool = Pool::new(8 * MIB);
    let err = pool.alloc(9 * MIB, &fake).unwrap_err();
    assert!(
        matches!(err, PoolError::ReservationExhausted { reservation, .. } if reservation == 8 * MIB)
    );
    assert!(
        err.to_string().contains("Config::pool_reservation"),
        "{err}"
    );
    assert!(matches!(
        pool.alloc(usize::MAX, &fake),
        Err(PoolError::TooLarge { .. })
    ));
    pool.check_invariants().unwrap();
}

#[test]
fn release_unused_keeps_allocated_and_pinned_granules() {
    let fake = fake2m();
    let mut pool = Pool::new(64 * MIB);
    let a = pool.alloc(MIB, &fake).unwrap();
    let b = pool.alloc(6 * MIB, &fake).unwrap();
    let c = pool.alloc(MIB, &fake).unwrap();
    assert_eq!(pool.stats().mapped, 8 * MIB);
    pool.pin(&[(c.addr, c.size)]);
    pool.free(b.id).unwrap();
    pool.free(c.id).unwrap();
    // a's granule and the pinned granule of c stay; the two granules between them go.
    assert_eq!(pool.release_unused(&fake), Ok(4 * MIB));
    assert_eq!(
        pool.mapped(),
        [(a.addr, 2 * MIB), (a.addr.offset(6 * MIB), 2 * MIB)]
    );
    assert_eq!(pool.stats().mapped_ranges, 2);
    assert_eq!(pool.release_unused(&fake), Ok(0));
    pool.check_invariants().unwrap();
    // Growing again maps the hole back, in place.
    let d = pool.alloc(5 * MIB, &fake).unwrap();
    assert_eq!(d.addr, a.addr.offset(MIB));
    assert_eq!(pool.stats().mapped, 8 * MIB);
    pool.release_all(&fake).unwrap();
    assert_eq!(fake.mapped().len(), 0);
    assert!(pool.pinned().is_empty());
    assert_eq!(fake.violations(), Vec::<String>::new());
}

#[test]
fn try_rollback_refuses_a_checkpoint_over_unmapped_memory() {
    let fake = fake2m();
    let mut pool = Pool::new(64 * MIB);
    let keep = pool.alloc(MIB, &fake).unwrap();
    let big = pool.alloc(8 * MIB, &fake).unwrap();
    let cp = pool.checkpoint();
    pool.free(big.id).unwrap();
    pool.release_unused(&fake).unwrap();
    let before = pool.blocks();
    assert_eq!(
        pool.try_rollback(&cp),
        Err(PoolError::StaleCheckpoint {
            addr: big.addr,
            bytes: big.size
        })
    );
    assert_eq!(pool.blocks(), before, "unchanged on error");
    // The infallible rollback leaves the stale block out.
    pool.rollback(&cp);
    assert_eq!(pool.block(keep.id), Some(keep));
    assert_eq!(pool.block(big.id), None);
    pool.check_invariants().unwrap();
    let other = Pool::new(64 * MIB).checkpoint();
    assert_eq!(pool.try_rollback(&other), Err(PoolError::ForeignCheckpoint));
}

#[test]
fn rollback_and_restore_are_exact_and_keep_the_mapping() {
    let fake = fake2m();
    let mut pool = Pool::new(64 * MIB);
    let a = pool.alloc(3000, &fake).unwrap();
    let cp = pool.checkpoint();
    let b = pool.alloc(4 * MIB, &fake).unwrap();
    let mapped = pool.mapped();
    pool.rollback(&cp);
    assert_eq!(pool.checkpoint().allocated().collect::<Vec<Block>>(), [a]);
    assert_eq!(pool.mapped(), mapped, "rollback unmaps nothing");
    let placed = pool.restore(&[(b.addr, 100), (a.addr, 3000), (b.addr.offset(64), 8)]);
    assert_eq!(placed[0].map(|p| (p.addr, p.size)), Some((b.addr, 512)));
    assert_eq!(placed[1].map(|p| (p.addr, p.size)), Some((a.addr, 3072)));
    assert_eq!(placed[2], None, "overlaps the first range");
    assert_eq!(pool.free(a.id), Err(PoolError::UnknownBlock { id: a.id }));
    assert_eq!(pool.mapped(), mapped);
    pool.check_invariants().unwrap();
}
