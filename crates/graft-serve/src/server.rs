//! Starting the server: load the model, start the engine's thread (its cache sized, every
//! bucket recorded before the first request), then serve HTTP until asked to stop, letting
//! the requests in flight finish.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use graft_candle::{Buckets, CandleGraft};
use graft_candle_models::Decoder;
use graft_candle_models::serve::{Engine, ServeConfig, Speculate, plan};

use axum::http::StatusCode;
use graft_candle_models::serve::SampleParams;

use crate::error::{ApiError, ServeError};
use crate::metrics::Metrics;
use crate::model::Loaded;
use crate::state::State;
use crate::worker::{self, Update};

/// What to serve and how.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// A Hugging Face model directory or a GGUF file.
    pub model: PathBuf,
    /// The weights' and activations' dtype (`None`: bf16 on a GPU, f32 on the CPU; a GGUF
    /// model computes in f32 whatever this says).
    pub dtype: Option<DType>,
    /// Positions per sequence (prompt and output); `None`: the model's context, at most
    /// 4,096.
    pub max_seq: Option<usize>,
    /// Sequences decoding at once; `None`: 8 on the CPU, and on a GPU as many as the memory
    /// left after the weights and the recordings holds (a margin kept), at most 64.
    pub max_batch: Option<usize>,
    /// Requests that may wait beyond the running ones; one more is answered 429.
    pub max_queue: usize,
    /// Run every step eagerly with candle (no graft): the baseline.
    pub eager: bool,
    /// Speculative decoding of the running sequences with prompt lookup, up to this many
    /// drafts a sequence a pass (`None`: off). The tokens are those of plain decoding.
    pub speculate: Option<usize>,
}

/// A loaded model with its engine running, ready to serve.
#[derive(Debug)]
pub struct Server {
    pub(crate) state: Arc<State>,
    /// The engine's thread, until [`Server::close`] joins it.
    worker: Option<JoinHandle<()>>,
    /// Sequences of the cache.
    pub sequences: usize,
    /// Seconds from the start to ready: load, cache, recordings.
    pub ready_s: f64,
}

/// The engine's shape once started.
struct Ready {
    sequences: usize,
}

/// GPU memory kept free when the cache is sized from what is left.
const MARGIN: u64 = 1 << 30;
/// The largest cache a GPU plan makes, in sequences (the largest decode bucket).
const MOST_SEQUENCES: usize = 64;

impl Server {
    /// Loads `options.model` on `device` and starts its engine.
    pub fn start(options: &ServeOptions, device: &Device) -> Result<Server, ServeError> {
        let started = Instant::now();
        let dtype = options.dtype.unwrap_or(if device.is_cuda() {
            DType::BF16
        } else {
            DType::F32
        });
        let Loaded {
            name,
            decoder,
            tokenizer,
            template,
            defaults,
            eos,
            max_position,
            ..
        } = crate::model::load(&options.model, dtype, device)?;
        let max_seq = options
            .max_seq
            .unwrap_or(max_position.unwrap_or(4096).min(4096));
        if let Some(limit) = max_position
            && max_seq > limit
        {
            return Err(ServeError::MaxSeq { max_seq, limit });
        }
        let metrics = Arc::new(Metrics::default());
        let sequences_hint =
            options
                .max_batch
                .unwrap_or(if device.is_cuda() { MOST_SEQUENCES } else { 8 });
        let (handle, commands) = worker::channel(sequences_hint + options.max_queue);
        let (ready_tx, ready_rx) = mpsc::channel();
        let engine_metrics = Arc::clone(&metrics);
        let config = serve_config(sequences_hint, max_seq, eos.clone(), options.speculate)?;
        let (eager, fixed) = (options.eager, options.max_batch.is_some());
        let worker = std::thread::Builder::new()
            .name("graft-serve-engine".into())
            .spawn(move || {
                let started = setup(&decoder, config, eager, fixed, sequences_hint, max_seq);
                let mut engine = match started {
                    Ok(engine) => engine,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let sequences = engine.cache().max_batch();
                let _ = ready_tx.send(Ok(Ready { sequences }));
                worker::run(&mut engine, &commands, &engine_metrics);
            })?;
        let ready = ready_rx.recv().map_err(|_| ServeError::EngineGone)??;
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        let state = State {
            name,
            tokenizer,
            template,
            defaults,
            max_seq,
            eos,
            handle,
            metrics,
            created: since_epoch.as_secs(),
            next_id: AtomicU64::new(0),
            seeds: since_epoch.as_nanos() as u64,
        };
        Ok(Server {
            state: Arc::new(state),
            worker: Some(worker),
            sequences: ready.sequences,
            ready_s: started.elapsed().as_secs_f64(),
        })
    }

    /// Generates greedily for `requests` (each a prompt's tokens and the most tokens to
    /// generate), all handed to the engine at once: an offline batch through the engine the
    /// HTTP API uses, without HTTP or text. Returns each request's tokens, in order. Blocks:
    /// call it outside an async runtime.
    pub fn generate(&self, requests: &[(Vec<u32>, usize)]) -> Result<Vec<Vec<u32>>, ApiError> {
        let mut pending = Vec::with_capacity(requests.len());
        for (prompt, max_new) in requests {
            let (updates, rx) = tokio::sync::mpsc::unbounded_channel();
            let submission = worker::Submission {
                id: self
                    .state
                    .next_id
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                prompt: prompt.clone(),
                max_new: *max_new,
                sampling: SampleParams::GREEDY,
                arrived: Instant::now(),
                updates,
            };
            let ticket = self.state.handle.submit(submission).map_err(|_| {
                ApiError::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "more requests than --max-batch + --max-queue: send fewer at once",
                )
            })?;
            pending.push((ticket, rx));
        }
        let mut out = Vec::with_capacity(pending.len());
        for (_ticket, mut rx) in pending {
            let mut tokens = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(Update::Token(t)) => tokens.push(t),
                    Some(Update::Finished) => break,
                    Some(Update::Refused(m)) => {
                        return Err(ApiError::status(StatusCode::BAD_REQUEST, m));
                    }
                    Some(Update::Failed(m)) => {
                        return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, m));
                    }
                    None => {
                        return Err(ApiError::status(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the engine stopped before the request finished",
                        ));
                    }
                }
            }
            out.push(tokens);
        }
        Ok(out)
    }

    /// The model's id, as `/v1/models` lists it.
    pub fn model_name(&self) -> &str {
        &self.state.name
    }

    /// Serves HTTP on `listener` until `shutdown` completes, then lets the requests in flight
    /// finish and stops the engine.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let app = crate::http::router(Arc::clone(&self.state));
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
        let mut server = self;
        let closed = tokio::task::spawn_blocking(move || server.close())
            .await
            .map_err(|_| ServeError::EngineGone)?;
        served?;
        closed
    }

    /// Stops the engine: it finishes what is pending, then its thread (which owns the model,
    /// the cache and graft) ends and is joined, so the device is released before the process
    /// exits. Blocks; dropping the server does the same, logging a failure.
    pub fn close(&mut self) -> Result<(), ServeError> {
        let Some(worker) = self.worker.take() else {
            return Ok(());
        };
        self.state.handle.close();
        worker.join().map_err(|_| ServeError::EngineGone)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "stopping the engine failed");
        }
    }
}

/// The engine's buckets: decode batches in powers of two up to the cache's sequences,
/// prefill chunks of 16 to 512 tokens within `max_seq`, with 384 between 256 and 512 so that
/// a prompt of 257 to 384 tokens is padded by at most half, not doubled (a padded prefill
/// chunk is what graft's time to first token pays over eager's).
fn serve_config(
    sequences: usize,
    max_seq: usize,
    eos: Vec<u32>,
    speculate: Option<usize>,
) -> Result<ServeConfig, ServeError> {
    let buckets = |source| ServeError::Buckets { source };
    let decode = (0..).map(|i| 1usize << i).take_while(|&b| b <= sequences);
    let prefill = [16, 32, 64, 128, 256, 384, 512]
        .into_iter()
        .filter(|&b| b <= max_seq);
    let prefill: Vec<usize> = prefill.collect();
    let prefill = if prefill.is_empty() {
        vec![max_seq]
    } else {
        prefill
    };
    Ok(ServeConfig {
        decode_buckets: Buckets::new(decode).map_err(buckets)?,
        prefill_buckets: Buckets::new(prefill).map_err(buckets)?,
        eos,
        max_running: Some(sequences),
        speculate: speculate.map(Speculate::prompt_lookup),
    })
}

/// Makes the engine on its thread: eager, or under graft with every bucket recorded (on a
/// GPU with no `max_batch`, its cache sized by the memory plan).
fn setup(
    decoder: &Decoder,
    config: ServeConfig,
    eager: bool,
    fixed: bool,
    sequences: usize,
    max_seq: usize,
) -> Result<Engine<'_>, ServeError> {
    let engine = |source| ServeError::Engine { source };
    let model = |source| ServeError::Engine {
        source: graft_candle::Error::Model { source },
    };
    let device = decoder.device().clone();
    if eager {
        let cache = decoder
            .new_serving_cache(sequences, max_seq)
            .map_err(model)?;
        return Engine::eager(decoder, cache, config).map_err(engine);
    }
    let graft_config = graft_core::Config {
        replace_moved_static: true,
        ..graft_core::Config::default()
    };
    let graft = CandleGraft::with_config(&device, graft_config).map_err(engine)?;
    let cache = decoder
        .new_serving_cache(config.decode_buckets.largest(), max_seq)
        .map_err(model)?;
    let mut e = Engine::graphed(decoder, cache, graft, config).map_err(engine)?;
    if device.is_cuda() && !fixed {
        let p = plan(&mut e, MARGIN).map_err(engine)?;
        tracing::info!(
            sequences = p.sequences,
            capture_s = p.capture_s,
            "the kv cache takes the memory the recordings left"
        );
    } else {
        let calls = e.capture().map_err(engine)?;
        tracing::info!(calls, "every bucket recorded");
    }
    Ok(e)
}
