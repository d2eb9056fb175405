//! Scenario 17: random programs against an eager oracle. Every readable output equals what
//! eager execution produced, every invalidated one errors, no two readable buffers share a
//! byte, and the graph pool never holds more than twice the memory the program needs at its
//! peak. Programs write inputs in place, panic in bodies, and grow a branch's scratch.

mod common;

use common::*;
use std::panic::{AssertUnwindSafe, catch_unwind};

use graft::{BodyError, Buffer, CallError, Config, Ctx, FunctionId, FunctionSpec, Output, RunKind};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Arg {
    /// A new buffer outside the graph pool: `size` floats of `value`.
    Fresh { value: i8, wide: bool },
    /// A held buffer (index modulo the number held).
    Held(usize),
}

#[derive(Clone, Debug)]
enum Op {
    /// `scratch` picks the scratch size of `grow` (a key, so each size is its own branch);
    /// `panic` makes `boom` panic whenever its body runs.
    Call {
        function: usize,
        args: [Arg; 2],
        scratch: u64,
        panic: bool,
    },
    Drop(usize),
    MarkStep,
}

/// The functions: name, arity, and the oracle of each.
const FUNCTIONS: [(&str, usize); 8] = [
    ("inc", 1),
    ("neg", 1),
    ("add", 2),
    ("dbl", 1),
    ("sync", 1),
    ("bump", 1),
    ("boom", 1),
    ("grow", 1),
];
const BUMP: usize = 5;
const BOOM: usize = 6;
const GROW: usize = 7;
/// `grow` allocates `scratch * GROW_UNIT` bytes of scratch.
const GROW_UNIT: usize = 1 << 20;
/// The pool's rounding of every block.
const BLOCK: usize = 512;
/// Physical memory granularity of both backends.
const GRANULE: usize = 2 << 20;

/// The output of `function` on inputs `xs`. `bump` also adds one to its input in place.
fn eval(function: usize, xs: &[&[f32]]) -> Vec<f32> {
    match function {
        0 | BOOM => xs[0].iter().map(|v| v + 1.0).collect(),
        1 => xs[0].iter().map(|v| -v).collect(),
        2 => xs[0].iter().zip(xs[1]).map(|(a, b)| a + b).collect(),
        3 => xs[0].iter().map(|v| v * 2.0).collect(),
        4 => xs[0].iter().map(|v| v - 1.0).collect(),
        BUMP => xs[0].iter().map(|v| (v + 1.0) * 2.0).collect(),
        _ => xs[0].iter().map(|v| v + 3.0).collect(),
    }
}

/// Bytes the pool needs for a buffer of `len` bytes.
fn rounded(len: usize) -> usize {
    len.max(1).next_multiple_of(BLOCK)
}

fn body<D: TestDevice>(
    function: usize,
    scratch_units: u64,
    panic: bool,
) -> impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> {
    move |ctx: &mut Ctx<'_, D>| {
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let scratch_bytes = if function == GROW {
            scratch_units as usize * GROW_UNIT
        } else {
            x.len()
        };
        let scratch = ctx.alloc(scratch_bytes)?; // an intermediate, freed before the body returns
        let out = ctx.alloc(x.len())?;
        let d = ctx.queue();
        let (xa, sa, oa) = (&x, &scratch, &out);
        match function {
            0 => {
                d.fill_f32(sa, n, 1.0)?;
                d.add_f32(oa, xa, sa, n)?;
            }
            1 => d.axpb_f32(oa, xa, -1.0, 0.0, n)?,
            2 => {
                d.axpb_f32(sa, xa, 1.0, 0.0, n)?;
                d.add_f32(oa, sa, ctx.input(1), n)?;
            }
            3 => d.add_f32(oa, xa, xa, n)?,
            4 => {
                d.axpb_f32(oa, xa, 1.0, -1.0, n)?;
                d.synchronize()?; // breaks capture: this function falls back to eager
            }
            BUMP => {
                d.axpb_f32(xa, xa, 1.0, 1.0, n)?; // writes its input in place
                d.add_f32(oa, xa, xa, n)?;
            }
            BOOM => {
                d.fill_f32(sa, n, 1.0)?;
                if panic && ctx.kind() != RunKind::Eager {
                    panic!("boom: the body panics on purpose");
                }
                d.add_f32(oa, xa, sa, n)?;
            }
            _ => {
                // The scratch's size is what matters (memory): all of it is written, so every
                // granule under it must be mapped; the sum reads its first `n` elements.
                d.fill_f32(sa, scratch_bytes / 4, 3.0)?;
                d.add_f32(oa, xa, sa, n)?;
            }
        }
        Ok(vec![Output::new(out, function as u32)])
    }
}

struct Held {
    buffer: Buffer,
    expected: Vec<f32>,
}

/// Keeps the expected panics of `boom` off the test output; any other panic is reported.
fn quiet_expected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let expected = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|m| m.contains("on purpose"));
            if !expected {
                report(info);
            }
        }));
    });
}

fn run_program<D: TestDevice>(dev: D, warmups: u32, ops: &[Op]) -> Result<(), TestCaseError> {
    quiet_expected_panics();
    let mut g = graft(
        dev,
        Config {
            warmups,
            ..Config::default()
        },
    );
    let fids: Vec<FunctionId> = FUNCTIONS
        .iter()
        .map(|(name, _)| g.register(name, FunctionSpec::default()))
        .collect();
    let mut held: Vec<Held> = Vec::new();
    // The most memory the program needs at once: what it holds plus one call's inputs,
    // placeholders, scratch and output. The pool may hold at most twice that (rounded to
    // whole granules), whatever order the branches run in.
    let mut demand_peak = 0usize;
    for op in ops {
        match op {
            Op::MarkStep => g.mark_step_begin(),
            Op::Drop(i) => {
                if !held.is_empty() {
                    let i = i % held.len();
                    held.swap_remove(i);
                }
            }
            Op::Call {
                function,
                args,
                scratch,
                panic,
            } => {
                let arity = FUNCTIONS[*function].1;
                let mut inputs: Vec<(Buffer, Option<Vec<f32>>)> = Vec::new();
                for arg in &args[..arity] {
                    let picked = match arg {
                        Arg::Held(i) if !held.is_empty() => {
                            let h = &held[i % held.len()];
                            let valid = h.buffer.addr().is_ok();
                            (h.buffer.clone(), valid.then(|| h.expected.clone()))
                        }
                        Arg::Held(_) | Arg::Fresh { .. } => {
                            let (value, wide) = match arg {
                                Arg::Fresh { value, wide } => (*value, *wide),
                                Arg::Held(_) => (1, false),
                            };
                            let n = if wide { 8 } else { 4 };
                            let values = vec![value as f32; n];
                            (input(&mut g, &values), Some(values))
                        }
                    };
                    inputs.push(picked);
                }
                if arity == 2 && inputs[0].0.len() != inputs[1].0.len() {
                    inputs.truncate(1);
                    let again = inputs[0].clone();
                    inputs.push(again);
                }
                let refs: Vec<&Buffer> = inputs.iter().map(|(b, _)| b).collect();
                let held_bytes: usize = held.iter().map(|h| rounded(h.buffer.len())).sum();
                let len = refs[0].len();
                let scratch_bytes = if *function == GROW {
                    *scratch as usize * GROW_UNIT
                } else {
                    len
                };
                let call_bytes = 2 * refs.iter().map(|b| rounded(b.len())).sum::<usize>()
                    + rounded(scratch_bytes)
                    + 2 * rounded(len);
                demand_peak = demand_peak.max(held_bytes + call_bytes);
                let keys = [*scratch];
                let keys: &[u64] = if *function == GROW { &keys } else { &[] };
                let body = body::<D>(*function, *scratch, *panic);
                let result = catch_unwind(AssertUnwindSafe(|| {
                    g.call(fids[*function], &refs, keys, body)
                }));
                let Ok(result) = result else {
                    // Only `boom` panics, and only when its body runs; graft is as it was,
                    // which the checks below and the next operations verify.
                    prop_assert!(*function == BOOM && *panic, "unexpected panic");
                    continue;
                };
                match (result, inputs.iter().all(|(_, e)| e.is_some())) {
                    (Ok(outs), true) => {
                        let xs: Vec<&[f32]> =
                            inputs.iter().map(|(_, e)| e.as_deref().unwrap()).collect();
                        let expected = eval(*function, &xs);
                        if *function == BUMP {
                            // The input was written in place: so is every handle to it.
                            let bumped: Vec<f32> = xs[0].iter().map(|v| v + 1.0).collect();
                            for h in held.iter_mut() {
                                if h.buffer.same_storage(&inputs[0].0) {
                                    h.expected.clone_from(&bumped);
                                }
                            }
                            prop_assert_eq!(&read(&g, &inputs[0].0), &bumped, "input not written");
                        }
                        let out = outs.into_iter().next().unwrap().buffer;
                        prop_assert_eq!(&read(&g, &out), &expected);
                        held.push(Held {
                            buffer: out,
                            expected,
                        });
                    }
                    (Err(CallError::InvalidInput { .. }), false) => {}
                    (result, all_valid) => {
                        return Err(TestCaseError::fail(format!(
                            "call of {} with all inputs valid = {all_valid} gave {:?}",
                            FUNCTIONS[*function].0,
                            result.map(|o| o.len())
                        )));
                    }
                }
            }
        }
        // Every readable buffer holds exactly what eager execution produced...
        let mut ranges = Vec::new();
        for h in &held {
            if let Ok(addr) = h.buffer.addr() {
                let got = g.read_f32(&h.buffer);
                prop_assert!(got.is_ok(), "read failed: {:?}", got);
                prop_assert_eq!(
                    got.unwrap(),
                    h.expected.clone(),
                    "silently wrong data at {}",
                    addr
                );
                if !held
                    .iter()
                    .any(|o| o.buffer.same_storage(&h.buffer) && !std::ptr::eq(o, h))
                {
                    ranges.push((addr.0, addr.0 + h.buffer.len() as u64));
                }
            }
        }
        // ...and no two readable buffers share a byte.
        ranges.sort_unstable();
        ranges.dedup();
        for w in ranges.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "readable buffers overlap: {:x?}", w);
        }
        // The tree's links and candidate lookup agree with its nodes.
        prop_assert_eq!(g.check_tree(), Ok(()));
        // The memory bound: the tree's memory follows the program's need, not the sum of
        // its branches.
        let mapped = g.stats().pool.mapped;
        let bound = (2 * demand_peak).next_multiple_of(GRANULE) + GRANULE;
        prop_assert!(
            mapped <= bound,
            "the graph pool holds {} bytes, over the bound of {} (peak need {})",
            mapped,
            bound,
            demand_peak
        );
    }
    g.reset().map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(g.stats().pool.live_blocks, 0);
    Ok(())
}

fn arg() -> impl Strategy<Value = Arg> {
    prop_oneof![
        (-8i8..8, any::<bool>()).prop_map(|(value, wide)| Arg::Fresh { value, wide }),
        (0usize..16).prop_map(Arg::Held),
        (0usize..16).prop_map(Arg::Held),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..FUNCTIONS.len(), arg(), arg(), 1u64..9, any::<bool>())
            .prop_map(|(function, a, b, scratch, panic)| Op::Call { function, args: [a, b], scratch, panic }),
        2 => (0usize..16).prop_map(Op::Drop),
        2 => Just(Op::MarkStep),
    ]
}

/// `GRAFT_MODEL_CASES` programs, else 1,000 (8 under compute-sanitizer).
fn cases() -> u32 {
    std::env::var("GRAFT_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(graft_testkit::steps(1000, 8) as u32)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_programs_match_eager_sim(warmups in 0u32..3, ops in prop::collection::vec(op(), 1..60)) {
        run_program(sim(), warmups, &ops)?;
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn random_programs_match_eager_cuda(warmups in 0u32..3, ops in prop::collection::vec(op(), 1..60)) {
        run_program(cuda(), warmups, &ops)?;
    }
}
