//! Device-side loops and branches (`Ctx::while_loop`, `if_then`, `if_else`, `switch`): a
//! replay decides on the device what eager execution decides on the host, with the same
//! results; what a conditional body cannot hold falls back to eager with a typed reason.

mod common;

use common::*;
use graft::sim::{SimComm, SimDevice};
use graft::{
    BodyError, Buffer, BufferError, Conditional, ConditionalRule, Config, Ctx, Device, DeviceError,
    DeviceOp, EagerReason, FunctionSpec, Outcome, Output,
};

/// A body that adds `x` to an accumulator `input(1)` times (a count stored as an f32, used
/// as the loop's flag: 0.0 is the u32 0), on the device when replayed.
fn repeat_add<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let (x, count) = (ctx.input(0).clone(), ctx.input(1).clone());
        let n = x.len() / 4;
        let acc = ctx.alloc(x.len())?;
        let left = ctx.alloc(4)?;
        ctx.queue().fill_f32(&acc, n, 0.0)?;
        ctx.queue().axpb_f32(&left, &count, 1.0, 0.0, 1)?;
        ctx.while_loop(&left, |ctx: &mut Ctx<'_, D>| {
            ctx.queue().add_f32(&acc, &acc, &x, n)?;
            ctx.queue().axpb_f32(&left, &left, 1.0, -1.0, 1)?;
            Ok::<(), BodyError>(())
        })?;
        Ok(vec![Output::new(acc, 0)])
    })
}

// The number of iterations is data: every replay runs as many as its input asks for.
fn while_loop_runs_the_iterations_its_input_asks_for<D: TestDevice>(dev: D) {
    let mut g = graft(dev, unguarded());
    let f = g.register("loop", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0]);
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for count in [3.0, 5.0, 0.0, 7.0, 1.0] {
        let c = input(&mut g, &[count]);
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(f, &[&x, &c], &[], repeat_add(&runs), &mut out)
                .unwrap(),
        );
        assert_eq!(read(&g, &out[0].buffer), vec![count, 2.0 * count]);
    }
    assert!(matches!(
        outcomes[..],
        [
            Outcome::Warmup,
            Outcome::Recorded(_),
            Outcome::Replayed(_),
            Outcome::Replayed(_),
            Outcome::Replayed(_)
        ]
    ));
    assert_eq!(
        runs.get(),
        2,
        "the body runs once eagerly and once captured"
    );
    assert_eq!(g.stats().nodes, 1, "a graph holding a loop is one node");
}
device_test!(
    conditional_01_while_loop_runs_the_iterations_its_input_asks_for,
    while_loop_runs_the_iterations_its_input_asks_for
);

/// out = 2x if flag else 3x; then out = out * out if flag (a second, if-only node).
fn branches<D: TestDevice>() -> Body<'static, D> {
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        let (x, flag) = (ctx.input(0).clone(), ctx.input(1).clone());
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        ctx.if_else(
            &flag,
            |ctx: &mut Ctx<'_, D>| {
                Ok::<(), BodyError>(ctx.queue().axpb_f32(&out, &x, 2.0, 0.0, n)?)
            },
            |ctx: &mut Ctx<'_, D>| Ok(ctx.queue().axpb_f32(&out, &x, 3.0, 0.0, n)?),
        )?;
        ctx.if_then(&flag, |ctx: &mut Ctx<'_, D>| {
            Ok::<(), BodyError>(ctx.queue().mul_f32(&out, &out, &out, n)?)
        })?;
        Ok(vec![Output::new(out, 0)])
    })
}

fn if_else_picks_the_branch_on_the_device<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("branches", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 4.0]);
    let mut replays = 0;
    for flag in [1.0, 0.0, 1.0, 0.0, 0.0, 1.0] {
        let c = input(&mut g, &[flag]);
        let mut out = Vec::new();
        let outcome = g
            .call_into(f, &[&x, &c], &[], branches(), &mut out)
            .unwrap();
        replays += usize::from(matches!(outcome, Outcome::Replayed(_)));
        let want = if flag != 0.0 {
            vec![4.0, 64.0]
        } else {
            vec![3.0, 12.0]
        };
        assert_eq!(read(&g, &out[0].buffer), want);
    }
    assert_eq!(replays, 4);
}
device_test!(
    conditional_02_if_else_picks_the_branch_on_the_device,
    if_else_picks_the_branch_on_the_device
);

/// out = (index + 1) * x for index 0..3, untouched (zero) otherwise; with `nested`, case 2
/// adds `x` three times in a loop of its own instead.
fn cases<D: TestDevice>(nested: bool) -> Body<'static, D> {
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        let (x, index) = (ctx.input(0).clone(), ctx.input(1).clone());
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        let left = ctx.alloc(4)?;
        ctx.queue().fill_f32(&out, n, 0.0)?;
        let q = ctx.queue();
        ctx.switch(
            &index,
            &mut [
                &mut |_: &mut Ctx<'_, D>| Ok::<(), BodyError>(q.axpb_f32(&out, &x, 1.0, 0.0, n)?),
                &mut |_: &mut Ctx<'_, D>| Ok(q.axpb_f32(&out, &x, 2.0, 0.0, n)?),
                &mut |ctx: &mut Ctx<'_, D>| {
                    if !nested {
                        return Ok(q.axpb_f32(&out, &x, 3.0, 0.0, n)?);
                    }
                    q.fill_f32(&left, 1, 3.0)?;
                    ctx.while_loop(&left, |_: &mut Ctx<'_, D>| {
                        q.add_f32(&out, &out, &x, n)?;
                        Ok::<(), BodyError>(q.axpb_f32(&left, &left, 1.0, -1.0, 1)?)
                    })
                },
            ],
        )?;
        Ok(vec![Output::new(out, 0)])
    })
}

/// Calls the switch for a run of indices, checking each result; the outcomes.
fn run_cases<D: TestDevice>(dev: D, nested: bool) -> Vec<Outcome> {
    let mut g = graft(dev, Config::default());
    let f = g.register("switch", FunctionSpec::default());
    let x = input(&mut g, &[1.0, -2.0]);
    let mut outcomes = Vec::new();
    for index in [0u32, 1, 2, 3, 2, 1, 0, 9] {
        let c = g.alloc(4).unwrap();
        g.write(&c, &index.to_le_bytes()).unwrap();
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(f, &[&x, &c], &[], cases(nested), &mut out)
                .unwrap(),
        );
        let k = if index < 3 { index as f32 + 1.0 } else { 0.0 };
        assert_eq!(read(&g, &out[0].buffer), vec![k, -2.0 * k], "index {index}");
    }
    outcomes
}

fn switch_runs_the_case_its_index_names<D: TestDevice>(dev: D) {
    let outcomes = run_cases(dev, false);
    let replays = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Replayed(_)))
        .count();
    assert!(replays >= 5, "{outcomes:?}");
}
device_test!(
    conditional_03_switch_runs_the_case_its_index_names,
    switch_runs_the_case_its_index_names
);

// A loop inside a switch case: refused with a typed reason on every backend (CUDA cannot
// place a conditional node in another's body as graft captures bodies), so the call runs
// eagerly, its branches and loop on the host, with the same results.
fn a_loop_nested_in_a_case_gives_the_hosts_results<D: TestDevice>(dev: D) {
    let outcomes = run_cases(dev, true);
    assert_eq!(outcomes[0], Outcome::Warmup);
    for o in &outcomes[1..] {
        assert!(
            matches!(
                o,
                Outcome::Eager(EagerReason::ConditionalRefused {
                    error: DeviceError::Conditional {
                        op: DeviceOp::Conditional,
                        rule: ConditionalRule::Nested
                    }
                })
            ),
            "{o:?}"
        );
    }
}
device_test!(
    conditional_05_a_loop_nested_in_a_case_gives_the_hosts_results,
    a_loop_nested_in_a_case_gives_the_hosts_results
);

// The buffer a loop writes is an output like any other: a replay never overwrites a held
// output of an earlier call silently.
fn a_held_loop_output_is_invalidated_not_overwritten<D: TestDevice>(dev: D) {
    let mut g = graft(dev, Config::default());
    let f = g.register("loop", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0]);
    let runs = Runs::default();
    let mut held: Vec<Buffer> = Vec::new();
    for count in [2.0, 3.0, 4.0, 5.0] {
        let c = input(&mut g, &[count]);
        let out = g.call(f, &[&x, &c], &[], repeat_add(&runs)).unwrap();
        held.push(out[0].buffer.clone());
    }
    // The replays either put their output elsewhere or invalidated what was held there.
    for (i, b) in held.iter().enumerate() {
        let want = [2.0 + i as f32, 2.0 * (2.0 + i as f32)];
        match g.read_f32(b) {
            Ok(v) => assert_eq!(v, want, "held output {i} changed under its holder"),
            Err(e) => assert!(
                matches!(
                    e,
                    graft::MemoryError::Buffer(BufferError::Overwritten { .. })
                ),
                "{e}"
            ),
        }
    }
}
device_test!(
    conditional_04_a_held_loop_output_is_invalidated_not_overwritten,
    a_held_loop_output_is_invalidated_not_overwritten
);

// What a conditional body cannot hold ends the recording with a typed reason, and the call
// runs eagerly, its loop on the host, with the same result (simulator: it models NCCL's rule).
#[test]
fn a_collective_in_a_loop_falls_back_to_the_host_loop_with_a_typed_reason() {
    let dev = SimDevice::new();
    let comm = SimComm::group(
        std::slice::from_ref(&dev),
        std::time::Duration::from_secs(5),
    )
    .remove(0);
    let mut g = graft(dev, Config::default());
    let f = g.register("loop", FunctionSpec::default());
    let x = input(&mut g, &[1.0]);
    for count in [2.0, 3.0, 4.0] {
        let c = input(&mut g, &[count]);
        let mut out = Vec::new();
        let comm = &comm;
        let outcome = g
            .call_into(
                f,
                &[&x, &c],
                &[],
                |ctx: &mut Ctx<'_, SimDevice>| {
                    let (x, count) = (ctx.input(0).clone(), ctx.input(1).clone());
                    let acc = ctx.alloc(4)?;
                    let left = ctx.alloc(4)?;
                    ctx.queue().fill_f32(&acc, 1, 0.0)?;
                    ctx.queue().axpb_f32(&left, &count, 1.0, 0.0, 1)?;
                    ctx.while_loop(&left, |ctx: &mut Ctx<'_, SimDevice>| {
                        ctx.queue().add_f32(&acc, &acc, &x, 1)?;
                        comm.all_reduce_sum_f32(&acc, 1)?;
                        Ok::<(), BodyError>(ctx.queue().axpb_f32(&left, &left, 1.0, -1.0, 1)?)
                    })?;
                    Ok(vec![Output::new(acc, 0)])
                },
                &mut out,
            )
            .unwrap();
        assert_eq!(read(&g, &out[0].buffer), vec![count]);
        if let Outcome::Eager(why) = outcome {
            assert!(
                matches!(
                    why,
                    EagerReason::ConditionalRefused {
                        error: DeviceError::Conditional {
                            op: DeviceOp::Collective,
                            rule: ConditionalRule::Collective
                        }
                    }
                ),
                "{why}"
            );
        } else {
            assert_eq!(outcome, Outcome::Warmup);
        }
    }
    assert_eq!(g.stats().nodes, 0);
}

// A device without conditional nodes (a driver older than CUDA 12.4, modelled by the
// simulator): the recording ends with a typed reason naming it, and every call runs its loop
// on the host, with the same results.
#[test]
fn a_device_without_conditionals_loops_on_the_host_with_a_reason() {
    let dev = SimDevice::new();
    dev.disable_conditionals();
    assert!(!dev.supports_conditionals());
    let mut g = graft(dev, Config::default());
    let f = g.register("loop", FunctionSpec::default());
    let x = input(&mut g, &[1.0, 2.0]);
    let runs = Runs::default();
    let mut reasons = Vec::new();
    for count in [3.0, 5.0, 2.0] {
        let c = input(&mut g, &[count]);
        let mut out = Vec::new();
        if let Outcome::Eager(why) = g
            .call_into(f, &[&x, &c], &[], repeat_add(&runs), &mut out)
            .unwrap()
        {
            reasons.push(why);
        }
        assert_eq!(read(&g, &out[0].buffer), vec![count, 2.0 * count]);
    }
    assert_eq!(reasons.len(), 2);
    for why in reasons {
        assert!(
            matches!(
                &why,
                EagerReason::ConditionalRefused {
                    error: DeviceError::Unavailable {
                        op: DeviceOp::Conditional,
                        ..
                    }
                }
            ),
            "{why}"
        );
    }
}

#[test]
fn conditional_kinds_pick_their_bodies() {
    assert_eq!(Conditional::While.branch(7), Some(0));
    assert_eq!(Conditional::While.branch(0), None);
    assert_eq!(Conditional::If.branch(0), None);
    assert_eq!(Conditional::IfElse.branch(0), Some(1));
    assert_eq!(Conditional::IfElse.branch(2), Some(0));
    assert_eq!(Conditional::Switch(3).branch(2), Some(2));
    assert_eq!(Conditional::Switch(3).branch(3), None);
    assert_eq!(Conditional::Switch(3).branches(), 3);
}

// A graph holding kernels of a host-stateful random generator (cuRAND, by name; the
// simulator models it) launches once, as an eager call would, and never replays: the
// signature runs eagerly from then on, so the draws never depend on how a step ran.
#[test]
fn a_graph_drawing_from_a_host_side_generator_never_replays() {
    let mut g = graft(SimDevice::new(), Config::default());
    let f = g.register("draw", FunctionSpec::default());
    let state = input(&mut g, &[0.0]);
    let mut outcomes = Vec::new();
    for call in 1..=5 {
        let mut out = Vec::new();
        outcomes.push(
            g.call_into(
                f,
                &[&state],
                &[],
                |ctx: &mut Ctx<'_, SimDevice>| {
                    let s = ctx.input(0).clone();
                    let at = ctx.queue().buffer_addr(&s, 0, 4)?;
                    // A generator whose counter the host keeps: baked in at enqueue time.
                    ctx.queue()
                        .launch_kernel("curand_generate_seeded", move |m| {
                            let v = m.f32s(at, 1)?[0];
                            m.write_f32(at, &[v + 1.0])
                        })?;
                    let out = ctx.alloc(4)?;
                    ctx.queue().axpb_f32(&out, &s, 1.0, 0.0, 1)?;
                    Ok::<_, BodyError>(vec![Output::new(out, 0)])
                },
                &mut out,
            )
            .unwrap(),
        );
        assert_eq!(read(&g, &out[0].buffer), vec![call as f32]);
    }
    assert!(matches!(
        outcomes[..2],
        [Outcome::Warmup, Outcome::Recorded(_)]
    ));
    for o in &outcomes[2..] {
        assert!(
            matches!(o, Outcome::Eager(EagerReason::HostRandom { kernels: 1 })),
            "{o:?}"
        );
    }
    assert_eq!(
        g.stats().nodes,
        0,
        "the recording was freed after its one launch"
    );
    assert_eq!(
        g.stats().fallbacks,
        1,
        "a signature eager for good is a fallback: {:?}",
        g.stats()
    );
}
