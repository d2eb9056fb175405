//! Scenario 17: random programs against an eager oracle. Every readable output equals what
//! eager execution produced, every invalidated one errors, and no two readable buffers share
//! a byte.

mod common;

use common::*;
use graft::{BodyError, Buffer, CallError, Config, Ctx, FunctionId, FunctionSpec, Output};
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
    Call { function: usize, args: [Arg; 2] },
    Drop(usize),
    MarkStep,
}

/// The functions: name, arity, and the oracle of each.
const FUNCTIONS: [(&str, usize); 5] = [("inc", 1), ("neg", 1), ("add", 2), ("dbl", 1), ("sync", 1)];

fn eval(function: usize, xs: &[&[f32]]) -> Vec<f32> {
    match function {
        0 => xs[0].iter().map(|v| v + 1.0).collect(),
        1 => xs[0].iter().map(|v| -v).collect(),
        2 => xs[0].iter().zip(xs[1]).map(|(a, b)| a + b).collect(),
        3 => xs[0].iter().map(|v| v * 2.0).collect(),
        _ => xs[0].iter().map(|v| v - 1.0).collect(),
    }
}

fn body<D: TestDevice>(
    function: usize,
) -> impl FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> {
    move |ctx: &mut Ctx<'_, D>| {
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let scratch = ctx.alloc(x.len())?; // an intermediate, freed before the body returns
        let out = ctx.alloc(x.len())?;
        let d = ctx.device();
        let (xa, sa, oa) = (x.addr()?, scratch.addr()?, out.addr()?);
        match function {
            0 => {
                d.fill_f32(sa, n, 1.0)?;
                d.add_f32(oa, xa, sa, n)?;
            }
            1 => d.axpb_f32(oa, xa, -1.0, 0.0, n)?,
            2 => {
                d.axpb_f32(sa, xa, 1.0, 0.0, n)?;
                d.add_f32(oa, sa, ctx.input(1).addr()?, n)?;
            }
            3 => d.add_f32(oa, xa, xa, n)?,
            _ => {
                d.axpb_f32(oa, xa, 1.0, -1.0, n)?;
                d.synchronize()?; // breaks capture: this function falls back to eager
            }
        }
        Ok(vec![Output::new(out, function as u32)])
    }
}

struct Held {
    buffer: Buffer,
    expected: Vec<f32>,
}

fn run_program<D: TestDevice>(dev: D, warmups: u32, ops: &[Op]) -> Result<(), TestCaseError> {
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
    for op in ops {
        match op {
            Op::MarkStep => g.mark_step_begin(),
            Op::Drop(i) => {
                if !held.is_empty() {
                    let i = i % held.len();
                    held.swap_remove(i);
                }
            }
            Op::Call { function, args } => {
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
                let result = g.call(fids[*function], &refs, &[], body::<D>(*function));
                match (result, inputs.iter().all(|(_, e)| e.is_some())) {
                    (Ok(outs), true) => {
                        let xs: Vec<&[f32]> =
                            inputs.iter().map(|(_, e)| e.as_deref().unwrap()).collect();
                        let expected = eval(*function, &xs);
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
        6 => (0usize..FUNCTIONS.len(), arg(), arg()).prop_map(|(function, a, b)| Op::Call { function, args: [a, b] }),
        2 => (0usize..16).prop_map(Op::Drop),
        2 => Just(Op::MarkStep),
    ]
}

fn cases() -> u32 {
    std::env::var("GRAFT_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
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
