//! Memory graft does not own (a framework's own allocations) as call inputs and outputs, on
//! both backends: static, copied and in-place inputs; outputs delivered into memory the
//! caller owns (`Graft::call_owned`), which no later replay overwrites; the misuse cases.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Runs, TestDevice, TestQueue, graft, host_affine, read, unguarded};
use graft::{
    BodyError, Buffer, CallError, Config, Ctx, Destinations, DevicePtr, EagerReason, FunctionSpec,
    Graft, Outcome, Output,
};

/// Foreign memory: a raw allocation of the device, outside graft's pools, freed on drop.
struct Foreign<D: TestDevice> {
    device: D,
    addr: DevicePtr,
    len: usize,
}

impl<D: TestDevice> Foreign<D> {
    fn new(g: &Graft<D, u32>, values: &[f32]) -> Foreign<D> {
        let device = g.device().clone();
        let len = values.len() * 4;
        let addr = device.queue().raw_alloc(len).unwrap();
        let f = Foreign { device, addr, len };
        g.write_f32(&f.buffer(), values).unwrap();
        f
    }

    fn buffer(&self) -> Buffer {
        Buffer::external(self.device.id(), self.addr, self.len, None)
    }
}

impl<D: TestDevice> Drop for Foreign<D> {
    fn drop(&mut self) {
        let _ = self.device.queue().synchronize();
        let _ = self.device.queue().raw_free(self.addr);
    }
}

fn values(seed: f32, n: usize) -> Vec<f32> {
    (0..n).map(|i| seed + i as f32).collect()
}

/// out = a * x + b over a foreign in-place input that moves every call, with a foreign
/// static weight added: every call equals eager, replays follow the input without a
/// re-recording.
fn in_place_inputs_follow_the_caller<D: TestDevice>(device: D) {
    let mut g = graft(device, unguarded());
    let f = g.register("axpb+w", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 64;
    let weight = Foreign::new(&g, &values(100.0, n));
    let w = weight.buffer();
    w.mark_static();
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for step in 0..8 {
        // A new foreign input every call, as a framework's fresh token tensor is.
        let x_mem = Foreign::new(&g, &values(step as f32, n));
        let x = x_mem.buffer();
        x.mark_in_place();
        let r = runs.clone();
        let mut out = Vec::new();
        let outcome = g
            .call_into(
                f,
                &[&x, &w],
                &[],
                |ctx: &mut Ctx<'_, D>| {
                    r.hit();
                    let (x, w) = (ctx.input(0).clone(), ctx.input(1).clone());
                    let y = ctx.alloc(x.len())?;
                    ctx.queue().axpb_f32(&y, &x, 2.0, 1.0, n)?;
                    ctx.queue().add_f32(&y, &y, &w, n)?;
                    Ok(vec![Output::new(y, 0)])
                },
                &mut out,
            )
            .unwrap();
        let want: Vec<f32> = host_affine(&values(step as f32, n), 2.0, 1.0)
            .iter()
            .zip(values(100.0, n))
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(read(&g, &out[0].buffer), want, "step {step}: {outcome:?}");
        outcomes.push(outcome);
    }
    let recorded = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Recorded(_)))
        .count();
    let replayed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Replayed(_)))
        .count();
    assert_eq!(recorded, 1, "{outcomes:?}\n{}", g.dump_text());
    assert_eq!(replayed, 6, "{outcomes:?}");
    assert_eq!(
        runs.get(),
        2,
        "the body ran only for the warmup and the recording"
    );
    assert!(g.stats().patched_inputs >= 1, "{:?}", g.stats());
}
device_test!(in_place, in_place_inputs_follow_the_caller);

/// A body that writes its in-place input (a counter, a cache) writes the caller's buffer, on
/// every call, whichever buffer the caller passes: as eager execution does.
fn in_place_inputs_are_written_like_eager<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register("bump", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 16;
    let a = Foreign::new(&g, &values(0.0, n));
    let b = Foreign::new(&g, &values(50.0, n));
    let (mut want_a, mut want_b) = (values(0.0, n), values(50.0, n));
    for step in 0..8 {
        let (mem, want) = if step % 2 == 0 {
            (&a, &mut want_a)
        } else {
            (&b, &mut want_b)
        };
        let x = mem.buffer();
        x.mark_in_place();
        g.call(f, &[&x], &[], |ctx: &mut Ctx<'_, D>| {
            let x = ctx.input(0).clone();
            ctx.queue().axpb_f32(&x, &x, 1.0, 1.0, n)?;
            Ok(Vec::new())
        })
        .unwrap();
        want.iter_mut().for_each(|v| *v += 1.0);
        assert_eq!(read(&g, &a.buffer()), want_a, "step {step}");
        assert_eq!(read(&g, &b.buffer()), want_b, "step {step}");
    }
    assert!(g.stats().replays >= 4, "{:?}", g.stats());
    assert_eq!(
        g.stats().mutated_inputs,
        0,
        "in place, nothing is copied back"
    );
}
device_test!(in_place_writes, in_place_inputs_are_written_like_eager);

/// Output destinations from the caller: fresh foreign memory per call.
struct Fresh<D: TestDevice> {
    device: D,
    made: Vec<Foreign<D>>,
    asked: Arc<AtomicUsize>,
}

impl<D: TestDevice> Destinations<u32, std::io::Error> for Fresh<D> {
    fn destination(
        &mut self,
        _index: usize,
        _meta: &u32,
        bytes: usize,
    ) -> Result<Buffer, std::io::Error> {
        self.asked.fetch_add(1, Ordering::Relaxed);
        let addr = self.device.queue().raw_alloc(bytes.max(4)).unwrap();
        let f = Foreign {
            device: self.device.clone(),
            addr,
            len: bytes,
        };
        let b = f.buffer();
        self.made.push(f);
        Ok(b)
    }
}

/// Output destinations from another runtime's pool: memory mapped like graft's own, so the
/// graph's copy is re-pointed to it (CUDA refuses that for memory mapped another way).
struct Pooled<D: TestDevice> {
    other: Graft<D, u32>,
    made: Vec<Buffer>,
}

impl<D: TestDevice> Destinations<u32, std::io::Error> for Pooled<D> {
    fn destination(&mut self, _: usize, _: &u32, bytes: usize) -> Result<Buffer, std::io::Error> {
        let b = self.other.alloc(bytes).unwrap();
        let external = Buffer::external(b.device(), b.addr().unwrap(), bytes, None);
        self.made.push(b);
        Ok(external)
    }
}

/// Every output of `call_owned` lands in memory the caller gave for that call: no replay
/// ever overwrites an earlier call's output, however long it is held, and no output is
/// invalidated. Memory mapped like graft's pool is written by the graph's own copy;
/// memory allocated another way (`cuMemAlloc`), whose copy the device refuses to re-point,
/// is written by a copy after each launch, with one warning.
fn owned_outputs_are_never_overwritten<D: TestDevice>(device: D) {
    fn run<D: TestDevice, S: Destinations<u32, std::io::Error>>(
        device: D,
        dests: &mut S,
    ) -> graft::Stats {
        let mut g = graft(device, Config::default());
        let f = g.register("affine", FunctionSpec::inference(Vec::<usize>::new()));
        let n = 32;
        let mut held = Vec::new();
        for step in 0..6 {
            let x = common::input(&mut g, &values(step as f32, n));
            let mut out = Vec::new();
            let outcome = g
                .call_owned(
                    f,
                    &[&x],
                    &[],
                    |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<u32>>, BodyError<std::io::Error>> {
                        let x = ctx.input(0).clone();
                        let y = ctx.alloc(x.len())?;
                        ctx.queue().axpb_f32(&y, &x, 3.0, -1.0, n)?;
                        Ok(vec![Output::new(y, n as u32)])
                    },
                    dests,
                    &mut out,
                )
                .unwrap();
            assert_eq!(out[0].meta, n as u32);
            held.push((step, out.remove(0).buffer, outcome));
        }
        for (step, buffer, outcome) in &held {
            assert!(buffer.is_valid());
            assert_eq!(
                read(&g, buffer),
                host_affine(&values(*step as f32, n), 3.0, -1.0),
                "step {step} ({outcome:?})"
            );
        }
        g.stats()
    }
    let warning = "copies it after each launch";
    let asked = Arc::new(AtomicUsize::new(0));
    let mut raw = Fresh {
        device: device.clone(),
        made: Vec::new(),
        asked: asked.clone(),
    };
    let mut stats = None;
    let warned = common::count_warnings(warning, || stats = Some(run(device.clone(), &mut raw)));
    let stats = stats.unwrap();
    assert_eq!(
        asked.load(Ordering::Relaxed),
        6,
        "one destination per output per call"
    );
    assert_eq!(
        stats.guard_differences, 0,
        "guards see no host value here: {stats:?}"
    );
    assert_eq!(warned, 1, "raw memory: copied after each launch, said once");
    assert_eq!(stats.invalidations, 0);
    assert!(stats.replays >= 4, "{stats:?}");
    let mut pooled = Pooled {
        other: graft(device.clone(), Config::default()),
        made: Vec::new(),
    };
    let mut stats = None;
    let warned = common::count_warnings(warning, || stats = Some(run(device, &mut pooled)));
    assert_eq!(warned, 0, "pool memory: written by the graph's own copy");
    assert!(stats.unwrap().replays >= 4);
}
device_test!(owned_outputs, owned_outputs_are_never_overwritten);

/// A body's output that is foreign memory it made (as candle's tensors are) is copied into
/// the caller's destination and its keepalive dropped before the call returns, in every
/// kind of run: nothing the body made outlives the call.
fn foreign_body_outputs_are_released<D: TestDevice>(device: D) {
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    let mut g = graft(device.clone(), unguarded());
    let f = g.register("made", FunctionSpec::inference(Vec::<usize>::new()));
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut dests = Fresh {
        device: device.clone(),
        made: Vec::new(),
        asked: Arc::new(AtomicUsize::new(0)),
    };
    let scratch = Foreign::new(&g, &values(0.0, 8));
    let id = g.device().id();
    for step in 0..5 {
        let x = common::input(&mut g, &values(step as f32, 8));
        let d = dropped.clone();
        let (s, len) = (scratch.addr, scratch.len);
        let mut out = Vec::new();
        g.call_owned(
            f,
            &[&x],
            &[],
            |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<u32>>, BodyError<std::io::Error>> {
                let made = Buffer::external(id, s, len, Some(Box::new(Flag(d.clone()))));
                ctx.queue().axpb_f32(&made, ctx.input(0), 1.0, 10.0, 8)?;
                Ok(vec![Output::new(made, 0)])
            },
            &mut dests,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            read(&g, &out[0].buffer),
            host_affine(&values(step as f32, 8), 1.0, 10.0)
        );
    }
    assert_eq!(
        dropped.load(Ordering::Relaxed),
        2,
        "dropped after the warmup and the recording"
    );
}
device_test!(foreign_body_outputs, foreign_body_outputs_are_released);

/// Typed framework errors come back as they were returned, with no downcast: the body's in
/// `CallError::Body`, the allocator's in `CallError::Destination` (and nothing is launched).
fn framework_errors_come_back_typed<D: TestDevice>(device: D) {
    #[derive(Debug, thiserror::Error, PartialEq)]
    #[error("shape mismatch: {0}")]
    struct Shape(usize);
    struct Refuses;
    impl Destinations<u32, Shape> for Refuses {
        fn destination(&mut self, index: usize, _: &u32, _: usize) -> Result<Buffer, Shape> {
            Err(Shape(100 + index))
        }
    }
    let mut g = graft(device, Config::default());
    let f = g.register("fails", FunctionSpec::inference(Vec::<usize>::new()));
    let x = common::input(&mut g, &[1.0; 4]);
    let e = g
        .call_owned(
            f,
            &[&x],
            &[],
            |_: &mut Ctx<'_, D>| Err(BodyError::Framework(Shape(7))),
            &mut Refuses,
            &mut Vec::new(),
        )
        .unwrap_err();
    match e {
        CallError::Body {
            source: BodyError::Framework(shape),
            ..
        } => assert_eq!(shape, Shape(7)),
        other => panic!("{other}"),
    }
    let runs = Runs::default();
    for call in 0..3 {
        let r = runs.clone();
        let e = g
            .call_owned(
                f,
                &[&x],
                &[],
                |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<u32>>, BodyError<Shape>> {
                    r.hit();
                    let y = ctx.alloc(16)?;
                    ctx.queue().axpb_f32(&y, ctx.input(0), 1.0, 0.0, 4)?;
                    Ok(vec![Output::new(y, 0)])
                },
                &mut Refuses,
                &mut Vec::new(),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                CallError::Destination {
                    index: 0,
                    error: Shape(100),
                    ..
                }
            ),
            "call {call}: {e}"
        );
    }
    assert_eq!(
        g.stats().replays,
        0,
        "nothing launched without a destination"
    );
}
device_test!(typed_errors, framework_errors_come_back_typed);

/// Foreign memory that is really graft's own pool memory is refused when recorded.
fn foreign_ranges_inside_the_pool_are_refused<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register("f", FunctionSpec::inference(Vec::<usize>::new()));
    let x = common::input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let mut body = common::affine::<D>(1.0, 0.0, &runs);
    let out = g.call(f, &[&x], &[], &mut body).unwrap();
    let inside = Buffer::external(g.device().id(), out[0].buffer.addr().unwrap(), 16, None);
    let mut result = Ok(Vec::new());
    for _ in 0..3 {
        result = g.call(f, &[&inside], &[], &mut body);
        if result.is_err() {
            break;
        }
    }
    let e = result.unwrap_err();
    assert!(
        matches!(e, CallError::ExternalInPool { position: 0, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("graft's own"), "{e}");
}
device_test!(foreign_in_pool, foreign_ranges_inside_the_pool_are_refused);

/// Eager outcomes say why.
fn eager_outcomes_carry_their_reason<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register(
        "eager",
        FunctionSpec {
            eager_only: true,
            ..FunctionSpec::default()
        },
    );
    let x = common::input(&mut g, &[1.0; 4]);
    let runs = Runs::default();
    let out = g.call_into(
        f,
        &[&x],
        &[],
        common::affine::<D>(1.0, 0.0, &runs),
        &mut Vec::new(),
    );
    assert_eq!(out.unwrap(), Outcome::Eager(EagerReason::Registered));
}
device_test!(eager_reasons, eager_outcomes_carry_their_reason);

/// A destination of the wrong size is refused before anything is launched, and a function
/// recorded with owned outputs cannot be replayed without them (nor the reverse).
fn bad_destinations_and_mixed_calls_are_refused<D: TestDevice>(device: D) {
    struct Short<D: TestDevice>(Foreign<D>);
    impl<D: TestDevice> Destinations<u32, std::io::Error> for Short<D> {
        fn destination(&mut self, _: usize, _: &u32, _: usize) -> Result<Buffer, std::io::Error> {
            Ok(Buffer::external(self.0.device.id(), self.0.addr, 4, None))
        }
    }
    let mut g = graft(device.clone(), Config::default());
    let f = g.register("owned", FunctionSpec::inference(Vec::<usize>::new()));
    let x = common::input(&mut g, &values(1.0, 8));
    let body = |ctx: &mut Ctx<'_, D>| -> Result<Vec<Output<u32>>, BodyError<std::io::Error>> {
        let y = ctx.alloc(32)?;
        ctx.queue().axpb_f32(&y, ctx.input(0), 2.0, 0.0, 8)?;
        Ok(vec![Output::new(y, 8)])
    };
    let short = Short(Foreign::new(&g, &[0.0]));
    let e = g
        .call_owned(f, &[&x], &[], body, &mut { short }, &mut Vec::new())
        .unwrap_err();
    assert!(
        matches!(
            e,
            CallError::BadDestination {
                index: 0,
                given: 4,
                needed: 32,
                ..
            }
        ),
        "{e}"
    );
    let mut dests = Fresh {
        device,
        made: Vec::new(),
        asked: Arc::new(AtomicUsize::new(0)),
    };
    for _ in 0..3 {
        g.call_owned(f, &[&x], &[], body, &mut dests, &mut Vec::new())
            .unwrap();
    }
    let runs = Runs::default();
    let e = g
        .call(f, &[&x], &[], common::affine::<D>(2.0, 0.0, &runs))
        .unwrap_err();
    assert!(matches!(e, CallError::OwnedOutputs { .. }), "{e}");
    assert!(e.to_string().contains("call_owned"), "{e}");
}
device_test!(
    bad_destinations,
    bad_destinations_and_mixed_calls_are_refused
);

/// A buffer passed twice: in place, and as a view of its first half (not marked).
fn aliased<D: TestDevice>(mem: &Foreign<D>) -> [Buffer; 2] {
    let x = mem.buffer();
    x.mark_in_place();
    let half = Buffer::external(mem.device.id(), mem.addr, mem.len / 2, None);
    [x, half]
}

/// Inputs that overlap each other are both used in place (a copy of one would miss the
/// body's writes through the other), and the graph cannot follow them (a pointer into the
/// overlap could belong to either): a recording replays only where it was recorded, a moved
/// buffer records again with `OverlappingInputMoved`, and the values stay eager's.
fn aliased_inputs_replay_only_where_recorded<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register("overlap", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 8;
    let mems = [
        Foreign::new(&g, &values(0.0, n)),
        Foreign::new(&g, &values(10.0, n)),
    ];
    for step in 0..6 {
        let mem = &mems[usize::from(step >= 3)];
        let (outcome, out) = call_aliased(&mut g, f, mem, |ctx: &mut Ctx<'_, D>| {
            let y = ctx.alloc(ctx.input(0).len())?;
            ctx.queue().axpb_f32(&y, ctx.input(0), 2.0, 0.0, n)?;
            Ok(vec![Output::new(y, 0)])
        });
        let seed = if step >= 3 { 10.0 } else { 0.0 };
        assert_eq!(
            read(&g, &out),
            host_affine(&values(seed, n), 2.0, 0.0),
            "step {step}: {outcome:?}"
        );
    }
    let kinds: Vec<_> = g.nodes().into_iter().flat_map(|n| n.inputs).collect();
    assert!(
        kinds
            .iter()
            .all(|k| *k == graft::InputKind::InPlace { follows: false }),
        "{kinds:?}"
    );
    assert_eq!(
        g.stats().rerecords.overlapping_input_moved,
        1,
        "{:?}",
        g.stats()
    );
}
device_test!(aliased, aliased_inputs_replay_only_where_recorded);

/// A body that reads its input through a handle of its own, as graft-candle's does (a
/// framework's tensor over the caller's buffer, never `Ctx::input`), in a device loop the graph
/// cannot follow, with a new input buffer on every call (the old ones held). Copied into a
/// placeholder the body never read, the input stayed the recorded call's: every replay
/// returned that call's result. With `never_copy_inputs` each call records again, every value
/// is eager's, and after 8 calls the churn names the input, once.
fn inputs_read_outside_the_context_are_never_copied<D: TestDevice>(device: D) {
    let mut g = graft(device, unguarded());
    let spec = FunctionSpec::inference(Vec::<usize>::new()).never_copy_inputs();
    let f = g.register("own handles", spec);
    let n = 8;
    let mut held = Vec::new();
    let warned =
        common::count_warnings("moved on each of the last 8 calls where its graph", || {
            for step in 0..10 {
                let mem = Foreign::new(&g, &values(100.0 * step as f32, n));
                let x = mem.buffer();
                x.mark_in_place();
                let own = x.clone();
                let mut out = Vec::new();
                let body = |ctx: &mut Ctx<'_, D>| {
                    let (y, flag) = (ctx.alloc(n * 4)?, ctx.alloc(4)?);
                    ctx.queue().fill_f32(&flag, 1, 1.0)?;
                    ctx.while_loop(&flag, |ctx: &mut Ctx<'_, D>| {
                        ctx.queue().axpb_f32(&y, &own, 2.0, 1.0, n)?;
                        ctx.queue().fill_f32(&flag, 1, 0.0)?;
                        Ok::<(), BodyError>(())
                    })?;
                    Ok(vec![Output::new(y, 0)])
                };
                let outcome = g.call_into(f, &[&x], &[], body, &mut out).unwrap();
                assert_eq!(
                    read(&g, &out[0].buffer),
                    host_affine(&values(100.0 * step as f32, n), 2.0, 1.0),
                    "step {step}: {outcome:?}"
                );
                held.push(mem);
            }
        });
    let stats = g.stats();
    assert_eq!(
        (stats.replays, stats.rerecords.in_place_input_moved),
        (0, 8),
        "{stats:?}"
    );
    assert_eq!(
        g.churn(f),
        Some(&graft::Churn::InPlaceAddress {
            position: 0,
            calls: 8
        })
    );
    assert_eq!(warned, 1);
}
device_test!(
    own_handles,
    inputs_read_outside_the_context_are_never_copied
);

/// A tensor and a view into it (inputs that partly overlap) at a new address on every call:
/// neither followed nor copied, so each call records again, and every value is eager's. The
/// reason says so (`OverlappingInputMoved`: it said the input would be copied from then on,
/// which it never was), and after 8 such calls the churn names the input once, with what to
/// do (it named nothing, and the calls recorded on silently).
fn overlapping_inputs_that_move_are_named<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register("overlap", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 8;
    let mut held = Vec::new();
    let warned = common::count_warnings("overlaps another input at another offset", || {
        for step in 0..10 {
            let mem = Foreign::new(&g, &values(step as f32, n));
            let (outcome, out) = call_aliased(&mut g, f, &mem, bump_then_read::<D>(n, n / 2));
            let bumped = host_affine(&values(step as f32, n), 1.0, 1.0);
            assert_eq!(read(&g, &mem.buffer()), bumped, "step {step}: {outcome:?}");
            assert_eq!(
                read(&g, &out),
                host_affine(&bumped[..n / 2], 2.0, 0.0),
                "step {step}: {outcome:?}"
            );
            held.push(mem);
        }
    });
    let stats = g.stats();
    assert_eq!(stats.rerecords.overlapping_input_moved, 8, "{stats:?}");
    assert_eq!(stats.rerecords.in_place_input_moved, 0, "{stats:?}");
    let last = g.explain().last().map(|d| d.decision.clone());
    assert!(
        matches!(
            last,
            Some(graft::Decision::Record(
                graft::RecordReason::OverlappingInputMoved {
                    position: 0,
                    other: 1,
                    ..
                }
            ))
        ),
        "{last:?}"
    );
    assert_eq!(
        g.churn(f),
        Some(&graft::Churn::OverlappingInput {
            position: 0,
            calls: 8
        })
    );
    assert_eq!(warned, 1);
}
device_test!(overlapping_moved, overlapping_inputs_that_move_are_named);

/// The same buffer passed as two inputs (`f(x, x)`), at a new address on every call: both are
/// used in place and followed together, so the recording replays wherever the buffer is (it
/// recorded again on every call before, and never replayed). Passed as two buffers, the pair
/// records again (`AliasesParted`): a use in the graph could be either input's. The values are
/// eager's throughout: the body writes the buffer through input 0, then reads input 1.
fn same_buffer_twice_is_followed<D: TestDevice>(device: D) {
    let mut g = graft(device, Config::default());
    let f = g.register("twice", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 8;
    let mut held = Vec::new();
    for step in 0..8 {
        let x = common::input(&mut g, &values(step as f32, n));
        let mut out = Vec::new();
        let outcome = g
            .call_into(f, &[&x, &x], &[], bump_then_read(n, n), &mut out)
            .unwrap();
        let bumped = host_affine(&values(step as f32, n), 1.0, 1.0);
        assert_eq!(read(&g, &x), bumped, "step {step}: {outcome:?}");
        assert_eq!(
            read(&g, &out[0].buffer),
            host_affine(&bumped, 2.0, 0.0),
            "step {step}: {outcome:?}"
        );
        held.push(x);
    }
    let stats = g.stats();
    assert!(stats.replays >= 5, "{stats:?}");
    assert_eq!(stats.rerecords.in_place_input_moved, 0, "{stats:?}");
    let kinds: Vec<_> = g.nodes().into_iter().flat_map(|n| n.inputs).collect();
    assert_eq!(
        kinds,
        vec![graft::InputKind::InPlace { follows: true }; 2],
        "one node, both inputs followed"
    );
    // Two buffers now: the recording of one buffer cannot serve them.
    let (x, y) = (
        common::input(&mut g, &values(100.0, n)),
        common::input(&mut g, &values(200.0, n)),
    );
    let mut out = Vec::new();
    let outcome = g
        .call_into(f, &[&x, &y], &[], bump_then_read(n, n), &mut out)
        .unwrap();
    assert_eq!(read(&g, &x), host_affine(&values(100.0, n), 1.0, 1.0));
    assert_eq!(
        read(&g, &out[0].buffer),
        host_affine(&values(200.0, n), 2.0, 0.0),
        "{outcome:?}"
    );
    assert_eq!(g.stats().rerecords.aliases_parted, 1, "{:?}", g.stats());
}
device_test!(same_buffer_twice, same_buffer_twice_is_followed);

/// `f` over `mem` and the first half of it (`aliased`) with `body`: the outcome and the
/// first output.
fn call_aliased<D: TestDevice>(
    g: &mut Graft<D, u32>,
    f: graft::FunctionId,
    mem: &Foreign<D>,
    body: impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError>,
) -> (Outcome, Buffer) {
    let [x, half] = aliased(mem);
    let mut out = Vec::new();
    let outcome = g.call_into(f, &[&x, &half], &[], body, &mut out).unwrap();
    (outcome, out.remove(0).buffer)
}

/// A body that adds 1 to the `n` values of input 0 in place, then returns twice the first `m`
/// of input 1.
fn bump_then_read<D: TestDevice>(
    n: usize,
    m: usize,
) -> impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> {
    move |ctx: &mut Ctx<'_, D>| {
        let (x, y) = (ctx.input(0).clone(), ctx.input(1).clone());
        ctx.queue().axpb_f32(&x, &x, 1.0, 1.0, n)?;
        let out = ctx.alloc(m * 4)?;
        ctx.queue().axpb_f32(&out, &y, 2.0, 0.0, m)?;
        Ok(vec![Output::new(out, 0)])
    }
}

/// A body that writes one of two overlapping inputs and then reads the other sees its write,
/// as eager execution does, and leaves the caller's buffer written: the unmarked view is not
/// copied into a placeholder (whose stale values the body would read, and which graft would
/// then copy back over the caller's write).
fn aliased_inputs_see_the_bodys_writes<D: TestDevice>(device: D) {
    let mut g = graft(device, unguarded());
    let f = g.register("bump+read", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 8;
    let mems = [
        Foreign::new(&g, &values(0.0, n)),
        Foreign::new(&g, &values(10.0, n)),
    ];
    let mut want = [values(0.0, n), values(10.0, n)];
    let mut replays = 0;
    for step in 0..8 {
        let which = usize::from(step >= 4);
        let (outcome, out) = call_aliased(&mut g, f, &mems[which], bump_then_read::<D>(n, n / 2));
        replays += usize::from(matches!(outcome, Outcome::Replayed(_)));
        want[which].iter_mut().for_each(|v| *v += 1.0);
        assert_eq!(
            read(&g, &out),
            host_affine(&want[which][..n / 2], 2.0, 0.0),
            "step {step}: {outcome:?}, what the body read through the view"
        );
        for (mem, want) in mems.iter().zip(&want) {
            assert_eq!(read(&g, &mem.buffer()), *want, "step {step}: {outcome:?}");
        }
    }
    assert_eq!(replays, 5, "{}", g.dump_text());
    assert_eq!(g.stats().mutated_inputs, 0, "{:?}", g.stats());
}
device_test!(aliased_written, aliased_inputs_see_the_bodys_writes);

/// Two copied inputs recorded apart and passed later as one buffer: the replay would copy it
/// into both placeholders, and the body's write through the first would not reach its read
/// through the second. The call records again instead (`InputsOverlap`), both inputs in
/// place, and every value is eager's.
fn copied_inputs_that_come_to_overlap_record_again<D: TestDevice>(device: D) {
    let mut g = graft(device, unguarded());
    let f = g.register("bump+read", FunctionSpec::inference(Vec::<usize>::new()));
    let n = 8;
    let (a, b) = (
        Foreign::new(&g, &values(0.0, n)),
        Foreign::new(&g, &values(100.0, n)),
    );
    let mut want_a = values(0.0, n);
    for step in 0..8 {
        // Apart for six calls (warmup, a recording whose write is caught, the recording that
        // copies back, replays), then the same buffer twice.
        let second = if step < 6 { &b } else { &a };
        let (x, y) = (a.buffer(), second.buffer());
        let mut out = Vec::new();
        let outcome = g
            .call_into(f, &[&x, &y], &[], bump_then_read::<D>(n, n), &mut out)
            .unwrap();
        want_a.iter_mut().for_each(|v| *v += 1.0);
        let read_through = if step < 6 {
            values(100.0, n)
        } else {
            want_a.clone()
        };
        assert_eq!(
            read(&g, &out[0].buffer),
            host_affine(&read_through, 2.0, 0.0),
            "step {step}: {outcome:?}"
        );
        assert_eq!(read(&g, &a.buffer()), want_a, "step {step}: {outcome:?}");
        if step == 6 {
            assert!(matches!(outcome, Outcome::Recorded(_)), "{outcome:?}");
        }
    }
    assert_eq!(g.stats().rerecords.inputs_overlap, 1, "{:?}", g.stats());
}
device_test!(
    come_to_overlap,
    copied_inputs_that_come_to_overlap_record_again
);
