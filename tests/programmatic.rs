//! Programmatic dependent launch inside graft's calls: kernels launched as dependents (each
//! waiting before it touches what the kernels before it touch) give eager results warming up,
//! recording and replaying, and a dependent that reads before its wait is caught: by the
//! simulator as a `ProgrammaticRace` naming both kernels, on a GPU (compute capability 9.0+)
//! as stale data (so the test can fail on both). On the simulator and (ignored in CI) on CUDA.

mod common;

use common::*;
use graft::{BodyError, CallError, Ctx, DeviceError, FunctionSpec, Outcome, Output};

/// Elements per buffer: a few blocks of the test kernels.
const N: usize = 4096;

/// Clock cycles the slow kernel spins before it fills (~100 µs on an H100).
const SPINS: u64 = 200_000;

/// out = copy(copy(2x + 1)), the two copies launched as dependents that wait first.
fn chained<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let x = ctx.input(0).clone();
        let (t, u, out) = (ctx.alloc(N * 4)?, ctx.alloc(N * 4)?, ctx.alloc(N * 4)?);
        ctx.queue().axpb_f32(&t, &x, 2.0, 1.0, N)?;
        ctx.queue().dependent_copy_f32(&u, &t, N, false)?;
        ctx.queue().dependent_copy_f32(&out, &u, N, false)?;
        Ok(vec![Output::new(out, 0)])
    })
}

// (a) Dependents that wait before touching their predecessors' bytes: eager results in every
// kind of run, one node.
fn dependents_that_wait_give_eager_results<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("chained", FunctionSpec::default());
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for v in [1.0f32, 2.0, 3.0, 4.0] {
        let values: Vec<f32> = (0..N).map(|i| v + i as f32).collect();
        let x = input(&mut g, &values);
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(f, &[&x], &[], chained(&runs), &mut out)
                .unwrap(),
        );
        let want: Vec<f32> = values.iter().map(|x| 2.0f32.mul_add(*x, 1.0)).collect();
        assert_eq!(read(&g, &out[0].buffer), want);
    }
    assert!(
        matches!(
            outcomes[..],
            [
                Outcome::Warmup,
                Outcome::Recorded(_),
                Outcome::Replayed(_),
                Outcome::Replayed(_)
            ]
        ),
        "{outcomes:?}"
    );
    assert_eq!(runs.get(), 2, "replays do not run the body");
}
device_test!(
    programmatic_01_dependents_that_wait_give_eager_results,
    dependents_that_wait_give_eager_results
);

/// A slow fill of `src` with 2.0, then a dependent copy of `src` into a new output that reads
/// before its wait.
fn racy<D: TestDevice>() -> Body<'static, D> {
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        let src = ctx.input(0).clone();
        let out = ctx.alloc(N * 4)?;
        ctx.queue().slow_fill_f32(&src, N, 2.0, SPINS)?;
        ctx.queue().dependent_copy_f32(&out, &src, N, true)?;
        Ok(vec![Output::new(out, 0)])
    })
}

// (b) A dependent that reads before its wait: the simulator refuses the run, naming both
// kernels; a GPU copies stale values (what `src` held before the slow fill) in at least one
// of a few eager runs.
fn a_dependent_reading_before_its_wait_is_caught<D: TestDevice>(dev: D) {
    let mut g = graft(dev.clone(), unguarded());
    let probe = g.register("probe", FunctionSpec::default());
    let src = input(&mut g, &[1.0; N]);
    let queue_overlaps = {
        let mut overlaps = false;
        g.call(probe, &[], &[], |ctx: &mut Ctx<'_, D>| {
            overlaps = ctx.queue().dependents_overlap();
            Ok(Vec::new())
        })
        .unwrap();
        overlaps
    };
    if !queue_overlaps {
        eprintln!("skipped: this device or driver cannot launch programmatic dependents");
        return;
    }
    let mut stale_runs = 0;
    for attempt in 0..5 {
        g.write_f32(&src, &[1.0; N]).unwrap();
        // A new function each time, so that its first call runs eagerly.
        let f = g.register(&format!("racy {attempt}"), FunctionSpec::default());
        match g.call(f, &[&src], &[], racy()) {
            Err(CallError::Body {
                source:
                    BodyError::Device(DeviceError::ProgrammaticRace {
                        dependent,
                        predecessor,
                        ..
                    }),
                ..
            }) => {
                assert_eq!(
                    (dependent, predecessor),
                    ("dependent_copy_f32", "slow_fill_f32")
                );
                return;
            }
            Ok(_) if graft_testkit::under_sanitizer() => {
                eprintln!(
                    "skipped: compute-sanitizer runs one kernel at a time, so nothing overlaps"
                );
                return;
            }
            Ok(out) => {
                let got = read(&g, &out[0].buffer);
                if got.contains(&1.0) {
                    stale_runs += 1;
                }
            }
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert!(
        stale_runs > 0,
        "a dependent reading before its wait always saw the finished fill: the race went unseen"
    );
}
device_test!(
    programmatic_02_a_dependent_reading_before_its_wait_is_caught,
    a_dependent_reading_before_its_wait_is_caught
);

// (c) The simulator's chain: a dependent's early read races with any kernel that may still
// run (the plain kernel two launches back, while the kernel between is a dependent too), and
// not with one a copy separated it from.
#[test]
fn programmatic_03_the_chain_reaches_back_to_the_last_plain_kernel() {
    let dev = common::sim();
    let mut g = graft(dev, unguarded());
    let f = g.register("chain", FunctionSpec::default());
    let src = input(&mut g, &[1.0; N]);
    let err = g
        .call(
            f,
            &[&src],
            &[],
            |ctx: &mut Ctx<'_, graft::sim::SimDevice>| {
                let src = ctx.input(0).clone();
                let (a, b, c) = (ctx.alloc(N * 4)?, ctx.alloc(N * 4)?, ctx.alloc(N * 4)?);
                ctx.queue().fill_f32(&a, N, 3.0)?;
                ctx.queue().dependent_copy_f32(&b, &src, N, true)?;
                ctx.queue().dependent_copy_f32(&c, &a, N, true)?;
                Ok(vec![Output::new(c, 0)])
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Body {
                source: BodyError::Device(DeviceError::ProgrammaticRace {
                    predecessor: "fill_f32",
                    ..
                }),
                ..
            }
        ),
        "{err}"
    );
    let g2 = g.register("separated", FunctionSpec::default());
    let out = g
        .call(
            g2,
            &[&src],
            &[],
            |ctx: &mut Ctx<'_, graft::sim::SimDevice>| {
                let src = ctx.input(0).clone();
                let (a, b) = (ctx.alloc(N * 4)?, ctx.alloc(N * 4)?);
                ctx.queue().fill_f32(&a, N, 3.0)?;
                ctx.queue().copy(&b, &src, N * 4)?;
                ctx.queue().dependent_copy_f32(&a, &b, N, true)?;
                Ok(vec![Output::new(a, 0)])
            },
        )
        .unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![1.0; N]);
}
