//! graft-candle-models on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine,
//! through `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): tokens identical to
//! candle eager at every bucket, outputs held across steps, the eager fallback of a body that
//! cannot be captured, the graph memory of three buckets against the largest alone, the
//! ports, generation and serving graphed, the guide's examples, and the Llama split over 2
//! GPUs in 2 processes (tensor parallelism, `tp`).
#![cfg(feature = "cuda")]

use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle::cuda::{GraphMemory, graph_memory, trim_graph_memory};
use graft_candle::{Buckets, CandleGraft, EagerCause, StepOutcome, Uncapturable};
use graft_candle_models::llama::{self, Sizes};
use graft_candle_models::{Decoder, KvCache};

#[path = "support/generate.rs"]
mod generate;
#[path = "gpu/generate.rs"]
mod generate_gpu;
#[path = "../examples/guide.rs"]
mod guide;
#[path = "support/ports.rs"]
mod ports;
#[path = "gpu/ports.rs"]
mod ports_gpu;
#[path = "support/serve.rs"]
mod serve;
#[path = "gpu/serve.rs"]
mod serve_gpu;
#[path = "../examples/serving.rs"]
mod serving_example;
// Tensor parallelism needs NCCL (`--features nccl`).
#[cfg(feature = "nccl")]
#[path = "gpu/tp.rs"]
mod tp;
#[path = "gpu/transformers.rs"]
mod transformers;

#[path = "../../graft-candle/tests/support/gpu.rs"]
mod common;
use common::*;

const BUCKETS: [usize; 3] = [1, 8, 32];

/// The positions of every cache the tests make.
const MAX_SEQ: usize = 96;

fn first_tokens(batch: usize, vocab: usize) -> Vec<u32> {
    (0..batch).map(|i| ((3 + 17 * i) % vocab) as u32).collect()
}

/// One greedy decode step of `model` on `cache` through `graft`.
fn decode(
    graft: &mut CandleGraft,
    step: graft_candle::StepId,
    model: &Decoder,
    cache: &KvCache,
    tokens: &Tensor,
) -> Result<(Tensor, StepOutcome), Box<dyn std::error::Error>> {
    let out = model.decode(graft, step, cache, tokens)?;
    let tokens = out
        .outputs
        .into_iter()
        .next()
        .ok_or("the step returned no output")?;
    Ok((tokens, out.outcome))
}

/// docs/guide.md's candle example, on the GPU: warmup, recording, replays, held outputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_guide_example_runs_on_the_gpu() -> TestResult {
    guide::main()
}

/// docs/guide.md's serving example, on the GPU, graphed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_serving_example_runs_on_the_gpu() -> TestResult {
    serving_example::main()
}

/// Buckets 1, 8 and 32 interleaved in one runtime, 64 steps each (4 under the sanitizer),
/// tokens fed back: every step's tokens equal candle eager's, and after the warmup and the
/// recording every call replays. Every output is kept and checked again at the end.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tokens_match_candle_eager_at_every_bucket_and_held_outputs_stay_correct() -> TestResult {
    let device = gpu();
    // Under a sanitizer the tiny model alone: racecheck over the bench model's GEMMs alone
    // outlasts any reasonable bound.
    let sizes = if under_sanitizer() {
        vec![Sizes::TINY]
    } else {
        vec![Sizes::TINY, Sizes::BENCH]
    };
    for sizes in sizes {
        let model = llama::random(&sizes, 42, DType::F32, &device)?;
        let mut graft = CandleGraft::new(&device)?;
        let step = graft.register_bucketed("decode", Buckets::new(BUCKETS)?);
        let mut runs = Vec::new();
        for batch in BUCKETS {
            let first = Tensor::new(first_tokens(batch, sizes.vocab).as_slice(), &device)?;
            runs.push((
                model.new_cache(batch, MAX_SEQ)?,
                model.new_cache(batch, MAX_SEQ)?,
                first.clone(),
                first,
                Vec::new(),
            ));
        }
        for i in 0..steps(64, 4) {
            for (eager_state, graft_state, eager, ours, held) in runs.iter_mut() {
                *eager = model.greedy(eager_state, eager)?;
                let (next, outcome) = decode(&mut graft, step, &model, graft_state, ours)?;
                *ours = next;
                let want = eager.to_vec1::<u32>()?;
                assert_eq!(
                    ours.to_vec1::<u32>()?,
                    want,
                    "{sizes:?} batch {} step {i}: {outcome:?}",
                    eager_state.max_batch()
                );
                let expected = matches!(
                    (i, &outcome),
                    (0, StepOutcome::Warmup)
                        | (1, StepOutcome::Recorded(_))
                        | (2.., StepOutcome::Replayed(_))
                );
                assert!(
                    expected,
                    "batch {} step {i}: {outcome:?}\n{}",
                    eager_state.max_batch(),
                    diagnostics(&graft)
                );
                held.push((ours.clone(), want));
            }
        }
        for (_, _, _, _, held) in &runs {
            for (i, (tensor, want)) in held.iter().enumerate() {
                assert_eq!(&tensor.to_vec1::<u32>()?, want, "held output of step {i}");
            }
        }
        let stats = graft.graft().ok_or("graphed")?.stats();
        println!(
            "{} layers d={}: {} recordings, {} replays, {} warmups, {} nodes",
            sizes.layers, sizes.hidden, stats.recordings, stats.replays, stats.warmups, stats.nodes
        );
        assert_eq!(stats.recordings, BUCKETS.len() as u64);
    }
    Ok(())
}

/// A body that reads to the host, and one that uploads more than candle's cache holds, fall
/// back to eager with the operation named; the tree and memory stay consistent: later calls
/// of both work (eagerly, with the same reason), and a clean step still records and replays.
#[test]
#[ignore = "needs a CUDA GPU"]
fn uncapturable_bodies_fall_back_to_eager_with_the_operation_named() -> TestResult {
    let device = gpu();
    let sizes = Sizes::TINY;
    let model = llama::random(&sizes, 5, DType::F32, &device)?;
    let mut graft = CandleGraft::new(&device)?;
    let reads = graft.register("decode-with-host-read");
    let uploads = graft.register("decode-with-upload");
    let clean = graft.register("decode");
    let (eager_state, read_state, upload_state, clean_state) = (
        model.new_cache(8, MAX_SEQ)?,
        model.new_cache(8, MAX_SEQ)?,
        model.new_cache(8, MAX_SEQ)?,
        model.new_cache(8, MAX_SEQ)?,
    );
    let first = Tensor::new(first_tokens(8, sizes.vocab).as_slice(), &device)?;
    let (mut eager, mut read, mut upload, mut ok) =
        (first.clone(), first.clone(), first.clone(), first);
    let mut statics = model.statics(&read_state);
    statics.extend(upload_state.tensors());
    for i in 0..steps(8, 4) {
        eager = model.greedy(&eager_state, &eager)?;
        let out = graft.call(reads, &[&read], &statics, &[8], |inputs| {
            let next = model.greedy(&read_state, &inputs[0])?;
            let _on_host = next.to_vec1::<u32>()?;
            Ok(vec![next])
        })?;
        read = out.outputs.into_iter().next().ok_or("no output")?;
        println!("host read, step {i}: {:?}", out.outcome);
        let out = graft.call(uploads, &[&upload], &statics, &[8], |inputs| {
            let next = model.greedy(&upload_state, &inputs[0])?;
            // 8 KiB of host data: over candle's 4 KiB upload cache.
            let zeros = Tensor::new(vec![0u32; 2048].as_slice(), inputs[0].device())?;
            Ok(vec![(next + zeros.narrow(0, 0, 8)?)?])
        })?;
        upload = out.outputs.into_iter().next().ok_or("no output")?;
        println!("upload, step {i}: {:?}", out.outcome);
        let (next, outcome) = decode(&mut graft, clean, &model, &clean_state, &ok)?;
        ok = next;
        let want = eager.to_vec1::<u32>()?;
        assert_eq!(read.to_vec1::<u32>()?, want, "host-read step {i}");
        assert_eq!(upload.to_vec1::<u32>()?, want, "upload step {i}");
        assert_eq!(ok.to_vec1::<u32>()?, want, "clean step {i}");
        if i >= 2 {
            assert!(
                matches!(outcome, StepOutcome::Replayed(_)),
                "clean step {i}: {outcome:?}\n{}",
                diagnostics(&graft)
            );
        }
    }
    let explain: Vec<String> = graft
        .graft()
        .ok_or("graphed")?
        .explain()
        .map(|d| d.to_string())
        .collect();
    println!("{}", explain.join("\n"));
    // The fallbacks, checked on a last call of each.
    let out = graft.call(reads, &[&read], &statics, &[8], |inputs| {
        Ok(vec![model.greedy(&read_state, &inputs[0])?])
    })?;
    match &out.outcome {
        StepOutcome::Eager(EagerCause::Uncapturable(
            op @ (Uncapturable::HostRead { .. } | Uncapturable::CudaCall { .. }),
        )) => println!("host read reason: {op}"),
        other => panic!("expected a host-read fallback, got {other:?}"),
    }
    let out = graft.call(uploads, &[&upload], &statics, &[8], |inputs| {
        Ok(vec![model.greedy(&upload_state, &inputs[0])?])
    })?;
    match &out.outcome {
        StepOutcome::Eager(EagerCause::Uncapturable(op @ Uncapturable::Upload { .. })) => {
            assert!(op.to_string().contains("upload"), "{op}");
            println!("upload reason: {op}");
        }
        other => panic!("expected an upload fallback, got {other:?}"),
    }
    let stats = graft.graft().ok_or("graphed")?.stats();
    assert_eq!(stats.capture_failures, 2, "{stats:?}");
    Ok(())
}

/// Records `buckets` (warmup, record, two replays each) in a fresh runtime, with the graph
/// memory trimmed and its high-water marks reset first, and returns the graph memory the
/// recorded graphs hold once the stream is idle. (A trim then would free it all: memory of
/// graphs that are not executing goes back to the OS, and is mapped again at the next launch.)
fn graph_memory_of(
    device: &Device,
    model: &Decoder,
    buckets: &[usize],
) -> Result<GraphMemory, Box<dyn std::error::Error>> {
    let cuda = device.as_cuda_device()?;
    trim_graph_memory(cuda)?;
    let mut graft = CandleGraft::new(device)?;
    let step = graft.register("decode");
    let vocab = model.spec().vocab;
    let mut states = Vec::new();
    for &b in buckets {
        let tokens = Tensor::new(first_tokens(b, vocab).as_slice(), device)?;
        states.push((model.new_cache(b, MAX_SEQ)?, tokens));
    }
    for _ in 0..4 {
        for (state, tokens) in states.iter_mut() {
            *tokens = decode(&mut graft, step, model, state, tokens)?.0;
        }
    }
    device.synchronize()?;
    let memory = graph_memory(cuda)?;
    drop(graft);
    trim_graph_memory(cuda)?;
    Ok(memory)
}

/// The graph memory of buckets 1, 8 and 32 recorded together is within 1.1x of bucket 32's
/// alone: CUDA reuses the physical memory of graph allocations between graphs launched in
/// order on one stream.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_memory_of_three_buckets_is_near_the_largest_alone() -> TestResult {
    let device = gpu();
    let cuda = device.as_cuda_device()?;
    let model = llama::random(&Sizes::BENCH, 9, DType::F32, &device)?;
    let before = graph_memory(cuda)?;
    let largest = graph_memory_of(&device, &model, &[32])?;
    let all = graph_memory_of(&device, &model, &BUCKETS)?;
    let after = graph_memory(cuda)?;
    println!("graph memory before:            {before:?}");
    println!("graph memory, bucket 32 alone:  {largest:?}");
    println!("graph memory, buckets 1, 8, 32: {all:?}");
    println!("graph memory after dropping:    {after:?}");
    let ratio = |a: u64, b: u64| a as f64 / b.max(1) as f64;
    println!(
        "three buckets / bucket 32 alone: used {:.3} (high {:.3}), mapped {:.3} (high {:.3})",
        ratio(all.used_current, largest.used_current),
        ratio(all.used_high, largest.used_high),
        ratio(all.mapped_current, largest.mapped_current),
        ratio(all.mapped_high, largest.mapped_high),
    );
    assert!(
        largest.mapped_current > 0,
        "no graph memory measured: {largest:?}"
    );
    assert!(
        ratio(all.mapped_current, largest.mapped_current) <= 1.1,
        "three buckets hold {} bytes of graph memory, bucket 32 alone {}",
        all.mapped_current,
        largest.mapped_current
    );
    Ok(())
}
