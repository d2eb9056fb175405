//! The serving checks shared by the CPU tests (tests/serve.rs, in CI) and the GPU tests
//! (tests/gpu/serve.rs): requests that join and leave a continuous batch, prefilled in
//! padded chunks, produce the tokens of each request run alone, eagerly.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as ct;
use graft_candle::{Buckets, CandleGraft};
use graft_candle_models::serve::{
    Engine, Event, Refused, Rejected, Request, SampleParams, ServeConfig,
};
use graft_candle_models::{Decoder, checkpoint, llama, mistral};

pub(crate) type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Positions per sequence of the test caches.
pub(crate) const MAX_SEQ: usize = 64;

type Loader = dyn Fn(VarBuilder) -> candle_core::Result<Decoder>;

/// A small Llama (`window: None`) or Mistral with a sliding window of `window`, random
/// weights written to and loaded from `dir`.
pub(crate) fn model(window: Option<usize>, device: &Device, dir: &Path) -> TestResult<Decoder> {
    model_seeded(window, device, dir, 11)
}

/// [`model`] with the random weights of `seed` (another model of the same shapes and
/// vocabulary: a draft model).
pub(crate) fn model_seeded(
    window: Option<usize>,
    device: &Device,
    dir: &Path,
    seed: u64,
) -> TestResult<Decoder> {
    let base = r#""vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5"#;
    let (spec, load): (_, Box<Loader>) = match window {
        None => {
            let cfg: ct::llama::LlamaConfig = serde_json::from_str(&format!("{{{base}}}"))?;
            let cfg = cfg.into_config(false);
            (llama::spec(&cfg), Box::new(move |vb| llama::load(vb, &cfg)))
        }
        Some(w) => {
            let cfg: ct::mistral::Config = serde_json::from_str(&format!(
                "{{{base}, \"rope_theta\": 10000.0, \"sliding_window\": {w}, \"head_dim\": 16}}"
            ))?;
            (
                mistral::spec(&cfg),
                Box::new(move |vb| mistral::load(vb, &cfg)),
            )
        }
    };
    let weights = checkpoint::random_weights(&spec, seed, DType::F32, &Device::Cpu)?;
    let path = dir.join(format!("model-{seed}.safetensors"));
    checkpoint::write_safetensors(&weights, &path)?;
    // SAFETY: the file is this test's own, written above and never modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, device)? };
    Ok(load(vb)?)
}

pub(crate) fn config() -> TestResult<ServeConfig> {
    Ok(ServeConfig {
        decode_buckets: Buckets::new([1, 2, 4])?,
        prefill_buckets: Buckets::new([4, 8, 16])?,
        eos: Vec::new(),
        max_running: None,
        speculate: None,
    })
}

/// Requests whose prompts span one token to several chunks, arriving at staggered steps.
pub(crate) fn trace() -> Vec<(usize, Request)> {
    let lengths = [
        (5, 9),
        (1, 6),
        (23, 4),
        (16, 12),
        (3, 1),
        (40, 7),
        (9, 15),
        (2, 3),
    ];
    lengths
        .iter()
        .enumerate()
        .map(|(i, &(prompt, max_new))| {
            let prompt = (0..prompt)
                .map(|t| ((t * 37 + i * 11) % 251) as u32 + 1)
                .collect();
            let request = Request {
                id: i as u64,
                prompt,
                max_new,
                // Every other request samples, with a seed of its own.
                sampling: if i % 2 == 1 {
                    SampleParams {
                        temperature: 0.9,
                        top_k: 40,
                        top_p: 0.9,
                        seed: i as u64,
                        index: 0,
                    }
                } else {
                    SampleParams::GREEDY
                },
            };
            (i * 3 % 7 + i, request)
        })
        .collect()
}

/// Runs `requests` (each submitted at its step) to the end; every request's tokens.
pub(crate) fn run(
    engine: &mut Engine<'_>,
    requests: &[(usize, Request)],
) -> TestResult<HashMap<u64, Vec<u32>>> {
    Ok(run_counting(engine, requests)?.0)
}

/// [`run`], and the engine steps it took.
pub(crate) fn run_counting(
    engine: &mut Engine<'_>,
    requests: &[(usize, Request)],
) -> TestResult<(HashMap<u64, Vec<u32>>, usize)> {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut finished = 0;
    for step in 0.. {
        for (_, r) in requests.iter().filter(|(at, _)| *at == step) {
            engine.submit(r.clone())?;
        }
        for event in engine.step()? {
            match event {
                Event::Token { id, token, index } => {
                    let tokens = out.entry(id).or_default();
                    assert_eq!(tokens.len(), index, "request {id}'s tokens come in order");
                    tokens.push(token);
                }
                Event::Finished { .. } => finished += 1,
            }
        }
        if finished == requests.len() {
            return Ok((out, step + 1));
        }
        assert!(step < 10_000, "the engine never finished");
    }
    unreachable!("the loop returns or fails")
}

/// Each request of the trace alone, eagerly, from a fresh cache.
pub(crate) fn alone(model: &Decoder, request: &Request) -> TestResult<Vec<u32>> {
    let cache = model.new_serving_cache(1, MAX_SEQ)?;
    let config = ServeConfig {
        decode_buckets: Buckets::new([1])?,
        ..config()?
    };
    let mut engine = Engine::eager(model, cache, config)?;
    let out = run(&mut engine, &[(0, request.clone())])?;
    Ok(out.get(&request.id).cloned().unwrap_or_default())
}

/// The continuous batch under graft-candle (graphed on a CUDA device, padded everywhere)
/// and eagerly (unpadded) give every request the tokens it gets alone. `inspect` sees the
/// graphed engine after its run (the GPU test checks its recordings and replays).
pub(crate) fn batch_equals_alone(
    model: &Decoder,
    inspect: impl FnOnce(&Engine<'_>) -> TestResult,
) -> TestResult {
    let requests = trace();
    let graft = CandleGraft::new(model.device())?;
    let cache = model.new_serving_cache(4, MAX_SEQ)?;
    let mut graphed = Engine::graphed(model, cache, graft, config()?)?;
    graphed.capture()?;
    let batched = run(&mut graphed, &requests)?;
    let cache = model.new_serving_cache(4, MAX_SEQ)?;
    let mut eager = Engine::eager(model, cache, config()?)?;
    let eager_batched = run(&mut eager, &requests)?;
    for (_, r) in &requests {
        let want = alone(model, r)?;
        assert_eq!(want.len(), r.max_new, "request {} alone", r.id);
        assert_eq!(batched[&r.id], want, "request {} under graft-candle", r.id);
        assert_eq!(
            eager_batched[&r.id], want,
            "request {} in the eager batch",
            r.id
        );
    }
    inspect(&graphed)
}

/// Requests that can never be served come back with a typed reason; the others are
/// served as if they had not been sent.
pub(crate) fn bad_requests_are_refused_and_nothing_else_changes(model: &Decoder) -> TestResult {
    let cache = model.new_serving_cache(4, MAX_SEQ)?;
    let mut engine = Engine::graphed(model, cache, CandleGraft::new(model.device())?, config()?)?;
    let bad = [
        (
            Request {
                id: 100,
                prompt: vec![],
                max_new: 3,
                sampling: SampleParams::GREEDY,
            },
            "empty prompt",
        ),
        (
            Request {
                id: 101,
                prompt: vec![1],
                max_new: 0,
                sampling: SampleParams::GREEDY,
            },
            "0 new tokens",
        ),
        (
            Request {
                id: 102,
                prompt: vec![1; MAX_SEQ],
                max_new: 2,
                sampling: SampleParams::GREEDY,
            },
            "needs 65 positions",
        ),
        (
            Request {
                id: 103,
                prompt: vec![1],
                max_new: 2,
                sampling: SampleParams {
                    temperature: f32::NAN,
                    ..SampleParams::GREEDY
                },
            },
            "temperature NaN",
        ),
    ];
    for (request, message) in bad {
        let refused: Box<Refused> = engine.submit(request.clone()).unwrap_err();
        // Compared as text: a NaN temperature is not equal to itself.
        assert_eq!(
            format!("{:?}", refused.request),
            format!("{request:?}"),
            "the request comes back unchanged"
        );
        assert!(refused.to_string().contains(message), "{refused}");
        assert!(matches!(
            refused.why,
            Rejected::EmptyPrompt { .. }
                | Rejected::NothingToGenerate { .. }
                | Rejected::TooLong { .. }
                | Rejected::BadSampling { .. }
        ));
    }
    // Exactly full: a prompt of MAX_SEQ - 1 tokens and 2 new ones fits.
    let full = Request {
        id: 200,
        prompt: vec![3; MAX_SEQ - 1],
        max_new: 2,
        sampling: SampleParams::GREEDY,
    };
    let good = trace();
    let mut all = good.clone();
    all.push((0, full.clone()));
    let out = run(&mut engine, &all)?;
    for (_, r) in &all {
        assert_eq!(out[&r.id], alone(model, r)?, "request {}", r.id);
    }
    Ok(())
}

/// Each prompt's first `n` tokens by plain decoding (one decode step a token, alone in a cache
/// of its own), each picked by `sampling` at its own draw index.
pub(crate) fn plain_tokens(
    model: &Decoder,
    prompts: &[Vec<u32>],
    n: usize,
    sampling: SampleParams,
) -> TestResult<Vec<Vec<u32>>> {
    use graft_candle_kernels::sample_rows;
    let dev = model.device().clone();
    // Token number `index` of a request, picked from `logits` ([1, vocab]).
    let pick = |logits: Tensor, index: usize| -> TestResult<u32> {
        let words = SampleParams {
            index: index as u32,
            ..sampling
        }
        .words();
        let words = Tensor::new(&[words], &dev)?;
        Ok(sample_rows(&logits, &words)?.to_vec1::<u32>()?[0])
    };
    let mut want = Vec::new();
    for prompt in prompts {
        let plain = model.new_serving_cache(1, MAX_SEQ)?;
        let mut logits = None;
        for &t in prompt {
            logits = Some(model.forward(&plain, &Tensor::new(&[t], &dev)?)?);
        }
        let mut w = vec![pick(logits.ok_or("no prompt")?, 0)?];
        while w.len() < n {
            let last = *w.last().ok_or("no token")?;
            let logits = model.forward(&plain, &Tensor::new(&[last], &dev)?)?;
            w.push(pick(logits, w.len())?);
        }
        want.push(w);
    }
    Ok(want)
}

/// Speculative decoding gives plain decoding's tokens, greedy or sampled with the same seed and
/// draw indices, whatever the drafts: an oracle's (plain decoding's own tokens: every draft
/// accepted), wrong ones (none accepted), prompt lookup's and draft models'. Three sequences
/// of their own prompts verify together in each pass (`Decoder::verify_rows`, padded to 4
/// segments; the third takes one draft fewer), and one alone (`Decoder::verify`). With
/// `graft`, every verify pass goes through it.
pub(crate) fn speculation_equals_plain_decoding(
    model: &Decoder,
    mut graft: Option<&mut CandleGraft>,
    sampling: SampleParams,
) -> TestResult {
    use graft_candle_models::speculate::{DraftModel, DraftRow, VerifyRow, prompt_lookup};
    let dev = model.device().clone();
    // Prompts that repeat themselves, so that prompt lookup finds n-grams.
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..14 - 2 * s)
                .map(|i| [5, 17, 99, 3][i as usize % 4] + i / 8 + 7 * s)
                .collect()
        })
        .collect();
    // One draft a pass takes the decode step's chain of kernels where the decoder runs it
    // (two rows), four the prefill's blocks in f32.
    let (n, kmax) = (24, 4);
    let want = plain_tokens(model, &prompts, n + kmax, sampling)?;
    let step = graft
        .as_deref_mut()
        .map(|g| g.register_bucketed("verify", Buckets::new([1, 4]).expect("buckets")));
    // A draft model of other weights (its drafts mostly wrong), and the target drafting for
    // itself (greedy: every draft right).
    let dir = tempfile::tempdir()?;
    let window = model.spec().sliding_window;
    let other = model_seeded(window, &dev, dir.path(), 12)?;
    let vocab = model.spec().vocab;
    let refused = DraftModel::new(&other, vocab + 1, 3, MAX_SEQ)
        .expect_err("a draft of another vocabulary")
        .to_string();
    assert!(
        refused.contains(&format!(
            "a vocabulary of {vocab} tokens and the target {}",
            vocab + 1
        )),
        "{refused}"
    );
    // The draft models' rounds run their steps and the pass in one call.
    let drafters = [
        "oracle",
        "wrong",
        "prompt lookup",
        "draft model",
        "self draft",
        "draft rounds",
        "self rounds",
    ];
    let round_step = graft
        .as_deref_mut()
        .map(|g| g.register_bucketed("round", Buckets::new([1, 4]).expect("buckets")));
    for (k, drafter, batch) in [1, kmax]
        .into_iter()
        .flat_map(|k| drafters.map(|d| (k, d)))
        .flat_map(|(k, d)| [(k, d, 1), (k, d, 3)])
    {
        let mut draft_model = match drafter {
            "draft model" | "draft rounds" => Some(DraftModel::new(&other, vocab, 3, MAX_SEQ)?),
            "self draft" | "self rounds" => Some(DraftModel::new(model, vocab, 3, MAX_SEQ)?),
            _ => None,
        };
        let rounds = drafter.ends_with("rounds");
        let cache = model.new_serving_cache(3, MAX_SEQ)?;
        for (row, prompt) in prompts.iter().enumerate().take(batch) {
            cache.set_position(row, 0)?;
            let before = &prompt[..prompt.len() - 1];
            let chunk = Tensor::new(before, &dev)?;
            model.prefill_forward(&cache, row, &chunk, before.len(), SampleParams::GREEDY)?;
        }
        let mut history: Vec<Vec<u32>> = prompts[..batch].to_vec();
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); batch];
        while got.iter().any(|g| g.len() < n) {
            // The sequences not done yet, each with its tokens for the pass.
            let active: Vec<usize> = (0..batch).filter(|&row| got[row].len() < n).collect();
            let mut tokens = Vec::with_capacity(active.len());
            for &row in &active {
                // The third sequence takes a draft fewer: the pass pads it.
                let k = if row == 2 { k - 1 } else { k };
                let at = got[row].len();
                let drafts: Vec<u32> = match drafter {
                    "oracle" => want[row][at..at + k].to_vec(),
                    "wrong" => want[row][at..at + k].iter().map(|t| t ^ 1).collect(),
                    // Drafted on the device: the pass needs only their count.
                    _ if rounds => vec![0; k],
                    _ => match draft_model.as_mut() {
                        Some(d) => d.propose(row, &history[row], k)?,
                        None => prompt_lookup(&history[row], 3, k),
                    },
                };
                let last = *history[row].last().ok_or("no history")?;
                tokens.push([&[last][..], &drafts].concat());
            }
            let rows: Vec<VerifyRow<'_>> = active
                .iter()
                .zip(&tokens)
                .map(|(&row, t)| VerifyRow {
                    row,
                    tokens: t,
                    sampling: SampleParams {
                        index: got[row].len() as u32,
                        ..sampling
                    },
                })
                .collect();
            if let (true, Some(d)) = (rounds, draft_model.as_mut()) {
                let rows: Vec<DraftRow<'_>> = rows
                    .iter()
                    .map(|r| DraftRow {
                        row: r.row,
                        history: &history[r.row],
                        drafts: r.tokens.len() - 1,
                        sampling: r.sampling,
                    })
                    .collect();
                let segments = if batch == 1 { 1 } else { 4 };
                let passes = match (graft.as_deref_mut(), round_step) {
                    (Some(g), Some(step)) => {
                        d.round(g, step, model, &cache, &rows, (segments, k + 1))?
                            .rows
                    }
                    _ => d.round_forward(model, &cache, &rows, (rows.len(), k + 1))?,
                };
                for (v, r) in passes.iter().zip(&rows) {
                    if drafter == "self rounds" && sampling == SampleParams::GREEDY {
                        assert_eq!(
                            v.accepted, r.drafts,
                            "the target's own greedy drafts are plain greedy decoding's"
                        );
                    }
                    got[r.row].extend(v.tokens());
                }
                for &row in &active {
                    let from = history[row].len() - prompts[row].len();
                    history[row].extend_from_slice(&got[row][from..]);
                    assert_eq!(
                        cache.positions()[row] as usize,
                        history[row].len() - 1,
                        "{drafter}: the position follows the accepted tokens"
                    );
                }
                continue;
            }
            let passes = match (graft.as_deref_mut(), step, batch) {
                (Some(g), Some(step), 1) => {
                    vec![model.verify(g, step, &cache, 0, &tokens[0], rows[0].sampling)?]
                }
                (Some(g), Some(step), _) => {
                    model.verify_rows(g, step, &cache, &rows, (4, k + 1))?.rows
                }
                (_, _, 1) => vec![model.verify_forward(&cache, 0, &tokens[0], rows[0].sampling)?],
                _ => model.verify_rows_forward(&cache, &rows, (rows.len(), k + 1))?,
            };
            for (v, r) in passes.iter().zip(&rows) {
                let (row, drafts) = (r.row, r.tokens.len() - 1);
                match drafter {
                    "oracle" => assert_eq!(
                        v.accepted, drafts,
                        "the oracle's drafts are plain decoding's"
                    ),
                    "wrong" => assert_eq!(v.accepted, 0, "no wrong draft is accepted"),
                    "self draft" if sampling == SampleParams::GREEDY => assert_eq!(
                        v.accepted, drafts,
                        "the target's own greedy drafts are plain greedy decoding's"
                    ),
                    _ => {}
                }
                got[row].extend(v.tokens());
                history[row].extend(v.tokens());
                assert_eq!(
                    cache.positions()[row] as usize,
                    history[row].len() - 1,
                    "{drafter}: the position follows the accepted tokens"
                );
            }
        }
        for row in 0..batch {
            assert_eq!(
                got[row][..n],
                want[row][..n],
                "{drafter}, {k} drafts a pass, sequence {row} of {batch}: speculative against plain decoding"
            );
        }
    }
    Ok(())
}

/// Speculation in the engine (prompt lookup while a sequence runs alone) changes no request's
/// tokens, greedy or sampled, alone or in a continuous batch, eagerly and under graft, and
/// never takes more steps. Drafts are free here and trusted at first (every pass verifies 4
/// until acceptance says otherwise), so the verify passes run with drafts whatever the model
/// makes. `graphed` makes the graphed engine's graft.
pub(crate) fn speculation_changes_no_token(
    model: &Decoder,
    graphed: impl Fn() -> TestResult<CandleGraft>,
) -> TestResult {
    use graft_candle_models::serve::Speculate;
    let sampled = SampleParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 77,
        index: 0,
    };
    let dir = tempfile::tempdir()?;
    let other = model_seeded(model.spec().sliding_window, model.device(), dir.path(), 12)?;
    // A prompt that repeats itself, so that prompt lookup finds n-grams.
    let prompt: Vec<u32> = (0..24u32)
        .map(|i| [5, 17, 99, 3, 42, 8][i as usize % 6])
        .collect();
    let lone = |sampling| {
        vec![(
            0,
            Request {
                id: 1,
                prompt: prompt.clone(),
                max_new: 20,
                sampling,
            },
        )]
    };
    for sampling in [SampleParams::GREEDY, sampled] {
        // A lone request (it speculates at every step), then the trace (it speculates when one
        // sequence is left).
        let mut batch = trace();
        for (_, r) in &mut batch {
            r.sampling = sampling;
        }
        for requests in [lone(sampling), batch] {
            let off = config()?;
            let on = ServeConfig {
                speculate: Some(Speculate {
                    pass_costs: vec![1.0],
                    prior: 1.0,
                    ..Speculate::prompt_lookup(4)
                }),
                ..config()?
            };
            let run_with = |config: ServeConfig,
                            graft: Option<CandleGraft>,
                            draft: Option<&Decoder>,
                            paged: bool|
             -> TestResult<_> {
                let cache = match paged {
                    // Blocks of 4 positions: most passes have fewer drafts' room.
                    true => model.new_paged_cache(4, MAX_SEQ, 64, 4)?,
                    false => model.new_serving_cache(4, MAX_SEQ)?,
                };
                let mut engine = match graft {
                    Some(g) => Engine::graphed(model, cache, g, config)?,
                    None => Engine::eager(model, cache, config)?,
                };
                if let Some(d) = draft {
                    engine.draft_with(d)?;
                }
                // Graphed, every pass is recorded before the requests come (on a GPU).
                engine.capture()?;
                let recorded = |e: &Engine<'_>| {
                    e.graft()
                        .and_then(|g| g.graft())
                        .map(|g| g.stats().recordings)
                };
                let before = recorded(&engine);
                let (out, steps) = run_counting(&mut engine, &requests)?;
                assert_eq!(
                    recorded(&engine),
                    before,
                    "a pass recorded while serving: capture records them all"
                );
                for (_, r) in &requests {
                    assert_eq!(
                        out[&r.id].len(),
                        r.max_new,
                        "request {}'s token count",
                        r.id
                    );
                }
                Ok((out, steps))
            };
            let (want, plain_steps) = run_with(off, None, None, false)?;
            let (eager, eager_steps) = run_with(on.clone(), None, None, false)?;
            assert_eq!(eager, want, "speculating eagerly, {sampling:?}");
            let (graphed_out, _) = run_with(on.clone(), Some(graphed()?), None, false)?;
            assert_eq!(graphed_out, want, "speculating under graft, {sampling:?}");
            // On a paged cache, eagerly and under graft, drafts limited to the last block.
            let (paged, _) = run_with(on.clone(), None, None, true)?;
            assert_eq!(paged, want, "speculating on pages, {sampling:?}");
            let (paged, _) = run_with(on.clone(), Some(graphed()?), Some(model), true)?;
            assert_eq!(
                paged, want,
                "self-drafting on pages under graft, {sampling:?}"
            );
            // Drafts from a draft model: another's (mostly wrong), and the target's own.
            for draft in [&other, model] {
                let (drafted, steps) = run_with(on.clone(), None, Some(draft), false)?;
                assert_eq!(
                    drafted, want,
                    "a draft model's drafts, eagerly, {sampling:?}"
                );
                if std::ptr::eq(draft, model) && sampling == SampleParams::GREEDY {
                    assert!(
                        steps < plain_steps,
                        "the target drafting for itself takes {steps} steps, plain decoding {plain_steps}"
                    );
                }
                let (drafted, _) = run_with(on.clone(), Some(graphed()?), Some(draft), false)?;
                assert_eq!(
                    drafted, want,
                    "a draft model's drafts, under graft, {sampling:?}"
                );
            }
            assert!(
                eager_steps <= plain_steps,
                "speculating takes {eager_steps} steps, plain decoding {plain_steps}"
            );
        }
    }
    Ok(())
}

/// Positions per block of the paged test caches.
const BLOCK: usize = 4;

/// An engine over a paged cache of `blocks` blocks for 4 sequences, graphed under
/// graft-candle (`graphed`, recorded first) or eager.
pub(crate) fn paged_engine(
    model: &Decoder,
    blocks: usize,
    graphed: bool,
) -> TestResult<Engine<'_>> {
    let cache = model.new_paged_cache(4, MAX_SEQ, blocks, BLOCK)?;
    Ok(if graphed {
        let mut engine =
            Engine::graphed(model, cache, CandleGraft::new(model.device())?, config()?)?;
        engine.capture()?;
        engine
    } else {
        Engine::eager(model, cache, config()?)?
    })
}

/// On a paged cache the engine gives every request the tokens it gets alone on static rows,
/// graphed and eager: with blocks to spare; with so few that sequences are preempted and
/// prefilled again (the longest request still fits alone); and with prompts that share a
/// prefix, whose cached blocks later prompts take instead of prefilling them.
pub(crate) fn paged_equals_static(model: &Decoder) -> TestResult {
    // Four prompts of 2 blocks that grow to 7 blocks each, all at once, over 12 blocks:
    // admitted together, they run out as they grow.
    let growing: Vec<(usize, Request)> = trace()
        .into_iter()
        .take(4)
        .map(|(_, r)| {
            let prompt = (0..6)
                .map(|t| (t * 17 + r.id as u32 * 5) % 251 + 1)
                .collect();
            (
                0,
                Request {
                    prompt,
                    max_new: 20,
                    ..r
                },
            )
        })
        .collect();
    for (requests, blocks, preempts) in [(trace(), 64, false), (growing, 12, true)] {
        for graphed in [true, false] {
            let mut engine = paged_engine(model, blocks, graphed)?;
            let out = run(&mut engine, &requests)?;
            for (_, r) in &requests {
                assert_eq!(
                    out[&r.id],
                    alone(model, r)?,
                    "request {} over {blocks} blocks, graphed: {graphed}",
                    r.id
                );
            }
            let n = engine.preemptions();
            assert_eq!(n > 0, preempts, "{blocks} blocks: {n} preemptions");
        }
    }
    // Eight prompts of one 26-token prefix (6 full blocks) and suffixes of their own.
    let prefix: Vec<u32> = (0..26u32).map(|t| (t * 29 + 7) % 251 + 1).collect();
    let shared: Vec<(usize, Request)> = (0..8u64)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend((0..1 + i as u32 % 5).map(|t| (t * 13 + i as u32 * 41) % 251 + 1));
            // The first alone, then three one after another, then four together (their
            // suffixes prefilled in one launch).
            let at = match i {
                0 => 0,
                1..=3 => 12 + i as usize,
                _ => 20,
            };
            let request = Request {
                id: i,
                prompt,
                max_new: 6,
                sampling: SampleParams::GREEDY,
            };
            (at, request)
        })
        .collect();
    for graphed in [true, false] {
        let mut engine = paged_engine(model, 64, graphed)?;
        let out = run(&mut engine, &shared)?;
        for (_, r) in &shared {
            assert_eq!(
                out[&r.id],
                alone(model, r)?,
                "shared-prefix request {}",
                r.id
            );
        }
        // The seven later prompts each take the 24 tokens of the prefix's 6 full blocks.
        assert_eq!(engine.cached_tokens(), 7 * 24, "graphed: {graphed}");
    }
    Ok(())
}

/// A paged cache refuses what it cannot serve: a request longer than all its blocks, blocks
/// it does not have, a step or prefill past a sequence's blocks.
pub(crate) fn paged_misuse_is_refused(model: &Decoder) -> TestResult {
    let mut engine = paged_engine(model, 8, false)?;
    let long = Request {
        id: 1,
        prompt: vec![1; 30],
        max_new: 4,
        sampling: SampleParams::GREEDY,
    };
    let refused = engine.submit(long).unwrap_err();
    assert!(
        matches!(
            refused.why,
            Rejected::MoreThanTheCache {
                needed: 9,
                blocks: 8,
                ..
            }
        ),
        "{refused}"
    );
    let cache = model.new_paged_cache(2, MAX_SEQ, 8, BLOCK)?;
    let bad_block = cache.set_blocks(0, &[8]).unwrap_err().to_string();
    assert!(bad_block.contains("names block 8"), "{bad_block}");
    cache.set_blocks(0, &[3])?;
    let tokens = Tensor::new(&[5u32], model.device())?;
    for _ in 0..BLOCK {
        model.forward(&cache, &tokens)?;
    }
    let past = model.forward(&cache, &tokens).unwrap_err().to_string();
    assert!(past.contains("has blocks for 4 positions"), "{past}");
    let static_rows = model.new_serving_cache(1, MAX_SEQ)?;
    assert!(static_rows.set_blocks(0, &[0]).is_err());
    // Fewer positions than the largest prefill bucket (16): refused when the engine is made.
    let small = model.new_paged_cache(4, MAX_SEQ, 3, BLOCK)?;
    let e = Engine::eager(model, small, config()?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 blocks of 4 positions"), "{e}");
    Ok(())
}

/// One prefill launch of several sequences' chunks (`Decoder::prefill_segments_forward`) picks
/// the tokens and writes the keys and values that a launch per sequence does, on static rows
/// and on pages (each row's blocks strided over the cache).
pub(crate) fn segments_equal_separate_launches(model: &Decoder) -> TestResult {
    use graft_candle_models::PrefillSegment;
    let prompts: [Vec<u32>; 3] = [
        (0..9u32).map(|t| (t * 31 + 3) % 251 + 1).collect(),
        (0..4u32).map(|t| (t * 7 + 90) % 251 + 1).collect(),
        (0..12u32).map(|t| (t * 11 + 40) % 251 + 1).collect(),
    ];
    let sampled = SampleParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        seed: 5,
        index: 3,
    };
    let samplings = [SampleParams::GREEDY, sampled, SampleParams::GREEDY];
    for paged in [false, true] {
        let cache = |rows| -> TestResult<_> {
            Ok(match paged {
                true => {
                    let c = model.new_paged_cache(rows, MAX_SEQ, 48, 4)?;
                    for r in 0..rows {
                        let blocks: Vec<u32> = (0..16).map(|j| (j * rows + r) as u32).collect();
                        c.set_blocks(r, &blocks)?;
                    }
                    c
                }
                false => model.new_serving_cache(rows, MAX_SEQ)?,
            })
        };
        // One launch per sequence.
        let separate = cache(3)?;
        let mut want = Vec::new();
        for (row, (prompt, &sampling)) in prompts.iter().zip(&samplings).enumerate() {
            let tokens = Tensor::new(prompt.as_slice(), model.device())?;
            let next = model.prefill_forward(&separate, row, &tokens, prompt.len(), sampling)?;
            want.push(next.to_vec1::<u32>()?[0]);
        }
        // One launch of all three, padded.
        let together = cache(3)?;
        let mut all: Vec<u32> = prompts.concat();
        all.resize(32, 0);
        let tokens = Tensor::new(all.as_slice(), model.device())?;
        let segments: Vec<PrefillSegment> = prompts
            .iter()
            .zip(&samplings)
            .enumerate()
            .map(|(row, (p, &sampling))| PrefillSegment {
                row,
                len: p.len(),
                sampling,
            })
            .collect();
        let got = model
            .prefill_segments_forward(&together, &segments, &tokens)?
            .to_vec1::<u32>()?;
        assert_eq!(got, want, "paged: {paged}");
        assert_eq!(together.positions(), separate.positions());
        assert_eq!(together.device_positions()?, [9, 4, 12]);
        // The same keys and values in every row or block but the scratch one (where the
        // padding goes), up to the rounding of projections over other row counts (f32).
        let layers = model.spec().layers;
        for (a, b) in together
            .tensors()
            .iter()
            .zip(separate.tensors())
            .take(2 * layers)
        {
            let rows = a.dim(0)? - 1;
            let (a, b) = (a.narrow(0, 0, rows)?, b.narrow(0, 0, rows)?);
            let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(scale > 0.0, "paged: {paged}: nothing written");
            assert!(
                diff <= 1e-4 * scale,
                "paged: {paged}: {diff} apart (scale {scale})"
            );
        }
        // Two segments of one row are refused.
        let twice = [segments[0], segments[0]];
        assert!(
            model
                .prefill_segments_forward(&together, &twice, &tokens)
                .is_err()
        );
    }
    Ok(())
}
