//! The server over HTTP, as a client sees it (in CI on the CPU): a random tiny model directory
//! written by the test, the server on a free port, reqwest streaming and checking text, token
//! counts, seeds, stop strings, errors, disconnects, a full queue and a draining shutdown.

use std::time::Duration;

use candle_core::{DType, Device};
use futures_util::StreamExt;
use graft_serve::random_model::{Preset, write_random_model};
use graft_serve::{ServeOptions, Server};
use serde_json::{Value, json};
use tokio::sync::oneshot;

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Positions per sequence of the test server.
const MAX_SEQ: usize = 128;

/// A running server and what stops it.
struct Running {
    base: String,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<Result<(), graft_serve::ServeError>>,
    _dir: tempfile::TempDir,
}

impl Running {
    /// Stops it (letting requests in flight finish) and waits for it.
    async fn stop(mut self) -> TestResult {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.done.await??;
        Ok(())
    }
}

async fn start(max_batch: usize, max_queue: usize) -> TestResult<Running> {
    start_with(max_batch, max_queue, MAX_SEQ).await
}

async fn start_with(max_batch: usize, max_queue: usize, max_seq: usize) -> TestResult<Running> {
    let (server, dir) =
        tokio::task::spawn_blocking(move || made(max_batch, max_queue, max_seq)).await??;
    served(server, dir).await
}

/// A server over a random tiny model written into a new directory (returned with it).
fn made(
    max_batch: usize,
    max_queue: usize,
    max_seq: usize,
) -> TestResult<(Server, tempfile::TempDir)> {
    made_speculating(max_batch, max_queue, max_seq, None)
}

/// [`made`], speculating with up to `speculate` drafts a pass.
fn made_speculating(
    max_batch: usize,
    max_queue: usize,
    max_seq: usize,
    speculate: Option<usize>,
) -> TestResult<(Server, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("tiny");
    write_random_model(&model, Preset::Tiny, DType::F32, 5)?;
    let options = ServeOptions {
        model,
        dtype: Some(DType::F32),
        max_seq: Some(max_seq),
        max_batch: Some(max_batch),
        max_queue,
        eager: false,
        speculate,
    };
    Ok((Server::start(&options, &Device::Cpu)?, dir))
}

/// `server` serving on a free port.
async fn served(server: Server, dir: tempfile::TempDir) -> TestResult<Running> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = oneshot::channel::<()>();
    let done = tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));
    Ok(Running {
        base,
        stop: Some(stop),
        done,
        _dir: dir,
    })
}

async fn post(base: &str, path: &str, body: &Value) -> TestResult<(u16, Value)> {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await?))
}

/// A streamed response's events (the JSON chunks) and whether it ended with `[DONE]`.
async fn stream(base: &str, path: &str, body: &Value) -> TestResult<(Vec<Value>, bool)> {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    assert_eq!(status, 200, "a stream starts with 200: {text}");
    let mut events = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
        } else {
            assert!(!done, "nothing after [DONE]");
            events.push(serde_json::from_str(data)?);
        }
    }
    Ok((events, done))
}

fn text_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["text"].as_str().or(c["delta"]["content"].as_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whole_and_streamed_gives_the_same_text_and_counts() -> TestResult {
    let s = start(4, 8).await?;
    let body = json!({"prompt": "hello graft", "max_tokens": 12, "temperature": 0});
    let (status, whole) = post(&s.base, "/v1/completions", &body).await?;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    let choice = &whole["choices"][0];
    let usage = &whole["usage"];
    assert_eq!(usage["prompt_tokens"], 11, "one token per byte");
    let generated = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&generated));
    let reason = choice["finish_reason"].as_str().unwrap();
    assert_eq!(reason == "length", generated == 12, "{whole}");
    assert_eq!(usage["total_tokens"], 11 + generated);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (chunks, done) = stream(&s.base, "/v1/completions", &streamed).await?;
    assert!(done, "the stream ends with [DONE]");
    assert_eq!(text_of(&chunks), choice["text"].as_str().unwrap());
    let last = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(last["finish_reason"], reason);
    assert_eq!(chunks.last().unwrap()["usage"], *usage);

    // Greedy equals top_k = 1 at any temperature: the sampler's two ways to the argmax.
    let (_, k1) = post(
        &s.base,
        "/v1/completions",
        &json!({"prompt": "hello graft", "max_tokens": 12, "temperature": 1.5, "top_k": 1}),
    )
    .await?;
    assert_eq!(k1["choices"][0]["text"], choice["text"]);
    s.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_gives_the_same_text_alone_and_beside_other_requests() -> TestResult {
    let s = start(4, 8).await?;
    let ask = |seed: u64| json!({"prompt": "once upon", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": seed});
    let (_, alone) = post(&s.base, "/v1/completions", &ask(7)).await?;
    let text = alone["choices"][0]["text"].clone();
    // The same seed among three others running at once.
    let mut all = Vec::new();
    for seed in [1, 7, 2, 3] {
        let base = s.base.clone();
        let body = ask(seed);
        all.push(tokio::spawn(async move {
            post(&base, "/v1/completions", &body).await
        }));
    }
    let mut texts = Vec::new();
    for a in all {
        texts.push(a.await??.1["choices"][0]["text"].clone());
    }
    assert_eq!(texts[1], text, "seed 7 beside others");
    assert!(
        texts.iter().filter(|t| **t != text).count() >= 2,
        "other seeds draw otherwise"
    );
    s.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_text_before_it() -> TestResult {
    let s = start(4, 8).await?;
    let greedy = json!({"prompt": "abc", "max_tokens": 24, "temperature": 0});
    let (_, full) = post(&s.base, "/v1/completions", &greedy).await?;
    let full = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "the tiny model wrote {full:?}");
    let stop: String = chars[4..6].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];
    for stream_it in [false, true] {
        let mut body = greedy.clone();
        body["stop"] = json!([stop, "never in this text \u{1F600}"]);
        body["stream"] = json!(stream_it);
        let (text, reason) = if stream_it {
            let (chunks, _) = stream(&s.base, "/v1/completions", &body).await?;
            let reason = chunks.last().unwrap()["choices"][0]["finish_reason"].clone();
            (text_of(&chunks), reason)
        } else {
            let (_, r) = post(&s.base, "/v1/completions", &body).await?;
            let c = &r["choices"][0];
            (
                c["text"].as_str().unwrap().to_string(),
                c["finish_reason"].clone(),
            )
        };
        assert_eq!(text, expected, "stream: {stream_it}");
        assert_eq!(reason, "stop");
    }
    s.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_streams_in_openai_chunks() -> TestResult {
    let s = start(4, 8).await?;
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 6, "temperature": 0, "stream": true,
    });
    let (chunks, done) = stream(&s.base, "/v1/chat/completions", &body).await?;
    assert!(done);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.last().unwrap()["choices"][0]["finish_reason"].is_string());
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let (status, r) = post(&s.base, "/v1/chat/completions", &whole).await?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"].as_str().unwrap(),
        text_of(&chunks)
    );
    s.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_nothing_else_changes() -> TestResult {
    let s = start(4, 8).await?;
    let good = json!({"prompt": "fine", "max_tokens": 5, "temperature": 0});
    let (_, before) = post(&s.base, "/v1/completions", &good).await?;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{}/v1/completions", s.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().await?;
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let long = "x".repeat(MAX_SEQ + 1);
    for (body, status, param) in [
        (
            json!({"prompt": "a", "temprature": 1}),
            400,
            json!("temprature"),
        ),
        (
            json!({"prompt": "a", "temperature": 5}),
            400,
            json!("temperature"),
        ),
        (json!({"prompt": long}), 400, json!("prompt")),
        (
            json!({"prompt": "ab", "max_tokens": MAX_SEQ}),
            400,
            json!("max_tokens"),
        ),
        (
            json!({"prompt": "a", "model": "other"}),
            404,
            json!("model"),
        ),
        (json!({"prompt": ""}), 400, json!("prompt")),
    ] {
        let (got, e) = post(&s.base, "/v1/completions", &body).await?;
        assert_eq!(got, status, "{body} gave {e}");
        assert_eq!(e["error"]["param"], param, "{body} gave {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // Exactly full fits: 2 prompt tokens and MAX_SEQ - 1 new ones.
    let (got, e) = post(
        &s.base,
        "/v1/completions",
        &json!({"prompt": "ab", "max_tokens": MAX_SEQ - 1, "temperature": 0}),
    )
    .await?;
    assert_eq!(got, 200, "{e}");
    let (_, after) = post(&s.base, "/v1/completions", &good).await?;
    assert_eq!(after["choices"], before["choices"]);
    s.stop().await
}

async fn gauge(base: &str, name: &str) -> TestResult<u64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await?
        .text()
        .await?;
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .ok_or("metric missing")?;
    Ok(line.rsplit(' ').next().unwrap_or_default().parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_frees_its_sequence_and_a_full_queue_answers_429() -> TestResult {
    // One sequence and no queue: a second request while the first runs is refused. The first
    // asks for every position the tiny model has, so it is still running when its client
    // leaves (the cancelled count tells).
    // On a loaded machine the tiny model may decode all 510 tokens before the second request
    // or before the server sees the client go: then the long request finished, and the test
    // tries again, up to 5 times, until one attempt sees both the refusal and the cancellation.
    let s = start_with(1, 0, 512).await?;
    let long = json!({"prompt": "go", "max_tokens": 510, "temperature": 0, "stream": true, "stop": "never"});
    let (mut refused, mut cancelled) = (false, 0);
    for _ in 0..5 {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/completions", s.base))
            .json(&long)
            .send()
            .await?;
        let mut body = r.bytes_stream();
        body.next().await.ok_or("no first chunk")??;
        let (status, e) = post(&s.base, "/v1/completions", &json!({"prompt": "x"})).await?;
        // 200: the long request had finished, so this one was served.
        assert!(status == 429 || status == 200, "{status}: {e}");
        if status == 429 {
            assert_eq!(e["error"]["type"], "rate_limit_error");
            refused = true;
        }
        drop(body);
        let mut freed = false;
        for _ in 0..200 {
            if gauge(&s.base, "graft_serve_running_sequences").await? == 0 {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(freed, "the sequence of a client that left is freed");
        cancelled = gauge(&s.base, "graft_serve_cancelled_total").await?;
        if refused && cancelled > 0 {
            break;
        }
    }
    assert!(refused, "a request while the only sequence runs is refused");
    assert!(cancelled >= 1, "cancelled, not finished");
    let (status, _) = post(
        &s.base,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    )
    .await?;
    assert_eq!(status, 200, "its place is free again");
    let metrics = reqwest::get(format!("{}/metrics", s.base))
        .await?
        .text()
        .await?;
    for name in [
        "graft_serve_time_to_first_token_seconds_count",
        "graft_replays_total",
        "graft_recordings_total",
    ] {
        assert!(metrics.contains(name), "{name} in {metrics}");
    }
    s.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_lets_a_stream_in_flight_finish() -> TestResult {
    let mut s = start(2, 2).await?;
    let models: Value = reqwest::get(format!("{}/v1/models", s.base))
        .await?
        .json()
        .await?;
    assert_eq!(models["data"][0]["id"], "tiny");
    let health = reqwest::get(format!("{}/health", s.base)).await?;
    assert_eq!(health.status().as_u16(), 200);
    let body = json!({"prompt": "go", "max_tokens": 40, "temperature": 0, "stream": true});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.base))
        .json(&body)
        .send()
        .await?;
    if let Some(stop) = s.stop.take() {
        let _ = stop.send(());
    }
    let text = r.text().await?;
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    s.stop().await
}

#[test]
fn the_engine_alone_gives_the_tokens_the_http_api_gives() -> TestResult {
    let (server, dir) = made(4, 8, MAX_SEQ)?;
    let prompts = vec![
        (vec![5u32, 6, 7], 10),
        (vec![100, 101], 7),
        (vec![9; 40], 20),
    ];
    let offline = server.generate(&prompts)?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.path().join("tiny/tokenizer.json"))?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let s = served(server, dir).await?;
        for ((prompt, max_new), tokens) in prompts.iter().zip(&offline) {
            let body = json!({"prompt": prompt, "max_tokens": max_new, "temperature": 0});
            let (_, r) = post(&s.base, "/v1/completions", &body).await?;
            assert_eq!(r["usage"]["completion_tokens"], tokens.len(), "{r}");
            assert_eq!(
                r["choices"][0]["text"],
                tokenizer.decode(tokens, true)?,
                "{r}"
            );
        }
        s.stop().await
    })
}

/// `--speculate` changes no token: requests sent one at a time (each runs alone, so each
/// speculates) get what a server that does not speculate gives.
#[test]
fn a_server_that_speculates_gives_the_tokens_of_one_that_does_not() -> TestResult {
    let (plain, _dir) = made(4, 8, MAX_SEQ)?;
    let (speculating, _dir2) = made_speculating(4, 8, MAX_SEQ, Some(4))?;
    // Prompts that repeat themselves, so that prompt lookup finds n-grams.
    let prompts = [
        (vec![5u32, 6, 7, 5, 6, 7, 5, 6], 30),
        (vec![100, 101, 102, 103, 100, 101], 17),
        (vec![9; 40], 20),
    ];
    for request in prompts {
        let want = plain.generate(std::slice::from_ref(&request))?;
        let got = speculating.generate(std::slice::from_ref(&request))?;
        assert_eq!(got, want, "prompt {:?}", request.0);
    }
    Ok(())
}
