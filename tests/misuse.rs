//! Misuse and faults: every one is a typed error or a documented fallback, never a panic,
//! and the tree and pool stay consistent afterwards.

mod common;

use common::*;
use graft::sim::SimDevice;
use graft::{
    BodyError, CallError, Config, Ctx, Decision, DeviceError, DeviceOp, EagerReason, FunctionSpec,
    Graft, MemoryError, Outcome, Output,
};

fn unknown_function_is_an_error<D: TestDevice>(dev: D) {
    let mut g = graft(dev.clone(), Config::default());
    let mut other = graft(dev, Config::default());
    let _ = other.register("a", FunctionSpec::default());
    let foreign = other.register("b", FunctionSpec::default());
    let x = input(&mut g, &[1.0]);
    let runs = Runs::default();
    let err = g
        .call(foreign, &[&x], &[], affine(1.0, 0.0, &runs))
        .unwrap_err();
    assert!(matches!(err, CallError::UnknownFunction { .. }), "{err}");
    assert!(err.to_string().contains("register the function"));
    assert_eq!(runs.get(), 0);
}
device_test!(unknown_function_is_an_error, unknown_function_is_an_error);

#[test]
fn input_of_another_device_is_an_error() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let mut h: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let foreign = input(&mut h, &[1.0; 4]);
    let runs = Runs::default();
    let err = g
        .call(f, &[&foreign], &[], affine(1.0, 0.0, &runs))
        .unwrap_err();
    assert!(
        matches!(err, CallError::WrongDevice { position: 0, .. }),
        "{err}"
    );
    assert!(matches!(
        g.read_f32(&foreign),
        Err(MemoryError::WrongDevice { .. })
    ));
}

fn body_errors_are_returned<D: TestDevice>(dev: D) {
    #[derive(Debug, thiserror::Error)]
    #[error("shape mismatch")]
    struct Shape;
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    for _ in 0..3 {
        let err = g
            .call(f, &[&x], &[], |_: &mut Ctx<'_, D>| {
                Err(BodyError::Framework(Box::new(Shape)))
            })
            .unwrap_err();
        assert!(err.to_string().contains("shape mismatch"), "{err}");
    }
    // The failed calls left nothing behind.
    let s = g.stats();
    assert_eq!((s.nodes, s.pool.live_blocks), (0, 0));
    // A framework error during recording is returned too, and the pool is rolled back.
    let runs = Runs::default();
    g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    let err = g
        .call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
            let _scratch = ctx.alloc(4096)?;
            Err(BodyError::Framework(Box::new(Shape)))
        })
        .unwrap_err();
    assert!(matches!(err, CallError::Body { .. }), "{err}");
    assert_eq!(g.stats().nodes, 0);
    assert_eq!(g.stats().pool.live_blocks, 0);
    let out = g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![2.0; 4]);
}
device_test!(body_errors_are_returned, body_errors_are_returned);

fn raw_allocation_during_capture_falls_back<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    for _ in 0..3 {
        let out = g
            .call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
                let p = ctx.queue().raw_alloc(64)?;
                ctx.queue().raw_free(p)?;
                let out = ctx.alloc(16)?;
                ctx.queue().fill_f32(&out, 4, 5.0)?;
                Ok(vec![Output::new(out, 0)])
            })
            .unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![5.0; 4]);
    }
    assert!(g.explain().any(|d| matches!(
        d.decision,
        Decision::Eager(EagerReason::CaptureFailed {
            op: DeviceOp::RawAlloc,
            ..
        })
    )));
}
device_test!(
    raw_allocation_during_capture_falls_back,
    raw_allocation_during_capture_falls_back
);

#[test]
fn failed_map_during_recording_keeps_state_consistent() {
    let dev = SimDevice::new();
    let mut g: G<SimDevice> = graft(dev.clone(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    // The recording needs new mapped memory for its 4 MiB scratch: make that allocation fail.
    dev.fail_map_after(0);
    let big = |ctx: &mut Ctx<'_, SimDevice>| {
        let scratch = ctx.alloc(4 << 20)?;
        let out = ctx.alloc(16)?;
        ctx.queue().fill_f32(&scratch, 1, 1.0)?;
        ctx.queue().fill_f32(&out, 4, 1.0)?;
        Ok(vec![Output::new(out, 0)])
    };
    let err = g.call(f, &[&x], &[], big).unwrap_err();
    assert!(
        matches!(
            &err,
            CallError::Body {
                source: BodyError::Pool(_),
                ..
            } | CallError::Pool { .. }
        ),
        "{err}"
    );
    assert_eq!(g.stats().nodes, 0);
    assert_eq!(
        g.phase(),
        graft::Phase::Idle,
        "the lifecycle is back where it was"
    );
    // The next call records normally.
    let outcome = g.call_into(f, &[&x], &[], big, &mut Vec::new()).unwrap();
    assert!(matches!(outcome, Outcome::Recorded(_)), "{outcome:?}");
}

#[test]
fn failed_instantiate_falls_back_to_eager() {
    let dev = SimDevice::new();
    let mut g: G<SimDevice> = graft(dev.clone(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    dev.fail_next_instantiate();
    let mut out = Vec::new();
    let outcome = g
        .call_into(f, &[&x], &[], affine(3.0, 0.0, &runs), &mut out)
        .unwrap();
    assert!(
        matches!(
            outcome,
            Outcome::Eager(EagerReason::InstantiateFailed { .. })
        ),
        "{outcome:?}"
    );
    assert_eq!(read(&g, &out[0].buffer), vec![3.0; 4]);
    assert!(g.explain().any(|d| matches!(
        &d.decision,
        Decision::Eager(EagerReason::InstantiateFailed {
            error: DeviceError::Injected {
                op: DeviceOp::Instantiate
            }
        })
    )));
    assert_eq!(
        g.stats().pool.live_blocks,
        0,
        "the failed recording left nothing allocated"
    );
}

#[test]
fn failed_launch_is_returned_and_replay_recovers() {
    let dev = SimDevice::new();
    let mut g: G<SimDevice> = graft(dev.clone(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    for _ in 0..2 {
        g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    dev.fail_next_launch();
    let err = g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Device {
                source: DeviceError::Injected {
                    op: DeviceOp::GraphLaunch
                },
                ..
            }
        ),
        "{err}"
    );
    let out = g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![1.0; 4]);
}

#[test]
fn errors_in_drop_reach_the_next_call() {
    let dev = SimDevice::new();
    let mut g: G<SimDevice> = graft(dev.clone(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    for _ in 0..2 {
        g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    let destroy_failed = |err: &MemoryError| {
        matches!(
            err,
            MemoryError::Device(DeviceError::Injected {
                op: DeviceOp::GraphDestroy
            })
        )
    };
    dev.fail_next_graph_destroy();
    let err = g.reset().unwrap_err();
    assert!(destroy_failed(&err), "{err}");
    // Taken once: the next call works.
    g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    // Closing the runtime returns a failure to destroy a graph.
    for _ in 0..2 {
        g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    dev.fail_next_graph_destroy();
    let err = g.close().unwrap_err();
    assert!(destroy_failed(&err), "{err}");
    // Dropping one logs it (nobody is left to return it to) and leaves nothing behind for the
    // next runtime on the device.
    let mut g: Graft<SimDevice, u32> = Graft::new(dev.clone(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    for _ in 0..2 {
        g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap();
    }
    dev.fail_next_graph_destroy();
    drop(x);
    drop(g);
    let mut g2: Graft<SimDevice, u32> = Graft::new(dev, Config::default());
    let f2 = g2.register("f", FunctionSpec::default());
    let y = input(&mut g2, &[1.0; 4]);
    g2.call(f2, &[&y], &[], affine(1.0, 0.0, &runs)).unwrap();
}

#[test]
fn allow_list_and_eager_only_run_outside_the_graph_pool() {
    let mut g: G<SimDevice> = graft(
        SimDevice::new(),
        Config {
            allow_list: Some(vec![graft::AllowEntry {
                function: "graphed".into(),
                keys: Some(vec![1]),
            }]),
            ..Config::default()
        },
    );
    let graphed = g.register("graphed", FunctionSpec::default());
    let other = g.register("other", FunctionSpec::default());
    let never = g.register(
        "never",
        FunctionSpec {
            eager_only: true,
            ..FunctionSpec::default()
        },
    );
    let x = input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        for (f, k) in [(graphed, 1), (graphed, 2), (other, 1), (never, 1)] {
            outcomes.push((
                f,
                k,
                g.call_into(f, &[&x], &[k], affine(1.0, 0.0, &runs), &mut Vec::new())
                    .unwrap(),
            ));
        }
        g.mark_step_begin();
    }
    for (f, k, o) in outcomes {
        let graphed_sig = f == graphed && k == 1;
        assert_eq!(
            matches!(o, Outcome::Eager(_)),
            !graphed_sig,
            "{f:?} key {k}: {o:?}"
        );
    }
    assert_eq!(
        g.stats().pool.live_blocks,
        0,
        "eager runs never touch the graph pool"
    );
}

#[test]
fn buffer_leaked_from_a_failed_recording_is_reclaimed() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    let mut leaked = Vec::new();
    for _ in 0..2 {
        g.call(f, &[&x], &[], |ctx: &mut Ctx<'_, SimDevice>| {
            let out = ctx.alloc(16)?;
            leaked.push(out.clone());
            ctx.queue().fill_f32(&out, 4, 1.0)?;
            ctx.queue().synchronize()?;
            Ok(vec![Output::new(out, 0)])
        })
        .unwrap();
    }
    // The second call's capture failed: what the body allocated during it was rolled back.
    let err = leaked[1].addr().unwrap_err();
    assert!(matches!(err, graft::BufferError::Reclaimed { .. }), "{err}");
    assert!(leaked[0].addr().is_ok(), "the warmup's allocation is real");
}

#[test]
fn placeholder_allocation_failure_is_a_pool_error() {
    let dev = SimDevice::new();
    let mut g: G<SimDevice> = graft(
        dev.clone(),
        Config {
            warmups: 0,
            ..Config::default()
        },
    );
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 16]);
    let runs = Runs::default();
    // The first call records at once; its placeholder needs the graph pool's first mapping.
    dev.fail_map_after(0);
    let err = g.call(f, &[&x], &[], affine(1.0, 0.0, &runs)).unwrap_err();
    assert!(matches!(err, CallError::Pool { .. }), "{err}");
    assert_eq!((g.stats().nodes, runs.get()), (0, 0));
    let out = g.call(f, &[&x], &[], affine(2.0, 0.0, &runs)).unwrap();
    assert_eq!(read(&g, &out[0].buffer), vec![2.0; 16]);
}

#[test]
fn host_slices_must_match_the_buffer() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let b = g.alloc(16).unwrap();
    let err = g.write_f32(&b, &[1.0; 3]).unwrap_err();
    assert!(
        matches!(
            err,
            MemoryError::LengthMismatch {
                host: 12,
                buffer: 16
            }
        ),
        "{err}"
    );
    let mut short = [0u8; 4];
    assert!(matches!(
        g.read(&b, &mut short),
        Err(MemoryError::LengthMismatch { .. })
    ));
}

#[test]
fn large_copied_input_warns_once() {
    let warnings = count_warnings("copied on every replay", || {
        let mut g: G<SimDevice> = graft(
            SimDevice::new(),
            Config {
                large_copy_warn_bytes: 1024,
                ..Config::default()
            },
        );
        let f = g.register("f", FunctionSpec::default());
        let small = input(&mut g, &[1.0; 16]);
        let large = input(&mut g, &[1.0; 1024]);
        let runs = Runs::default();
        for _ in 0..4 {
            g.call(f, &[&small], &[], affine(1.0, 0.0, &runs)).unwrap();
            g.call(f, &[&large], &[], affine(1.0, 0.0, &runs)).unwrap();
        }
    });
    assert_eq!(warnings, 1);
}

#[test]
fn out_of_memory_releases_unused_pool_memory_then_reports_what_the_pool_holds() {
    const MIB: usize = 1 << 20;
    let dev = SimDevice::with_memory_limit(16 * MIB);
    let mut g: G<SimDevice> = graft(
        dev.clone(),
        Config {
            warmups: 10,
            ..Config::default()
        },
    );
    let f = g.register("f", FunctionSpec::default());
    let x = input(&mut g, &[1.0; 4]);
    // A warmup maps 12 MiB of scratch into the graph pool and frees it again.
    let scratchy = |ctx: &mut Ctx<'_, SimDevice>| {
        let scratch = ctx.alloc(12 * MIB)?;
        ctx.queue().fill_f32(&scratch, 4, 1.0)?;
        let out = ctx.alloc(16)?;
        ctx.queue().fill_f32(&out, 4, 1.0)?;
        Ok(vec![Output::new(out, 0)])
    };
    let out = g.call(f, &[&x], &[], scratchy).unwrap();
    assert_eq!(g.stats().pool.mapped, 14 * MIB);
    // The eager pool needs 8 MiB, the device has 2 left: graft unmaps what no block uses.
    let big = g.alloc(8 * MIB).unwrap();
    assert_eq!(
        g.stats().pool.mapped,
        2 * MIB,
        "the held output's granule stays"
    );
    assert_eq!(read(&g, &out[0].buffer), vec![1.0; 4]);
    // Past what any release can give, the error says what the pool holds and what to do.
    let err = g.alloc(8 * MIB).unwrap_err();
    match &err {
        MemoryError::Pool(graft::PoolError::OutOfMemory {
            bytes,
            mapped,
            allocated,
            ..
        }) => assert_eq!(
            (*bytes, *mapped, *allocated),
            (8 * MIB, 10 * MIB, 8 * MIB + 512)
        ),
        other => panic!("{other}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("Graft::reset") && message.contains("batch size"),
        "{message}"
    );
    drop(big);
}
