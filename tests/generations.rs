//! When a step begins, without `mark_step_begin`: random sequences of the loops frameworks run
//! (requests of a prefill and decode steps, with or without a sampler after each decode;
//! layered steps of an embedding, a block called once per layer on that layer's weights, and
//! a head; marks) against a small model of graft's generation rule. Every output equals its
//! host value, graft's generation count follows the model call by call, the tree holds no more
//! nodes than the distinct paths the model's steps take, and nothing falls back to eager or
//! trips a guard.

mod common;

use std::collections::HashSet;

use common::*;
use graft::{Buffer, Ctx, FunctionId, FunctionSpec, Output};
use proptest::prelude::*;

const LAYERS: usize = 3;
const N: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    /// A prefill, then `decodes` decode steps fed back (each followed by a sampler call when
    /// `sample`).
    Request { decodes: usize, sample: bool },
    /// An embedding, the block once per layer on that layer's weights, the head.
    Layered,
    /// `mark_step_begin`.
    Mark,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..8usize, any::<bool>()).prop_map(|(decodes, sample)| Op::Request { decodes, sample }),
        2 => Just(Op::Layered),
        1 => Just(Op::Mark),
    ]
}

/// out = (input0 + input1) * 0.5: every function of the test, on its two inputs.
fn mix<D: TestDevice>(ctx: &mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, graft::BodyError> {
    let (x, w) = (ctx.input(0).clone(), ctx.input(1).clone());
    let sum = ctx.alloc(x.len())?;
    ctx.queue().add_f32(&sum, &x, &w, N)?;
    let out = ctx.alloc(x.len())?;
    ctx.queue().axpb_f32(&out, &sum, 0.5, 0.0, N)?;
    Ok(vec![Output::new(out, 0)])
}

fn host_mix(x: &[f32], w: &[f32]) -> Vec<f32> {
    x.iter().zip(w).map(|(a, b)| (a + b) * 0.5).collect()
}

/// The rule, over calls alone: a call begins a generation when a mark came before it, when its
/// function began one before (and it is not the generation's first call), or when it repeats
/// a call of this generation (the same function on the same static input); the first call of
/// a generation makes its function one that begins them. (graft's rule also lets a function
/// that began generations continue the path where a node of it follows the tip: see
/// [`PRELUDE`].)
#[derive(Default)]
struct Model {
    generation: u64,
    calls: Vec<(FunctionId, Option<usize>)>,
    root_level: HashSet<FunctionId>,
    path: Vec<(FunctionId, Option<usize>)>,
    paths: HashSet<Vec<(FunctionId, Option<usize>)>>,
}

impl Model {
    fn new() -> Model {
        Model {
            generation: 1,
            ..Model::default()
        }
    }

    fn mark(&mut self) {
        self.generation += 1;
        self.calls.clear();
        self.path.clear();
    }

    /// A call of `f` on static input `statics` (an index into the test's weights).
    fn call(&mut self, f: FunctionId, statics: Option<usize>) {
        let call = (f, statics);
        let begins =
            !self.calls.is_empty() && (self.root_level.contains(&f) || self.calls.contains(&call));
        if begins {
            self.mark();
        }
        if self.calls.is_empty() {
            self.root_level.insert(f);
        }
        self.calls.push(call);
        self.path.push(call);
        self.paths.insert(self.path.clone());
    }
}

/// What every sequence starts with: a request whose second decode repeats the first (the
/// decode function begins generations from then on), then two layered steps (the second
/// embedding repeats the first, so it begins them too). From then on a function that begins
/// generations never has a node of its own at the tip, which is what the model leaves out.
const PRELUDE: [Op; 3] = [
    Op::Request {
        decodes: 2,
        sample: false,
    },
    Op::Layered,
    Op::Layered,
];

struct Functions {
    prefill: FunctionId,
    decode: FunctionId,
    sample: FunctionId,
    embed: FunctionId,
    block: FunctionId,
    head: FunctionId,
}

fn run_ops<D: TestDevice>(dev: D, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut g = graft(dev, graft::Config::default());
    let static_at_1 = || FunctionSpec::inference([1]);
    let fns = Functions {
        prefill: g.register("prefill", static_at_1()),
        decode: g.register("decode", static_at_1()),
        sample: g.register("sample", FunctionSpec::default()),
        embed: g.register("embed", FunctionSpec::default()),
        block: g.register("block", static_at_1()),
        head: g.register("head", FunctionSpec::default()),
    };
    // Weights: 0 the prefill's, 1 the decode's (a cache), 2.. the layers'.
    let values: Vec<Vec<f32>> = (0..2 + LAYERS)
        .map(|i| (0..N).map(|j| (i * N + j) as f32).collect())
        .collect();
    let weights: Vec<Buffer> = values.iter().map(|v| input(&mut g, v)).collect();
    let zeros = input(&mut g, &[0.0; N]);
    let mut model = Model::new();
    let mut out = Vec::new();
    // Calls `f` on `x` and weight `w` (a static input where the function declares one, else
    // the zeros); returns the output and checks its value.
    let mut call = |g: &mut G<D>,
                    model: &mut Model,
                    f: FunctionId,
                    x: (&Buffer, &[f32]),
                    w: Option<usize>|
     -> Result<(Buffer, Vec<f32>), TestCaseError> {
        let (wb, wv) = match w {
            Some(i) => (&weights[i], &values[i][..]),
            None => (&zeros, &[0.0; N][..]),
        };
        g.call_into(f, &[x.0, wb], &[], mix::<D>, &mut out)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        model.call(f, w);
        let want = host_mix(x.1, wv);
        let y = out.pop().unwrap().buffer;
        prop_assert_eq!(read(g, &y), want.clone());
        prop_assert_eq!(g.generation(), model.generation, "after {:?}", model.path);
        Ok((y, want))
    };
    let start = input(&mut g, &[1.0; N]);
    for op in PRELUDE.iter().chain(ops) {
        match *op {
            Op::Mark => {
                g.mark_step_begin();
                model.mark();
            }
            Op::Request { decodes, sample } => {
                let (mut x, mut xv) = call(
                    &mut g,
                    &mut model,
                    fns.prefill,
                    (&start, &[1.0; N]),
                    Some(0),
                )?;
                for _ in 0..decodes {
                    (x, xv) = call(&mut g, &mut model, fns.decode, (&x, &xv), Some(1))?;
                    if sample {
                        (x, xv) = call(&mut g, &mut model, fns.sample, (&x, &xv), None)?;
                    }
                }
            }
            Op::Layered => {
                let (mut x, mut xv) =
                    call(&mut g, &mut model, fns.embed, (&start, &[1.0; N]), None)?;
                let mut held = Vec::new();
                for layer in 0..LAYERS {
                    (x, xv) = call(&mut g, &mut model, fns.block, (&x, &xv), Some(2 + layer))?;
                    held.push((x.clone(), xv.clone()));
                }
                call(&mut g, &mut model, fns.head, (&x, &xv), None)?;
                // Every layer's output of this step is still readable and right: the block's
                // calls are one path, not a generation each.
                for (b, v) in held {
                    prop_assert_eq!(read(&g, &b), v);
                }
            }
        }
    }
    let s = g.stats();
    prop_assert_eq!(s.eager_runs, 0);
    prop_assert!(g.guard_findings().is_empty(), "{:?}", g.guard_findings());
    prop_assert!(
        s.nodes <= model.paths.len(),
        "{} nodes for {} distinct paths",
        s.nodes,
        model.paths.len()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn generations_follow_the_rule(ops in prop::collection::vec(op(), 1..12)) {
        run_ops(sim(), &ops)?;
    }
}

/// The patterns one after another, on every backend: two requests, layered steps, a request
/// with a sampler.
fn the_natural_loops_replay<D: TestDevice>(dev: D) {
    let ops = [
        Op::Request {
            decodes: 6,
            sample: false,
        },
        Op::Layered,
        Op::Layered,
        Op::Layered,
        Op::Request {
            decodes: 6,
            sample: true,
        },
        Op::Request {
            decodes: 6,
            sample: false,
        },
    ];
    run_ops(dev, &ops).unwrap();
}
device_test!(the_natural_loops_replay, the_natural_loops_replay);
