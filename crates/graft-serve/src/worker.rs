//! The engine's thread: it owns the model, the cache and graft, takes requests and
//! cancellations from the HTTP handlers over a channel, steps the continuous batch while
//! anything is pending (sleeping on the channel when nothing is), and sends every request's
//! tokens to its own channel. A request whose receiver is gone (its client left) is cancelled
//! at once, freeing its cache row.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use graft_candle_models::serve::{Engine, Event, Request, SampleParams};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// What a request's channel carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Update {
    /// The next token.
    Token(u32),
    /// No more tokens: the request reached its `max_tokens` or an end token.
    Finished,
    /// The engine refused the request (the message says why and what to do).
    Refused(String),
    /// A step failed: the request ends without its tokens.
    Failed(String),
}

/// A request for the engine.
#[derive(Debug)]
pub(crate) struct Submission {
    pub(crate) id: u64,
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_new: usize,
    pub(crate) sampling: SampleParams,
    pub(crate) arrived: Instant,
    pub(crate) updates: UnboundedSender<Update>,
}

/// What the handlers send the engine's thread.
#[derive(Debug)]
pub(crate) enum Command {
    Submit(Submission),
    Cancel(u64),
    /// Finish what is pending, then end (the server is stopping).
    Close,
}

/// The handlers' side of the engine's thread; cloned into each. When every handle is gone
/// the thread finishes what is running and ends.
#[derive(Debug, Clone)]
pub(crate) struct Handle {
    commands: mpsc::Sender<Command>,
    /// Requests submitted and not yet dropped by their handler.
    outstanding: Arc<AtomicUsize>,
    /// The most requests outstanding at once: one more is refused (429).
    limit: usize,
}

/// A submitted request: dropping it cancels the request if it is still in the engine.
#[derive(Debug)]
pub(crate) struct Ticket {
    id: u64,
    handle: Handle,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.handle.outstanding.fetch_sub(1, Ordering::AcqRel);
        // The engine's thread may have ended (shutdown): nothing is left to cancel then.
        let _ = self.handle.commands.send(Command::Cancel(self.id));
    }
}

/// Why a submission was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// As many requests as the server takes are outstanding.
    Full,
    /// The engine's thread has ended.
    Stopped,
}

impl Handle {
    /// Asks the engine's thread to finish what is pending and end; false if it has ended.
    pub(crate) fn close(&self) -> bool {
        self.commands.send(Command::Close).is_ok()
    }

    /// Hands `submission` to the engine.
    pub(crate) fn submit(&self, submission: Submission) -> Result<Ticket, Busy> {
        let taken = self.outstanding.fetch_add(1, Ordering::AcqRel);
        if taken >= self.limit {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Busy::Full);
        }
        let id = submission.id;
        if self.commands.send(Command::Submit(submission)).is_err() {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Busy::Stopped);
        }
        Ok(Ticket {
            id,
            handle: self.clone(),
        })
    }
}

/// The channel's ends: the handle for the handlers, the receiver for [`run`].
pub(crate) fn channel(limit: usize) -> (Handle, mpsc::Receiver<Command>) {
    let (commands, rx) = mpsc::channel();
    let handle = Handle {
        commands,
        outstanding: Arc::new(AtomicUsize::new(0)),
        limit,
    };
    (handle, rx)
}

/// How stale graft's counters in the metrics may be while the engine is busy.
const PUBLISH: std::time::Duration = std::time::Duration::from_millis(50);

/// A request the engine holds: where its tokens go and when they came.
struct Live {
    updates: UnboundedSender<Update>,
    arrived: Instant,
    last: Option<Instant>,
}

/// Steps `engine` until every handle is dropped and nothing is pending.
pub(crate) fn run(engine: &mut Engine<'_>, commands: &mpsc::Receiver<Command>, metrics: &Metrics) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut open = true;
    let mut published = Instant::now();
    loop {
        if engine.pending() == 0 {
            if !open {
                return;
            }
            match commands.recv() {
                Ok(Command::Close) | Err(mpsc::RecvError) => return,
                Ok(c) => apply(engine, &mut live, c, metrics),
            }
        }
        loop {
            match commands.try_recv() {
                Ok(Command::Close) => open = false,
                Ok(c) => apply(engine, &mut live, c, metrics),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if engine.pending() > 0 {
            step(engine, &mut live, metrics);
        }
        let running = engine.running();
        metrics.running.store(running as u64, Ordering::Relaxed);
        metrics
            .waiting
            .store((engine.pending() - running) as u64, Ordering::Relaxed);
        // graft's counters take two locks and a look at the pools: at most every 50 ms, and
        // whenever the engine goes idle.
        if (published.elapsed() >= PUBLISH || engine.pending() == 0)
            && let Some(d) = engine.graft().and_then(|g| g.graft())
        {
            metrics.set_graft(&d.stats());
            published = Instant::now();
        }
    }
}

fn apply(engine: &mut Engine<'_>, live: &mut HashMap<u64, Live>, c: Command, metrics: &Metrics) {
    match c {
        Command::Submit(s) => {
            let request = Request {
                id: s.id,
                prompt: s.prompt,
                max_new: s.max_new,
                sampling: s.sampling,
            };
            let prompt = request.prompt.len() as u64;
            match engine.submit(request) {
                Ok(()) => {
                    metrics.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
                    live.insert(
                        s.id,
                        Live {
                            updates: s.updates,
                            arrived: s.arrived,
                            last: None,
                        },
                    );
                }
                Err(refused) => {
                    let _ = s.updates.send(Update::Refused(refused.to_string()));
                }
            }
        }
        // `run` takes it.
        Command::Close => {}
        Command::Cancel(id) => {
            if live.remove(&id).is_some() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = engine.cancel(id) {
                    fail_all(engine, live, &e.to_string());
                }
            }
        }
    }
}

fn step(engine: &mut Engine<'_>, live: &mut HashMap<u64, Live>, metrics: &Metrics) {
    let events = match engine.step() {
        Ok(events) => events,
        Err(e) => {
            tracing::error!(error = %e, "a serving step failed: its requests end with an error");
            fail_all(engine, live, &e.to_string());
            return;
        }
    };
    let now = Instant::now();
    let mut gone = Vec::new();
    for event in events {
        match event {
            Event::Token { id, token, .. } => {
                let Some(l) = live.get_mut(&id) else { continue };
                match l.last {
                    None => metrics.ttft.observe((now - l.arrived).as_secs_f64()),
                    Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
                }
                l.last = Some(now);
                metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
                if l.updates.send(Update::Token(token)).is_err() {
                    gone.push(id);
                }
            }
            Event::Finished { id } => {
                if let Some(l) = live.remove(&id) {
                    let _ = l.updates.send(Update::Finished);
                }
            }
        }
    }
    for id in gone {
        if live.remove(&id).is_some() {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = engine.cancel(id) {
                fail_all(engine, live, &e.to_string());
                return;
            }
        }
    }
}

/// Ends every request with `message` and empties the engine.
fn fail_all(engine: &mut Engine<'_>, live: &mut HashMap<u64, Live>, message: &str) {
    for (id, l) in live.drain() {
        let _ = l.updates.send(Update::Failed(message.to_string()));
        let _ = engine.cancel(id);
    }
}
