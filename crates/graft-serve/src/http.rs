//! The routes: OpenAI's completions and chat completions (whole, or streamed as server-sent
//! events ending with `[DONE]`), the model list, health and Prometheus metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State as Shared;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::{self, Asked, ChatBody, CompletionBody, Prompt};
use crate::error::ApiError;
use crate::flow::{Flow, Piece};
use crate::state::State;
use crate::worker::{Busy, Submission};

type St = Shared<Arc<State>>;

/// Every route over `state`.
pub(crate) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn models(Shared(s): St) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": s.name, "object": "model", "created": s.created, "owned_by": "graft"}],
    }))
}

async fn metrics(Shared(s): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// Which API a request came through (the two differ only in their bodies' shapes).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Api {
    Completion,
    Chat,
}

async fn completions(Shared(s): St, body: Bytes) -> Response {
    let arrived = Instant::now();
    let run = async {
        let body: CompletionBody = api::parse(&body, &["prompt"])?;
        check_model(&s, body.common.model.as_deref())?;
        let asked = body.common.check()?;
        let prompt = match body.prompt {
            Prompt::Text(text) => encode(&s, &text, true)?,
            Prompt::Tokens(ids) => ids,
        };
        generate(&s, Api::Completion, prompt, asked, arrived).await
    };
    respond(&s, run.await)
}

async fn chat(Shared(s): St, body: Bytes) -> Response {
    let arrived = Instant::now();
    let run = async {
        let body: ChatBody = api::parse(&body, &["messages"])?;
        check_model(&s, body.common.model.as_deref())?;
        let asked = body.common.check()?;
        let Some(template) = &s.template else {
            return Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                "this model has no chat template: use /v1/completions",
            ));
        };
        let messages = body
            .messages
            .iter()
            .map(|m| m.to_message())
            .collect::<Result<Vec<_>, _>>()?;
        let text = template
            .render(&messages, true)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        // The template writes the special tokens (the start token among them) itself.
        let prompt = encode(&s, &text, false)?;
        generate(&s, Api::Chat, prompt, asked, arrived).await
    };
    respond(&s, run.await)
}

fn respond(s: &State, r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| {
        s.metrics.refused.fetch_add(1, Relaxed);
        e.into_response()
    })
}

fn check_model(s: &State, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "model {m:?} is not served here: this server serves {:?}",
                s.name
            ),
            param: Some("model".into()),
        }),
        _ => Ok(()),
    }
}

fn encode(s: &State, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    let encoding = s.tokenizer.encode(text, special).map_err(|e| {
        ApiError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the tokenizer failed on the prompt: {e}"),
        )
    })?;
    Ok(encoding.get_ids().to_vec())
}

/// Submits the request and answers it whole or as a stream.
async fn generate(
    s: &Arc<State>,
    api: Api,
    prompt: Vec<u32>,
    asked: Asked,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let (submission, updates, prompt_tokens) = submission(s, prompt, &asked, arrived)?;
    let id = submission.id;
    let ticket = s.handle.submit(submission).map_err(|busy| match busy {
        Busy::Full => ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "the server's queue is full: retry later",
        ),
        Busy::Stopped => ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        ),
    })?;
    s.metrics.requests.fetch_add(1, Relaxed);
    let mut flow = Flow::new(Arc::clone(s), ticket, updates, asked.stops.clone());
    let meta = Meta {
        id: format!("{}-{id}", api.prefix()),
        created: s.created,
        model: s.name.clone(),
        api,
        prompt_tokens,
    };
    if !asked.stream {
        let (text, reason) = flow.whole().await?;
        let body = meta.whole(&text, reason, flow.generated());
        return Ok(Json(body).into_response());
    }
    // The first piece decides the status: a refusal is a 4xx, not a stream.
    let first = flow.next().await?;
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(stream(flow, first, meta, asked.include_usage, tx));
    Ok(Sse::new(ReceiverStream::new(rx)).into_response())
}

/// Sends the stream's events until the last, or until the client has gone (dropping the
/// flow then cancels the request).
async fn stream(
    mut flow: Flow,
    first: Piece,
    meta: Meta,
    usage: bool,
    tx: mpsc::Sender<Result<Event, Infallible>>,
) {
    let send = |v: Value| Event::default().data(v.to_string());
    if meta.api == Api::Chat
        && tx
            .send(Ok(send(meta.chunk(Some(""), None, true))))
            .await
            .is_err()
    {
        return;
    }
    let mut piece: Result<Piece, ApiError> = Ok(first);
    loop {
        let (text, reason) = match piece {
            Ok(Piece::Text(t)) => (t, None),
            Ok(Piece::Last(t, r)) => (t, Some(r)),
            Err(e) => {
                let _ = tx.send(Ok(send(e.body()))).await;
                return;
            }
        };
        if !text.is_empty()
            && tx
                .send(Ok(send(meta.chunk(Some(&text), None, false))))
                .await
                .is_err()
        {
            return;
        }
        if let Some(reason) = reason {
            let mut last = vec![meta.chunk(None, Some(reason), false)];
            if usage {
                last.push(meta.usage_chunk(flow.generated()));
            }
            for v in last {
                if tx.send(Ok(send(v))).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
            return;
        }
        piece = tokio::select! {
            p = flow.next() => p,
            () = tx.closed() => return,
        };
    }
}

/// The engine's request for `prompt` as `asked`, with the model's defaults.
fn submission(
    s: &State,
    prompt: Vec<u32>,
    asked: &Asked,
    arrived: Instant,
) -> Result<
    (
        Submission,
        mpsc::UnboundedReceiver<crate::worker::Update>,
        usize,
    ),
    ApiError,
> {
    let n = prompt.len();
    if n == 0 {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt has no tokens: send some text",
        ));
    }
    if n > s.max_seq {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "the prompt has {n} tokens but a sequence holds {} positions: shorten it",
                s.max_seq
            ),
        ));
    }
    // The last token generated is never written to the cache.
    let room = s.max_seq + 1 - n;
    let max_new = match asked
        .max_tokens
        .or(s.defaults.max_new_tokens.map(|m| m as u64))
    {
        Some(m) if m as usize > room && asked.max_tokens.is_some() => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "max_tokens {m} with a prompt of {n} tokens needs {} positions but a sequence holds {}: ask for at most {room}",
                    n + m as usize - 1,
                    s.max_seq
                ),
            ));
        }
        Some(m) => (m as usize).min(room),
        None => room,
    };
    let id = s.next_id.fetch_add(1, Relaxed);
    let sampling = graft_candle_models::serve::SampleParams {
        temperature: asked.temperature.or(s.defaults.temperature).unwrap_or(1.0),
        top_k: asked
            .top_k
            .or(s
                .defaults
                .top_k
                .map(|k| u32::try_from(k).unwrap_or(u32::MAX)))
            .unwrap_or(0),
        top_p: asked.top_p.or(s.defaults.top_p).unwrap_or(1.0),
        seed: asked
            .seed
            .unwrap_or_else(|| s.seeds ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        index: 0,
    };
    let (updates, rx) = mpsc::unbounded_channel();
    let submission = Submission {
        id,
        prompt,
        max_new,
        sampling,
        arrived,
        updates,
    };
    Ok((submission, rx, n))
}

/// What every response of a request repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    api: Api,
    prompt_tokens: usize,
}

impl Api {
    fn prefix(self) -> &'static str {
        match self {
            Api::Completion => "cmpl",
            Api::Chat => "chatcmpl",
        }
    }
}

impl Meta {
    fn usage(&self, generated: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.prompt_tokens + generated,
        })
    }

    /// The whole response.
    fn whole(&self, text: &str, reason: &str, generated: usize) -> Value {
        let choice = match self.api {
            Api::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
            }
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": reason,
            }),
        };
        let object = match self.api {
            Api::Completion => "text_completion",
            Api::Chat => "chat.completion",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": self.usage(generated),
        })
    }

    /// A stream chunk: text, or the end with its reason (`role`: the chat's first chunk).
    fn chunk(&self, text: Option<&str>, reason: Option<&str>, role: bool) -> Value {
        let (object, choice) = match self.api {
            Api::Completion => (
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason}),
            ),
            Api::Chat => {
                let delta = match (role, text) {
                    (true, _) => json!({"role": "assistant", "content": ""}),
                    (false, Some(t)) => json!({"content": t}),
                    (false, None) => json!({}),
                };
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason}),
                )
            }
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice],
        })
    }

    /// The stream's usage chunk (`stream_options.include_usage`).
    fn usage_chunk(&self, generated: usize) -> Value {
        let object = match self.api {
            Api::Completion => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": self.usage(generated),
        })
    }
}
