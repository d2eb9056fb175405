//! Memory is bounded by the largest single path by construction: sibling branches of different
//! sizes reuse the graph pool's range in place instead of each holding their own memory.
//!
//! A common root function, then one of eight sibling branches whose body allocates 4, 8, ...,
//! 32 MiB of scratch (by key), fills it and writes a small output. The figures printed here are
//! quoted from GPU runs: run the `cuda` variants with `--ignored --nocapture` (not under
//! compute-sanitizer, where they take only a few steps).

mod common;

use common::*;
use graft::{BodyError, Config, Ctx, FunctionId, FunctionSpec, Output, Stats};

const MIB: usize = 1 << 20;
/// Elements of the root's input and of every output.
const N: usize = 4;

/// The branch body for key `k`: scratch of `4k` MiB filled with `k`, out = input + scratch.
fn branch<D: TestDevice>(k: u64) -> Body<'static, D> {
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        let x = ctx.input(0).clone();
        let bytes = k as usize * 4 * MIB;
        let scratch = ctx.alloc(bytes)?;
        ctx.queue().fill_f32(&scratch, bytes / 4, k as f32)?;
        let out = ctx.alloc(N * 4)?;
        ctx.queue().add_f32(&out, &x, &scratch, N)?;
        Ok::<_, BodyError>(vec![Output::new(out, k as u32)])
    })
}

struct Tree<D: TestDevice> {
    g: G<D>,
    root: FunctionId,
    branch: FunctionId,
    x: graft::Buffer,
    runs: Runs,
}

impl<D: TestDevice> Tree<D> {
    fn new(dev: D) -> Tree<D> {
        let mut g = graft(dev, Config::default());
        let root = g.register("root", FunctionSpec::default());
        let branch = g.register("branch", FunctionSpec::default());
        let x = input(&mut g, &[1.0; N]);
        Tree {
            g,
            root,
            branch,
            x,
            runs: Runs::default(),
        }
    }

    /// One step: the root (out = 2x), then branch `k`; checks the values.
    fn step(&mut self, k: u64) {
        let r = self
            .g
            .call(self.root, &[&self.x], &[], affine(2.0, 0.0, &self.runs))
            .unwrap();
        let o = self
            .g
            .call(self.branch, &[&r[0].buffer], &[k], branch(k))
            .unwrap();
        assert_eq!(
            read(&self.g, &o[0].buffer),
            vec![2.0 + k as f32; N],
            "key {k}"
        );
    }

    fn stats(&self) -> Stats {
        self.g.stats()
    }
}

/// Graph-pool memory of the largest single path alone, on a fresh runtime: (held, peak).
fn largest_path<D: TestDevice>(dev: D) -> (usize, usize) {
    let mut t = Tree::new(dev);
    for _ in 0..4 {
        t.step(8);
    }
    let s = t.stats();
    (s.pool.mapped, s.pool.peak_mapped)
}

/// Smallest to largest, then alternating small and large keys.
fn alternating(steps: usize) -> impl Iterator<Item = u64> {
    (1..=8).chain((0..steps).map(|i| {
        let j = (i / 2 % 8) as u64;
        if i % 2 == 0 { 1 + j } else { 8 - j }
    }))
}

/// Seeded pseudo-random keys (a 64-bit LCG).
fn random(steps: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut state = seed;
    (0..steps).map(move |_| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        1 + (state >> 33) % 8
    })
}

fn check_bounded<D: TestDevice>(
    label: &str,
    dev: D,
    reference: D,
    keys: impl Iterator<Item = u64>,
) {
    let (largest, largest_peak) = largest_path(reference);
    let mut t = Tree::new(dev);
    let mut steps = 0;
    for k in keys {
        t.step(k);
        steps += 1;
    }
    let s = t.stats();
    eprintln!(
        "{label}: {steps} steps; graph pool mapped {} MiB (peak {} MiB), allocated peak {} MiB; largest single path alone: mapped {} MiB (peak {} MiB); {} recordings, {} replays",
        s.pool.mapped as f64 / MIB as f64,
        s.pool.peak_mapped as f64 / MIB as f64,
        s.pool.peak_allocated as f64 / MIB as f64,
        largest as f64 / MIB as f64,
        largest_peak as f64 / MIB as f64,
        s.recordings,
        s.replays,
    );
    assert!(largest >= 32 * MIB);
    let bound = largest_peak as f64 * 1.05;
    assert!(
        s.pool.mapped as f64 <= bound && s.pool.peak_mapped as f64 <= bound,
        "graph pool mapped {} (peak {}) exceeds 1.05 x the largest path's {}",
        s.pool.mapped,
        s.pool.peak_mapped,
        largest_peak
    );
    assert_eq!(s.nodes, 9, "one root and eight branches");
    assert!(s.replays > 0);
}

const SIM_STEPS: usize = 400;
const GPU_STEPS: usize = 2000;
/// The steps on either backend under compute-sanitizer ([`graft_testkit::steps`]): still
/// every branch warmed up, recorded and replayed (the first 30 random keys of seed `0x5eed`
/// hold every key at least twice).
const SANITIZED_STEPS: usize = 40;

mod alternating_siblings {
    use super::*;

    #[test]
    fn sim() {
        check_bounded(
            "sim alternating",
            common::sim(),
            common::sim(),
            alternating(graft_testkit::steps(SIM_STEPS, SANITIZED_STEPS)),
        );
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda() {
        check_bounded(
            "cuda alternating",
            common::cuda(),
            common::cuda(),
            alternating(graft_testkit::steps(GPU_STEPS, SANITIZED_STEPS)),
        );
    }
}

mod random_siblings {
    use super::*;

    #[test]
    fn sim() {
        check_bounded(
            "sim random",
            common::sim(),
            common::sim(),
            random(graft_testkit::steps(SIM_STEPS, SANITIZED_STEPS), 0x5eed),
        );
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda() {
        check_bounded(
            "cuda random",
            common::cuda(),
            common::cuda(),
            random(graft_testkit::steps(GPU_STEPS, SANITIZED_STEPS), 0x5eed),
        );
    }
}

/// Every single path fits in 64 MiB, so the whole tree must too.
#[test]
fn fits_a_64_mib_device() {
    let small = graft::sim::SimDevice::with_memory_limit(64 * MIB);
    check_bounded("sim 64 MiB limit", small.clone(), sim(), alternating(100));
    let s = small.stats();
    assert_eq!(
        (s.mapped_bytes, s.reservations),
        (0, 0),
        "dropping the runtime gives every mapping and reservation back"
    );
}
