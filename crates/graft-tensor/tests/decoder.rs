//! The tiny decoder: graft replay, eager execution and the raw graph give identical tokens;
//! each bucket is its own root of the tree; misuse is a typed error.

mod common;

use common::graft;
use graft_core::backend::CoreOnly;
use graft_tensor::{
    Backend, Decoder, DecoderConfig, KvState, Meta, Tensor, TensorError, default_buckets,
};

const SEED: u64 = 7;

/// The token of the raw-graph baseline's sealed capture and launch calls.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

/// Steps per run: 20, or 6 under compute-sanitizer ([`graft_testkit::steps`]).
fn steps() -> usize {
    graft_testkit::steps(20, 6)
}

fn first_tokens(batch: usize, vocab: usize) -> Vec<i32> {
    (0..batch).map(|i| ((i * 37 + 1) % vocab) as i32).collect()
}

/// Runs [`steps`] steps eagerly and through graft from the same first tokens; returns the
/// tokens of every step of each (all rows, padding included).
fn run_both<D: Backend>(
    g: &mut graft_core::Graft<D, Meta>,
    dec: &Decoder<D>,
    fid: graft_core::FunctionId,
    batch: usize,
) -> (Vec<Vec<i32>>, Vec<Vec<i32>>) {
    let ids = first_tokens(batch, dec.config().vocab);
    let bucket = default_buckets().pick(batch).size();

    let mut eager_state = dec.new_state(g, bucket).unwrap();
    let mut t = dec.tokens(g, &ids).unwrap();
    let mut eager = Vec::new();
    for _ in 0..steps() {
        t = dec.step_eager(g, &mut eager_state, &t).unwrap();
        eager.push(t.to_vec_i32(g.device()).unwrap());
    }

    let mut state = dec.new_state(g, bucket).unwrap();
    let mut t = dec.tokens(g, &ids).unwrap();
    let mut grafted = Vec::new();
    for _ in 0..steps() {
        t = dec.step_graft(g, fid, &mut state, &t).unwrap();
        grafted.push(t.to_vec_i32(g.device()).unwrap());
    }
    assert_eq!(state.steps(), steps());
    (eager, grafted)
}

fn graft_matches_eager<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, DecoderConfig::tiny(), SEED).unwrap();
    let fid = dec.register(&mut g);
    for batch in [1, 3] {
        let (eager, grafted) = run_both(&mut g, &dec, fid, batch);
        assert_eq!(
            eager, grafted,
            "batch {batch}: graft and eager tokens differ"
        );
        assert_eq!(eager[0].len(), default_buckets().pick(batch).size());
        let distinct: std::collections::HashSet<i32> = eager.iter().flatten().copied().collect();
        assert!(
            distinct.len() > 1,
            "a degenerate model emits one token: {eager:?}"
        );
    }
    let stats = g.stats();
    assert!(stats.replays >= 2 * (steps() as u64 - 4), "{stats:?}");
    // One root per bucket (1 and 4), keyed by the bucket.
    let roots: Vec<_> = g.nodes().into_iter().filter(|n| n.depth == 0).collect();
    let mut keys: Vec<Vec<u64>> = roots.iter().map(|n| n.keys.clone()).collect();
    keys.sort();
    assert_eq!(keys, vec![vec![1], vec![4]], "{}", g.dump_text());
}
backend_test!(graft_matches_eager);

fn raw_graph_matches_eager<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let dec = Decoder::new(&mut g, DecoderConfig::tiny(), SEED).unwrap();
    let ids = first_tokens(2, dec.config().vocab);
    let mut eager_state = dec.new_state(&mut g, 2).unwrap();
    let mut t = dec.tokens(&mut g, &ids).unwrap();
    let mut eager = Vec::new();
    for _ in 0..steps() {
        t = dec.step_eager(&mut g, &mut eager_state, &t).unwrap();
        eager.push(t.to_vec_i32(g.device()).unwrap());
    }
    let mut state = dec.new_state(&mut g, 2).unwrap();
    let tokens = dec.tokens(&mut g, &ids).unwrap();
    let raw = dec.capture_raw(CORE, &mut g, &state, &tokens).unwrap();
    assert_eq!(
        state.position().to_vec_i32(g.device()).unwrap(),
        vec![0],
        "capture ran nothing"
    );
    let mut got = Vec::new();
    for _ in 0..steps() {
        raw.step(CORE, &mut state).unwrap();
        got.push(raw.tokens().to_vec_i32(g.device()).unwrap());
    }
    assert_eq!(eager, got);
}
backend_test!(raw_graph_matches_eager);

fn misuse_is_typed<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let config = DecoderConfig {
        ctx: 3,
        ..DecoderConfig::tiny()
    };
    let dec = Decoder::new(&mut g, config, SEED).unwrap();
    let fid = dec.register(&mut g);
    assert!(matches!(
        dec.tokens(&mut g, &[0; 33]),
        Err(TensorError::BatchTooLarge { batch: 33, max: 32 })
    ));
    assert!(matches!(
        dec.tokens(&mut g, &[]),
        Err(TensorError::EmptyBatch)
    ));
    assert!(matches!(
        dec.tokens(&mut g, &[1, 512]),
        Err(TensorError::TokenOutOfRange {
            row: 1,
            id: 512,
            ..
        })
    ));
    assert!(matches!(
        dec.new_state(&mut g, 0),
        Err(TensorError::EmptyBatch)
    ));
    let mut state: KvState = dec.new_state(&mut g, 1).unwrap();
    let wrong = dec.tokens(&mut g, &[1, 2]).unwrap();
    assert!(matches!(
        dec.step_graft(&mut g, fid, &mut state, &wrong),
        Err(TensorError::BucketMismatch {
            tokens: 2,
            state: 1
        })
    ));
    let f = Tensor::from_f32(&mut g, &[1], &[0.0]).unwrap();
    assert!(matches!(
        dec.step_eager(&mut g, &mut state, &f),
        Err(TensorError::DType { .. })
    ));
    let mut t = dec.tokens(&mut g, &[5]).unwrap();
    for _ in 0..3 {
        t = dec.step_graft(&mut g, fid, &mut state, &t).unwrap();
    }
    assert!(matches!(
        dec.step_graft(&mut g, fid, &mut state, &t),
        Err(TensorError::ContextFull { bucket: 1, ctx: 3 })
    ));
    state.reset(g.device()).unwrap();
    dec.step_graft(&mut g, fid, &mut state, &t).unwrap();
    assert!(matches!(
        Decoder::new(
            &mut g,
            DecoderConfig {
                heads: 5,
                ..DecoderConfig::tiny()
            },
            SEED
        ),
        Err(TensorError::Config { .. })
    ));
}
backend_test!(misuse_is_typed);

#[test]
fn buckets_pad_up() {
    let b = default_buckets();
    assert_eq!(b.pick(1).size(), 1);
    assert_eq!(b.pick(3).size(), 4);
    assert_eq!(b.pick(17).size(), 32);
    assert!(matches!(
        b.pick(33),
        graft_core::Bucket::Above {
            size: 33,
            largest: 32
        }
    ));
    assert_eq!(b.sizes().len(), 6);
    assert!(DecoderConfig::bench().parameters() > 20_000_000);
}

/// The benchmark model on the GPU: graft and eager agree over a few steps at batch 8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_config_graft_matches_eager_on_cuda() {
    let mut g = graft(common::cuda());
    let dec = Decoder::new(&mut g, DecoderConfig::bench(), SEED).unwrap();
    let fid = dec.register(&mut g);
    let (eager, grafted) = run_both(&mut g, &dec, fid, 8);
    assert_eq!(eager, grafted);
}
