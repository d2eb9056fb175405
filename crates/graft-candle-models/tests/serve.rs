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

/// Speculative decoding (verify passes over the last token and k drafts of one sequence or of
/// three) gives plain decoding's tokens, greedy and sampled with the same seed, with every
/// draft accepted, none, prompt lookup's or draft models'; eagerly and through graft.
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
        let v = model.verify_forward(&cache, 0, &[last, d], sampling)?;
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

/// Verify passes and rounds refuse what they cannot run, with a message that says what to do,
/// and change nothing (the row's position stays).
#[test]
fn speculation_refuses_what_it_cannot_verify() -> serve::TestResult {
    use graft_candle_models::speculate::{DraftModel, DraftRow, VerifyRow};
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    let cache = model.new_serving_cache(2, serve::MAX_SEQ)?;
    let prompt = [5u32, 17, 99, 3];
    model.prefill_forward(
        &cache,
        0,
        &Tensor::new(&prompt[..3], &Device::Cpu)?,
        3,
        SampleParams::GREEDY,
    )?;
    let row = |row, tokens| VerifyRow {
        row,
        tokens,
        sampling: SampleParams::GREEDY,
    };
    let refused = |r: candle_core::Result<Vec<graft_candle_models::speculate::Verified>>| {
        r.expect_err("refused").to_string()
    };
    let cases: [(Vec<VerifyRow<'_>>, (usize, usize), &str); 5] = [
        (vec![], (1, 2), "pass 1 to 1 sequences"),
        (
            vec![row(0, &[3, 1]), row(1, &[4])],
            (1, 2),
            "pass 1 to 1 sequences",
        ),
        (vec![row(0, &[3, 1, 2])], (1, 2), "of at most 2 tokens"),
        (vec![row(0, &[])], (1, 2), "no tokens for cache row 0"),
        (
            vec![row(0, &[3]), row(0, &[3])],
            (2, 1),
            "two sequences of one verify pass",
        ),
    ];
    for (rows, shape, want) in cases {
        let got = refused(model.verify_rows_forward(&cache, &rows, shape));
        assert!(got.contains(want), "{got}");
    }
    let far = [9u32; serve::MAX_SEQ];
    let got = refused(model.verify_rows_forward(&cache, &[row(0, &far)], (1, serve::MAX_SEQ)));
    assert!(got.contains("overflows the kv cache"), "{got}");
    assert_eq!(
        cache.positions()[0],
        3,
        "a refused pass changes no position"
    );

    let mut draft = DraftModel::new(&model, model.spec().vocab, 2, serve::MAX_SEQ)?;
    let sampling = SampleParams::GREEDY;
    let round = |draft: &mut DraftModel<'_>, history: &[u32], drafts, shape| {
        let rows = [DraftRow {
            row: 0,
            history,
            drafts,
            sampling,
        }];
        draft
            .round_forward(&model, &cache, &rows, shape)
            .expect_err("refused")
            .to_string()
    };
    for (history, drafts, shape, want) in [
        (&prompt[..], 1, (1, 1), "a width of at least 2"),
        (&prompt[..], 2, (1, 2), "at most width - 1 drafts"),
        (&prompt[..1], 1, (1, 2), "a round needs two tokens"),
        (&prompt[..3], 1, (1, 2), "pass the sequence's whole history"),
    ] {
        let got = round(&mut draft, history, drafts, shape);
        assert!(got.contains(want), "{got}");
    }
    let mut small = DraftModel::new(&model, model.spec().vocab, 1, 5)?;
    let got = round(&mut small, &prompt, 2, (1, 3));
    assert!(got.contains("drafts past the draft's cache"), "{got}");
    assert_eq!(
        cache.positions()[0],
        3,
        "a refused round changes no position"
    );
    Ok(())
}

/// A round drafts as wide for every sequence as for the one with the most drafts, in the draft
/// model's cache too: a sequence about to fill its row (no drafts of its own) beside one that
/// drafts still gets its tokens, as alone.
#[test]
fn a_round_beside_a_sequence_at_the_end_of_its_row_gives_both_their_tokens() -> serve::TestResult {
    use graft_candle_models::serve::{Engine, ServeConfig, Speculate};
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    let request = |id: u64, prompt: usize, max_new| Request {
        id,
        prompt: (0..prompt as u32)
            .map(|t| (t * 7 + id as u32) % 97 + 1)
            .collect(),
        max_new,
        sampling: SampleParams::GREEDY,
    };
    // The first fills its row of 64 positions exactly; the second drafts beside it.
    let requests = [(0, request(1, 30, 35)), (0, request(2, 5, 40))];
    let config = ServeConfig {
        speculate: Some(Speculate {
            pass_costs: vec![1.0],
            prior: 1.0,
            ..Speculate::prompt_lookup(4)
        }),
        ..serve::config()?
    };
    let cache = model.new_serving_cache(4, serve::MAX_SEQ)?;
    let mut engine = Engine::eager(&model, cache, config)?;
    engine.draft_with(&model)?;
    let out = serve::run(&mut engine, &requests)?;
    for (_, r) in &requests {
        assert_eq!(out[&r.id], serve::alone(&model, r)?, "request {}", r.id);
    }
    Ok(())
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

    /// Verify passes of three sequences with random draft counts and random points where the
    /// drafts turn wrong (some sequences sitting a pass out) accept exactly the right drafts,
    /// emit plain decoding's tokens, and leave each cache row's position where a host model
    /// of the cache (its tokens so far) says.
    #[test]
    fn random_accepts_and_rejects_follow_a_host_model_of_the_cache(
        passes in proptest::collection::vec(
            proptest::collection::vec((0usize..=4, 0usize..=4, proptest::bool::weighted(0.8)), 3),
            1..8,
        ),
        paged in proptest::bool::ANY,
    ) {
        let fail = |e: Box<dyn std::error::Error>| proptest::test_runner::TestCaseError::fail(e.to_string());
        let dir = tempfile::tempdir().map_err(|e| fail(e.into()))?;
        let model = serve::model(None, &Device::Cpu, dir.path()).map_err(fail)?;
        accepts_follow_a_host_model(&model, &passes, paged).map_err(fail)?;
    }
}

/// The body of `random_accepts_and_rejects_follow_a_host_model_of_the_cache`: each pass gives
/// each sequence `(k, right, takes part)`: k drafts, the first `right` of them (at most k)
/// plain decoding's next tokens and the rest wrong.
fn accepts_follow_a_host_model(
    model: &graft_candle_models::Decoder,
    passes: &[Vec<(usize, usize, bool)>],
    paged: bool,
) -> serve::TestResult {
    use graft_candle_models::speculate::VerifyRow;
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..5 + 3 * s).map(|i| (i * 29 + s * 7) % 251 + 1).collect())
        .collect();
    let want = serve::plain_tokens(model, &prompts, 5 * passes.len() + 1, SampleParams::GREEDY)?;
    let cache = match paged {
        // Blocks of 4, each sequence given enough in a shuffled order.
        true => {
            let cache = model.new_paged_cache(3, serve::MAX_SEQ, 3 * 16, 4)?;
            for row in 0..3u32 {
                let ids: Vec<u32> = (0..16).map(|i| i * 3 + (row + i) % 3).collect();
                cache.set_blocks(row as usize, &ids)?;
            }
            cache
        }
        false => model.new_serving_cache(3, serve::MAX_SEQ)?,
    };
    for (row, prompt) in prompts.iter().enumerate() {
        let before = &prompt[..prompt.len() - 1];
        let chunk = Tensor::new(before, &Device::Cpu)?;
        model.prefill_forward(&cache, row, &chunk, before.len(), SampleParams::GREEDY)?;
    }
    // The host model: each sequence's tokens so far (its last one at its row's position).
    let mut history = prompts.clone();
    let mut made = [0usize; 3];
    for pass in passes {
        let mut tokens = Vec::new();
        let mut expected = Vec::new();
        for (row, &(k, right, takes_part)) in pass.iter().enumerate() {
            if !takes_part {
                continue;
            }
            let right = right.min(k);
            let next = &want[row][made[row]..];
            let drafts: Vec<u32> = (0..k)
                .map(|j| if j < right { next[j] } else { next[j] ^ 1 })
                .collect();
            tokens.push((
                row,
                [&history[row][history[row].len() - 1..], &drafts].concat(),
            ));
            expected.push(right);
        }
        if tokens.is_empty() {
            continue;
        }
        let rows: Vec<VerifyRow<'_>> = tokens
            .iter()
            .map(|(row, t)| VerifyRow {
                row: *row,
                tokens: t,
                sampling: SampleParams {
                    index: made[*row] as u32,
                    ..SampleParams::GREEDY
                },
            })
            .collect();
        let width = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(1);
        let done = model.verify_rows_forward(&cache, &rows, (3, width))?;
        for ((v, r), &right) in done.iter().zip(&rows).zip(&expected) {
            assert_eq!(v.accepted, right, "row {}: the accepted drafts", r.row);
            let n = v.tokens().len();
            assert_eq!(
                v.tokens(),
                &want[r.row][made[r.row]..made[r.row] + n],
                "row {}: the pass's tokens",
                r.row
            );
            history[r.row].extend(v.tokens());
            made[r.row] += n;
        }
        let positions = cache.positions();
        for row in 0..3 {
            assert_eq!(
                positions[row] as usize,
                history[row].len() - 1,
                "row {row}: the position the host model gives"
            );
        }
        assert_eq!(
            cache.device_positions()?,
            positions,
            "the device's positions and the host's"
        );
    }
    Ok(())
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
/// tokens it gets alone on static rows. Returns the preemptions it took.
fn paged_trace_equals_alone(
    model: &graft_candle_models::Decoder,
    blocks: usize,
    trace: &[(usize, Request)],
) -> serve::TestResult<usize> {
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
    Ok(engine.preemptions())
}

/// On the CPU a decode step gives a row the same logits, bit for bit, in a batch of any size up
/// to 16: the batching tests' oracle (a request alone) is exact there. (From 3 rows f32 took
/// the per-op path, not the decode chain of 1 and 2, and its bits differed.)
#[test]
fn a_decode_step_gives_a_row_the_same_bits_in_every_batch() -> serve::TestResult {
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    let row0 = |batch: usize| -> serve::TestResult<Vec<Vec<f32>>> {
        let cache = model.new_serving_cache(batch, serve::MAX_SEQ)?;
        (0..6u32)
            .map(|step| {
                let tokens: Vec<u32> = (0..batch as u32)
                    .map(|r| (step * 31 + r * 17 + 3) % 251)
                    .collect();
                let logits =
                    model.forward(&cache, &Tensor::new(tokens.as_slice(), &Device::Cpu)?)?;
                Ok(logits.get(0)?.to_vec1::<f32>()?)
            })
            .collect()
    };
    let alone = row0(1)?;
    for batch in [2, 3, 4, 8, 16] {
        assert!(row0(batch)? == alone, "row 0 of a batch of {batch}");
    }
    Ok(())
}

/// Traces the property test below found on which a request got other tokens than alone:
/// - request 1 (sampled) decoding beside others: f32 projections of 3 rows took candle's
///   matmul, whose sums for a row change with the row count, and flipped its sixth draw (see
///   `a_decode_step_gives_a_row_the_same_bits_in_every_batch`);
/// - request 2 preempted part way through its prefill: the blocks its prefill never wrote
///   were cached (their tokens were known at admission), so when it came back it shared them
///   and sampled from what they held (its first token already differed).
#[test]
fn traces_found_give_every_request_its_tokens_alone() -> serve::TestResult {
    type Requests<'a> = &'a [(usize, usize, usize, bool)];
    let dir = tempfile::tempdir()?;
    let model = serve::model(None, &Device::Cpu, dir.path())?;
    // (blocks, shared prefix, requests, whether it preempts)
    let found: [(usize, usize, Requests<'_>, bool); 2] = [
        (
            19,
            2,
            &[
                (1, 1, 0, false),
                (22, 6, 1, true),
                (16, 6, 0, false),
                (12, 10, 4, true),
            ],
            false,
        ),
        (
            21,
            7,
            &[
                (5, 7, 2, false),
                (20, 12, 3, true),
                (22, 13, 6, true),
                (5, 12, 2, false),
                (14, 9, 7, false),
            ],
            true,
        ),
    ];
    for (blocks, shared, requests, preempts) in found {
        let preemptions =
            paged_trace_equals_alone(&model, blocks, &random_trace(shared, requests))?;
        assert_eq!(
            preemptions > 0,
            preempts,
            "preemptions over {blocks} blocks"
        );
    }
    Ok(())
}
