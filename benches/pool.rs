//! Benchmarks of the pool's bookkeeping: alloc/free (mapping once, then in place), checkpoint, rollback and restore.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use graft::backend::CoreOnly;
use graft::testing::{Backing, Pool};
use graft::{DeviceError, DevicePtr};

const MIB: usize = 1 << 20;

/// Memory that costs nothing: reservations from a counter, maps and unmaps accepted.
struct Free;

impl Backing for Free {
    fn granularity(&self) -> usize {
        2 * MIB
    }
    fn reserve(&self, _: &CoreOnly, _bytes: usize) -> Result<DevicePtr, DeviceError> {
        Ok(DevicePtr(1 << 40))
    }
    fn release_reservation(&self, _: &CoreOnly, _: DevicePtr, _: usize) -> Result<(), DeviceError> {
        Ok(())
    }
    fn map(&self, _: &CoreOnly, _: DevicePtr, _: usize) -> Result<(), DeviceError> {
        Ok(())
    }
    fn unmap(&self, _: &CoreOnly, _: DevicePtr, _: usize) -> Result<(), DeviceError> {
        Ok(())
    }
}

const RESERVATION: usize = 1 << 40;

/// A pool holding about 100 blocks (about 67 allocated, the rest free holes).
fn fragmented_pool() -> Pool {
    let mut pool = Pool::new(RESERVATION);
    let mut ids = Vec::new();
    for i in 0..100 {
        let size = 512 * (1 + (i * 37) % 64);
        ids.push(pool.alloc(size, &Free).expect("alloc"));
    }
    for b in ids.iter().step_by(3) {
        pool.free(b.id).expect("free");
    }
    pool
}

fn bench_pool(c: &mut Criterion) {
    c.bench_function("pool/alloc_free_small", |b| {
        let mut pool = Pool::new(RESERVATION);
        let keep = pool.alloc(4096, &Free).expect("alloc");
        b.iter(|| {
            let blk = pool.alloc(black_box(4096), &Free).expect("alloc");
            pool.free(blk.id).expect("free")
        });
        black_box(keep);
    });

    c.bench_function("pool/alloc_free_8_mixed", |b| {
        const SIZES: [usize; 8] = [
            512,
            3000,
            64 << 10,
            700 << 10,
            MIB,
            2 * MIB,
            5 * MIB,
            12 * MIB,
        ];
        let mut pool = Pool::new(RESERVATION);
        let mut ids = [None; 8];
        b.iter(|| {
            for (slot, &size) in ids.iter_mut().zip(&SIZES) {
                *slot = Some(pool.alloc(black_box(size), &Free).expect("alloc").id);
            }
            for id in ids.iter_mut().filter_map(Option::take) {
                pool.free(id).expect("free");
            }
        });
    });

    c.bench_function("pool/checkpoint_100_blocks", |b| {
        let pool = fragmented_pool();
        assert!(pool.blocks().len() >= 90);
        b.iter(|| black_box(pool.checkpoint()));
    });

    c.bench_function("pool/rollback_100_blocks", |b| {
        let mut pool = fragmented_pool();
        let cp = pool.checkpoint();
        b.iter(|| pool.rollback(black_box(&cp)));
    });

    c.bench_function("pool/restore_50_live", |b| {
        let mut pool = fragmented_pool();
        let live: Vec<(DevicePtr, usize)> = pool
            .blocks()
            .into_iter()
            .filter(|(_, allocated)| *allocated)
            .take(50)
            .map(|(blk, _)| (blk.addr, blk.size))
            .collect();
        assert_eq!(live.len(), 50);
        b.iter(|| black_box(pool.restore(black_box(&live))));
    });
}

criterion_group!(benches, bench_pool);
criterion_main!(benches);
