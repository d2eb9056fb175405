//! Serving on the CPU (in CI): a continuous batch, prefilled in padded chunks, gives each
//! request the tokens it gets alone; bad requests are refused without touching the others.
//! tests/gpu/serve.rs runs the same bodies graphed.

#[path = "support/serve.rs"]
mod serve;

use candle_core::{D, DType, Device, Tensor};
use graft_candle_models::serve::{Request, SampleParams};

#[test]
fn a_continuous_batch_gives_every_request_its_tokens_alone() -> serve::TestResult {
    for window in [None, Some(8)] {
        let dir = tempfile::tempdir()?;
        let model = serve::model(window, &Device::Cpu, dir.path())?;
        serve::batch_equals_alone(&model, |_| Ok(()))?;
    }
    Ok(())
}

#[test]
fn bad_requests_are_refused_and_the_others_are_served() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    serve::bad_requests_are_refused_and_nothing_else_changes(&model)
}

/// A prompt prefilled in padded chunks (the fused path: the chunk's tokens as a batch of one
/// cache row at their own positions, padding in the scratch row) writes the cache that
/// decoding it token by token writes, and picks the same next token.
#[test]
fn a_prefill_writes_what_decoding_the_prompt_writes() -> serve::TestResult {
    let dev = &Device::Cpu;
    for window in [None, Some(8)] {
        let dir = tempfile::tempdir()?;
        let model = serve::model(window, dev, dir.path())?;
        let prompt: Vec<u32> = (0..21u32).map(|i| (i * 37 + 5) % 256).collect();
        let decoded = model.new_serving_cache(1, serve::MAX_SEQ)?;
        let mut logits = None;
        for &t in &prompt {
            logits = Some(model.forward(&decoded, &Tensor::new(&[t], dev)?)?);
        }
        let want = logits
            .ok_or("no prompt")?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        let prefilled = model.new_serving_cache(1, serve::MAX_SEQ)?;
        let mut next = Vec::new();
        for part in prompt.chunks(8) {
            let mut padded = part.to_vec();
            padded.resize(8, 255);
            let tokens = Tensor::new(padded.as_slice(), dev)?;
            next = model
                .prefill_forward(&prefilled, 0, &tokens, part.len(), SampleParams::GREEDY)?
                .to_vec1::<u32>()?;
        }
        assert_eq!(next, want, "window {window:?}: the next token");
        assert_eq!(prefilled.positions(), decoded.positions());
        let layers = 2 * model.spec().layers;
        for (i, (a, b)) in prefilled
            .tensors()
            .iter()
            .zip(decoded.tensors())
            .take(layers)
            .enumerate()
        {
            // Row 0 (the scratch row holds the padding's keys and values).
            let diff = (a.get(0)? - b.get(0)?)?
                .abs()?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(
                diff < 1e-4,
                "window {window:?}: cache tensor {i} differs by {diff}"
            );
        }
    }
    Ok(())
}

/// Speculative decoding (verify passes over the last token and k drafts) gives plain decoding's
/// tokens, greedy and sampled with the same seed, with every draft accepted, none, or prompt
/// lookup's; eagerly and through graft.
#[test]
fn speculative_decoding_gives_plain_decoding_tokens() -> serve::TestResult {
    let sampled = SampleParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 1234,
        index: 0,
    };
    for window in [None, Some(8)] {
        let dir = tempfile::tempdir()?;
        let model = serve::model(window, &Device::Cpu, dir.path())?;
        for sampling in [SampleParams::GREEDY, sampled] {
            serve::speculation_equals_plain_decoding(&model, None, sampling)?;
            let mut graft = graft_candle::CandleGraft::new(&Device::Cpu)?;
            serve::speculation_equals_plain_decoding(&model, Some(&mut graft), sampling)?;
        }
    }
    Ok(())
}

/// Speculation in the engine changes no request's tokens (alone or in a batch, greedy or
/// sampled, eager or through graft), and takes fewer steps for a repeating greedy request.
#[test]
fn speculation_in_the_engine_changes_no_token() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(Some(8), &Device::Cpu, dir.path())?;
    serve::speculation_changes_no_token(&model, || {
        Ok(graft_candle::CandleGraft::new(&Device::Cpu)?)
    })
}

/// The rejection rule, counted: one draft d, verified under sampling with the two most likely
/// tokens kept (top-k 2), is accepted with the model's probability of d, and a rejection emits
/// the other token (the residual distribution), over 1,000 seeds. The frequency must be within
/// 5 standard deviations of the probability (computed here in f64 from the pass's own logits:
/// the plain decode step's at the same position), and both outcomes must occur.
#[test]
fn a_draft_is_accepted_with_the_models_probability_of_it() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    let dev = Device::Cpu;
    let prompt = [5u32, 17, 99, 3];
    let cache = model.new_serving_cache(1, serve::MAX_SEQ)?;
    for &t in &prompt[..prompt.len() - 1] {
        model.forward(&cache, &Tensor::new(&[t], &dev)?)?;
    }
    let at = (prompt.len() - 1) as u32;
    let last = prompt[prompt.len() - 1];
    // The two most likely tokens after the prompt and the probability of the second among
    // them at temperature 1: p(d) = 1 / (1 + exp(l_top - l_d)).
    let logits: Vec<f32> = model
        .forward(&cache, &Tensor::new(&[last], &dev)?)?
        .squeeze(0)?
        .to_vec1()?;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let (top, d) = (order[0] as u32, order[1] as u32);
    let p = 1.0 / (1.0 + f64::from(logits[order[0]] - logits[order[1]]).exp());
    let draws = 1000;
    let mut accepted = 0;
    for seed in 0..draws {
        cache.set_position(0, at)?;
        let sampling = SampleParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed,
            index: 0,
        };
        let v = model.verify_forward(&cache, 0, &Tensor::new(&[last, d], &dev)?, sampling)?;
        match v.accepted {
            1 => {
                accepted += 1;
                assert_eq!(v.tokens()[0], d, "an accepted draft is emitted");
            }
            _ => assert_eq!(
                v.tokens(),
                [top],
                "a rejection emits the residual's only token"
            ),
        }
    }
    let freq = f64::from(accepted) / draws as f64;
    let sigma = (p * (1.0 - p) / draws as f64).sqrt();
    assert!(
        (freq - p).abs() <= 5.0 * sigma.max(1e-3),
        "draft accepted {accepted} of {draws} times ({freq:.3}), the model gives it {p:.3}"
    );
    assert!(
        0 < accepted && accepted < draws as u32,
        "p(d) = {p:.3}: pick a prompt whose two best tokens are closer"
    );
    Ok(())
}

#[test]
fn a_paged_cache_serves_the_tokens_of_static_rows() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    serve::paged_equals_static(&model)
}

#[test]
fn a_paged_cache_refuses_what_it_cannot_serve() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    serve::paged_misuse_is_refused(&model)
}

#[test]
fn one_launch_of_several_prompts_equals_a_launch_each() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    serve::segments_equal_separate_launches(&model)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Random traces over a paged cache of random size (admission waiting for blocks,
    /// preemption, shared prefixes, several prompts a launch) give every request the tokens
    /// it gets alone on static rows.
    #[test]
    fn a_paged_engine_gives_random_traces_their_tokens_alone(
        blocks in 14usize..40,
        shared in 0usize..20,
        requests in proptest::collection::vec(
            (1usize..24, 1usize..14, 0usize..8, proptest::bool::ANY),
            1..6,
        ),
    ) {
        let dir = tempfile::tempdir().map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
        let model = serve::model(None, &Device::Cpu, dir.path()).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
        let trace = random_trace(shared, &requests);
        paged_trace_equals_alone(&model, blocks, &trace).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
    }
}

/// Requests of `(own prompt tokens, max_new, arrival step, sampled)`, each prompt starting with
/// the same `shared` tokens.
fn random_trace(shared: usize, requests: &[(usize, usize, usize, bool)]) -> Vec<(usize, Request)> {
    let prefix: Vec<u32> = (0..shared as u32).map(|t| (t * 19 + 5) % 251 + 1).collect();
    requests
        .iter()
        .enumerate()
        .map(|(i, &(own, max_new, at, sampled))| {
            let mut prompt = prefix.clone();
            prompt.extend((0..own as u32).map(|t| (t * 23 + i as u32 * 61) % 251 + 1));
            let sampling = match sampled {
                true => SampleParams {
                    temperature: 0.9,
                    top_k: 30,
                    top_p: 0.9,
                    seed: i as u64,
                    index: 0,
                },
                false => SampleParams::GREEDY,
            };
            let request = Request {
                id: i as u64,
                prompt,
                max_new,
                sampling,
            };
            (at, request)
        })
        .collect()
}

/// `trace` on an eager engine over a paged cache of `blocks` blocks gives every request the
/// tokens it gets alone on static rows.
fn paged_trace_equals_alone(
    model: &graft_candle_models::Decoder,
    blocks: usize,
    trace: &[(usize, Request)],
) -> serve::TestResult {
    let mut engine = serve::paged_engine(model, blocks, false)?;
    let out = serve::run(&mut engine, trace)?;
    for (_, r) in trace {
        assert_eq!(
            out[&r.id],
            serve::alone(model, r)?,
            "request {} over {blocks} blocks",
            r.id
        );
    }
    Ok(())
}
