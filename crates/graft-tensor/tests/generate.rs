//! Many tokens per launch: the device loop ([`Decoder::generate_graft`]) gives the tokens of
//! one graft call and one host read per token ([`Decoder::generate_per_step`]), greedy and
//! sampled, for K = 8, 32, 128 at batch 1 and 3 (padded to 4; 8 on the GPU), with a sequence ending
//! early at its end token and others at their limits; positions and the generator advance by
//! the steps that ran; held token buffers are never overwritten silently; each loop spec is
//! its own graph. On the simulator, and on CUDA (ignored without a GPU).

mod common;

use common::graft;
use graft_core::{BufferError, FunctionId, Graft, Outcome};
use graft_tensor::{
    Backend, Decoder, DecoderConfig, Generated, KvState, LoopSpec, Meta, PAD, Sampling,
    TensorError, default_buckets,
};

const SEED: u64 = 7;
/// The generator's seed of the sampled runs.
const DRAWS: u64 = 0xfeed_beef;

/// The tiny model with room for three launches of K = 128.
fn config() -> DecoderConfig {
    DecoderConfig {
        ctx: 400,
        ..DecoderConfig::tiny()
    }
}

fn first_tokens(batch: usize, vocab: usize) -> Vec<i32> {
    (0..batch).map(|i| ((i * 37 + 1) % vocab) as i32).collect()
}

/// Which path generates.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Path {
    Loop,
    PerStep,
}

/// The registered functions of both paths.
struct Fns {
    looped: FunctionId,
    step: FunctionId,
}

/// Generates from a fresh sequence (position 0, generator seeded with [`DRAWS`]) with
/// `limits` per row, launch after launch (each continuing from the last one's tokens and
/// limits) until every row has stopped: every launch's result, and the state.
fn launches<D: Backend>(
    g: &mut Graft<D, Meta>,
    dec: &Decoder<D>,
    fns: &Fns,
    path: Path,
    limits: &[usize],
    spec: &LoopSpec,
) -> (Vec<Generated>, KvState) {
    let bucket = default_buckets().pick(limits.len()).size();
    let mut state = dec.new_state(g, bucket).unwrap();
    state.seed(g.device(), DRAWS).unwrap();
    let mut tokens = dec
        .tokens_in(g, &first_tokens(limits.len(), dec.config().vocab), bucket)
        .unwrap();
    let mut left = limits.to_vec();
    let mut out = Vec::new();
    while left.iter().any(|&l| l > 0) {
        let r = match path {
            Path::Loop => dec.generate_graft(g, fns.looped, &mut state, &tokens, &left, spec),
            Path::PerStep => dec.generate_per_step(g, fns.step, &mut state, &tokens, &left, spec),
        }
        .unwrap();
        assert!(r.steps > 0, "{path:?}: a launch with rows left ran no step");
        tokens = r.next.clone();
        left = r.left.clone();
        out.push(r);
    }
    (out, state)
}

/// Both paths on one case: the same tokens, steps and limits launch by launch, and the same
/// position and generator offset at the end; returns the per-step tokens of each row.
fn same_tokens<D: Backend>(
    g: &mut Graft<D, Meta>,
    dec: &Decoder<D>,
    fns: &Fns,
    limits: &[usize],
    spec: &LoopSpec,
) -> Vec<Vec<i32>> {
    let (by_loop, loop_state) = launches(g, dec, fns, Path::Loop, limits, spec);
    let (by_step, step_state) = launches(g, dec, fns, Path::PerStep, limits, spec);
    let what = format!("{spec:?}, limits {limits:?}");
    assert_eq!(by_loop.len(), by_step.len(), "{what}: launches");
    for (i, (a, b)) in by_loop.iter().zip(&by_step).enumerate() {
        assert_eq!(a.emitted, b.emitted, "{what}: launch {i} tokens");
        assert_eq!((a.steps, &a.left), (b.steps, &b.left), "{what}: launch {i}");
    }
    // The third launch of a spec replays its recorded loop (all iterations on the device);
    // a device without conditional nodes runs it eagerly, with the same tokens.
    if g.device().supports_conditionals() && by_loop.len() >= 3 {
        let third = &by_loop[2].outcome;
        assert!(
            matches!(third, Some(Outcome::Replayed(_))),
            "{what}: {third:?}"
        );
    }
    let steps: usize = by_loop.iter().map(|r| r.steps).sum();
    let dev = g.device();
    for state in [&loop_state, &step_state] {
        assert_eq!(state.steps(), steps, "{what}");
        assert_eq!(
            state.position().to_vec_i32(dev).unwrap(),
            vec![steps as i32],
            "{what}: the position advanced once per step that ran"
        );
        let offset = if spec.sampling.is_greedy() { 0 } else { steps };
        assert_eq!(state.rng_state(dev).unwrap(), (DRAWS, offset as u64));
    }
    let rows = limits.len();
    (0..rows)
        .map(|r| by_step.iter().flat_map(|l| l.emitted[r].clone()).collect())
        .collect()
}

/// Loop and per-step agree for K = 8, 32, 128 at each of `batches`, greedy and sampled: first
/// with no end token (rows stop at their limits, at a launch boundary or inside a launch),
/// then with an end token that row 0 emits early.
fn loop_matches_per_step<D: Backend>(dev: D, batches: &[usize]) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, config(), SEED).unwrap();
    let fns = Fns {
        looped: dec.register_loop(&mut g),
        step: dec.register_sampled(&mut g),
    };
    let sampled = Sampling::new(0.9, 40).unwrap();
    for k in [8, 32, 128] {
        for &batch in batches {
            for sampling in [Sampling::GREEDY, sampled] {
                // Three launches of K for row 0, fewer for the others.
                let limits: Vec<usize> = (0..batch).map(|r| 3 * k - (3 * r) % k).collect();
                let spec = LoopSpec {
                    max_tokens: k,
                    eos: None,
                    sampling,
                };
                let tokens = same_tokens(&mut g, &dec, &fns, &limits, &spec);
                let distinct: std::collections::HashSet<i32> =
                    tokens.iter().flatten().copied().collect();
                assert!(distinct.len() > 1, "a degenerate model: {tokens:?}");
                // Row 0's third token ends sequences: row 0 stops early.
                let eos = tokens[0][2];
                let spec = LoopSpec {
                    eos: Some(eos),
                    ..spec
                };
                let ended = same_tokens(&mut g, &dec, &fns, &limits, &spec);
                let first = tokens[0].iter().position(|&t| t == eos).unwrap();
                assert_eq!(ended[0], tokens[0][..=first], "row 0 ends at its end token");
                assert!(ended[0].len() < limits[0]);
            }
        }
    }
}
/// Batch 1 and 3 (padded to 4) on the simulator, 1 and 8 on the GPU.
mod loop_matches_per_step {
    #[test]
    fn sim() {
        super::loop_matches_per_step(graft_sim::SimDevice::new(), &[1, 3]);
    }
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda() {
        super::loop_matches_per_step(super::common::cuda(), &[1, 8]);
    }
}

/// A held token buffer of an earlier launch keeps its tokens or is invalidated, never
/// overwritten by a later replay of the same loop.
fn a_held_token_buffer_is_never_overwritten<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, config(), SEED).unwrap();
    let fid = dec.register_loop(&mut g);
    let spec = LoopSpec {
        max_tokens: 8,
        eos: None,
        sampling: Sampling::new(1.0, 0).unwrap(),
    };
    let mut state = dec.new_state(&mut g, 2).unwrap();
    state.seed(g.device(), DRAWS).unwrap();
    let mut tokens = dec.tokens(&mut g, &[3, 4]).unwrap();
    let mut held = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        let r = dec
            .generate_graft(&mut g, fid, &mut state, &tokens, &[100, 100], &spec)
            .unwrap();
        let buffer = r.tokens.clone().unwrap();
        let seen = buffer.to_vec_i32(g.device()).unwrap();
        // Step i's tokens at row i of the buffer (none PAD: no row stopped).
        assert_eq!(seen.len(), 8 * 2);
        for (row, emitted) in r.emitted.iter().enumerate() {
            let column: Vec<i32> = seen.chunks(2).map(|step| step[row]).collect();
            assert_eq!(&column, emitted);
        }
        assert!(!seen.contains(&PAD));
        held.push((buffer, seen));
        outcomes.push(r.outcome.unwrap());
        tokens = r.next;
    }
    // Recorded on a device with conditional nodes; run eagerly (its loop on the host) on one
    // without, where the held buffers are the eager pool's and stay valid.
    if g.device().supports_conditionals() {
        assert!(matches!(
            outcomes[..3],
            [Outcome::Warmup, Outcome::Recorded(_), Outcome::Replayed(_)]
        ));
    }
    for (i, (buffer, seen)) in held.iter().enumerate() {
        match buffer.to_vec_i32(g.device()) {
            Ok(now) => assert_eq!(&now, seen, "held buffer {i} changed under its holder"),
            Err(e) => assert!(
                matches!(
                    e,
                    TensorError::Buffer(BufferError::Overwritten { .. })
                        | TensorError::Memory(graft_core::MemoryError::Buffer(
                            BufferError::Overwritten { .. }
                        ))
                ),
                "{e}"
            ),
        }
    }
    assert_eq!(state.steps(), 40);
}
backend_test!(a_held_token_buffer_is_never_overwritten);

/// Each loop spec is its own graph: K, the end token and the sampling parameters are keys.
fn each_spec_is_its_own_graph<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, config(), SEED).unwrap();
    let fid = dec.register_loop(&mut g);
    let base = LoopSpec {
        max_tokens: 4,
        eos: None,
        sampling: Sampling::GREEDY,
    };
    let specs = [
        base,
        LoopSpec {
            max_tokens: 5,
            ..base
        },
        LoopSpec {
            eos: Some(9),
            ..base
        },
        LoopSpec {
            sampling: Sampling::new(1.0, 3).unwrap(),
            ..base
        },
        LoopSpec {
            sampling: Sampling::new(1.0, 4).unwrap(),
            ..base
        },
    ];
    let mut state = dec.new_state(&mut g, 1).unwrap();
    let tokens = dec.tokens(&mut g, &[1]).unwrap();
    for spec in &specs {
        for _ in 0..2 {
            state.reset(g.device()).unwrap();
            dec.generate_graft(&mut g, fid, &mut state, &tokens, &[50], spec)
                .unwrap();
        }
    }
    let roots: Vec<Vec<u64>> = g
        .nodes()
        .into_iter()
        .filter(|n| n.depth == 0)
        .map(|n| n.keys)
        .collect();
    if g.device().supports_conditionals() {
        assert_eq!(roots.len(), specs.len(), "{}", g.dump_text());
        assert!(roots.contains(&vec![1, 4, 10, 0, 0]), "{roots:?}");
    }
}
backend_test!(each_spec_is_its_own_graph);

fn misuse_is_typed<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, config(), SEED).unwrap();
    let fid = dec.register_loop(&mut g);
    let mut state = dec.new_state(&mut g, 2).unwrap();
    let tokens = dec.tokens(&mut g, &[1, 2]).unwrap();
    let spec = LoopSpec {
        max_tokens: 4,
        eos: None,
        sampling: Sampling::GREEDY,
    };
    let mut run = |left: &[usize], spec: LoopSpec| {
        dec.generate_graft(&mut g, fid, &mut state, &tokens, left, &spec)
            .unwrap_err()
    };
    assert!(matches!(
        run(&[1, 1, 1], spec),
        TensorError::Limits {
            found: 3,
            bucket: 2
        }
    ));
    let zero = LoopSpec {
        max_tokens: 0,
        ..spec
    };
    assert!(matches!(
        run(&[1], zero),
        TensorError::LoopLength { max_tokens: 0, .. }
    ));
    let eos = LoopSpec {
        eos: Some(512),
        ..spec
    };
    assert!(matches!(
        run(&[1], eos),
        TensorError::EosOutOfRange { eos: 512, .. }
    ));
    let cold = LoopSpec {
        sampling: Sampling {
            temperature: f32::NAN,
            top_k: 0,
        },
        ..spec
    };
    assert!(matches!(run(&[1], cold), TensorError::Temperature { .. }));
    // No rows with tokens left: no step runs, nothing moves.
    let r = dec
        .generate_graft(&mut g, fid, &mut state, &tokens, &[0, 0], &spec)
        .unwrap();
    assert_eq!((r.steps, r.emitted.clone()), (0, vec![vec![], vec![]]));
    assert_eq!(state.steps(), 0);
    assert_eq!(state.position().to_vec_i32(g.device()).unwrap(), vec![0]);
}
backend_test!(misuse_is_typed);

/// The loop stops when the KV cache is full, and a full state is refused, as a step is.
fn a_full_context_stops_the_loop<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let small = DecoderConfig {
        ctx: 10,
        ..DecoderConfig::tiny()
    };
    let dec = Decoder::new(&mut g, small, SEED).unwrap();
    let fns = Fns {
        looped: dec.register_loop(&mut g),
        step: dec.register_sampled(&mut g),
    };
    let spec = LoopSpec {
        max_tokens: 8,
        eos: None,
        sampling: Sampling::new(1.0, 0).unwrap(),
    };
    let mut state = dec.new_state(&mut g, 1).unwrap();
    let tokens = dec.tokens(&mut g, &[1]).unwrap();
    let a = dec
        .generate_graft(&mut g, fns.looped, &mut state, &tokens, &[100], &spec)
        .unwrap();
    let b = dec
        .generate_graft(&mut g, fns.looped, &mut state, &a.next, &a.left, &spec)
        .unwrap();
    assert_eq!((a.steps, b.steps, state.steps()), (8, 2, 10));
    assert!(matches!(
        dec.generate_graft(&mut g, fns.looped, &mut state, &b.next, &b.left, &spec),
        Err(TensorError::ContextFull { bucket: 1, ctx: 10 })
    ));
    assert!(matches!(
        dec.generate_per_step(&mut g, fns.step, &mut state, &b.next, &b.left, &spec),
        Err(TensorError::ContextFull { .. })
    ));
}
backend_test!(a_full_context_stops_the_loop);

/// The benchmark model on the GPU: loop and per-step agree at batch 8, sampled, K = 32.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_config_loop_matches_per_step_on_cuda() {
    let mut g = graft(common::cuda());
    let dec = Decoder::new(&mut g, DecoderConfig::bench(), SEED).unwrap();
    let fns = Fns {
        looped: dec.register_loop(&mut g),
        step: dec.register_sampled(&mut g),
    };
    let spec = LoopSpec {
        max_tokens: 32,
        eos: None,
        sampling: Sampling::new(0.8, 50).unwrap(),
    };
    same_tokens(&mut g, &dec, &fns, &[96; 8], &spec);
}
