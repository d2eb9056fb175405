//! Serving on the GPU: the continuous batch graphed (every prefill and decode bucket
//! recorded once, then only replays) gives each request its tokens alone; bad requests are
//! refused; and the memory plan at near-full memory records every bucket, then gives the kv
//! cache all the memory left but its margin.

use candle_core::{DType, Tensor};
use graft_candle::{CandleGraft, cuda};
use graft_candle_models::serve::{self as engine, Engine};

use super::serve::{self, MAX_SEQ};
use super::{TestResult, gpu, under_sanitizer};

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graphed_continuous_batch_gives_every_request_its_tokens_alone() -> TestResult {
    for window in [None, Some(8)] {
        let dir = tempfile::tempdir()?;
        let model = serve::model(window, &gpu(), dir.path())?;
        serve::batch_equals_alone(&model, |graphed| {
            let g = graphed
                .graft()
                .and_then(CandleGraft::graft)
                .ok_or("graft-candle runs graphed on a GPU")?;
            let stats = g.stats();
            // 3 prefill and 3 decode buckets, each recorded once by `capture`.
            assert_eq!(stats.recordings, 6, "{stats:?}\n{:?}", g.guard_findings());
            assert_eq!(stats.eager_runs, 0, "{stats:?}");
            assert!(stats.replays >= 30, "{stats:?}");
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_requests_are_refused_and_the_others_are_served_graphed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &gpu(), dir.path())?;
    serve::bad_requests_are_refused_and_nothing_else_changes(&model)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_memory_plan_at_near_full_memory_records_first_and_gives_the_cache_the_rest() -> TestResult {
    let device = gpu();
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &device, dir.path())?;
    let cuda = device.as_cuda_device()?;
    // Leave 1 GiB free: the plan must record every bucket, then size the cache from what
    // is left, keeping its margin.
    let (free, _) = cuda::free_memory(cuda)?;
    let leave = 1u64 << 30;
    let ballast = Tensor::zeros((free.saturating_sub(leave)) as usize, DType::U8, &device)?;
    // compute-sanitizer allocates device memory of its own for every launch it tracks.
    let margin = if under_sanitizer() {
        512u64 << 20
    } else {
        64 << 20
    };
    let config = graft_core::Config {
        replace_moved_static: true,
        ..graft_core::Config::default()
    };
    let graft = CandleGraft::with_config(&device, config)?;
    let cache = model.new_serving_cache(4, MAX_SEQ)?;
    let mut graphed = Engine::graphed(&model, cache, graft, serve::config()?)?;
    let plan = engine::plan(&mut graphed, margin)?;
    println!("{plan:?}");
    let kept = plan.free_for_cache - plan.cache_bytes;
    assert!(plan.cache_bytes + margin <= plan.free_for_cache, "{plan:?}");
    assert!(
        kept < margin + 2 * plan.row_bytes,
        "the cache gets all but the margin (within a row): {plan:?}"
    );
    assert!(plan.sequences > 1000, "{plan:?}");
    assert!(
        plan.graph_driver_after <= plan.graph_driver,
        "recording against the serving cache holds no more graph memory: {plan:?}"
    );
    let stats = graphed
        .graft()
        .and_then(CandleGraft::graft)
        .ok_or("graphed")?
        .stats();
    let recorded = stats.recordings;
    // It serves: every request's tokens alone, no new recording.
    let requests = serve::trace();
    let out = serve::run(&mut graphed, &requests)?;
    for (_, r) in &requests {
        assert_eq!(out[&r.id], serve::alone(&model, r)?, "request {}", r.id);
    }
    let g = graphed
        .graft()
        .and_then(CandleGraft::graft)
        .ok_or("graphed")?;
    let stats = g.stats();
    assert_eq!(
        stats.recordings,
        recorded,
        "{stats:?}\n{:?}",
        g.guard_findings()
    );
    drop(graphed);
    drop(ballast);
    Ok(())
}

/// Speculative decoding graphed: every verify pass (one recording per draft count) replays,
/// and the tokens equal plain decoding's, greedy and sampled (f32).
#[test]
#[ignore = "needs a CUDA GPU"]
fn speculative_decoding_replays_and_gives_plain_decoding_tokens() -> TestResult {
    let dir = tempfile::tempdir()?;
    let device = gpu();
    let model = serve::model(None, &device, dir.path())?;
    let sampled = engine::SampleParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 1234,
        index: 0,
    };
    for sampling in [engine::SampleParams::GREEDY, sampled] {
        let mut graft = CandleGraft::new(&device)?;
        serve::speculation_equals_plain_decoding(&model, Some(&mut graft), sampling)?;
        let g = graft.graft().ok_or("graft-candle runs graphed on a GPU")?;
        let stats = g.stats();
        assert_eq!(stats.eager_runs, 0, "{stats:?}\n{:?}", g.guard_findings());
        assert!(stats.replays > 0, "{stats:?}");
    }
    Ok(())
}

/// Speculation in the engine changes no token on the GPU either, eager and graphed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn speculation_in_the_engine_changes_no_token_on_the_gpu() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(Some(8), &gpu(), dir.path())?;
    serve::speculation_changes_no_token(&model, || Ok(CandleGraft::new(model.device())?))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_paged_cache_serves_the_tokens_of_static_rows_graphed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &gpu(), dir.path())?;
    serve::paged_equals_static(&model)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_paged_cache_refuses_what_it_cannot_serve_on_the_gpu() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &gpu(), dir.path())?;
    serve::paged_misuse_is_refused(&model)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_launch_of_several_prompts_equals_a_launch_each_on_the_gpu() -> TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &gpu(), dir.path())?;
    serve::segments_equal_separate_launches(&model)
}
