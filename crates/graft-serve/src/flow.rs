//! One request's tokens turned into the text pieces a response sends: detokenized as they
//! arrive, stop strings applied, the finish reason decided. Dropping a flow cancels its
//! request in the engine (its [`Ticket`] goes with it).

use std::sync::Arc;

use axum::http::StatusCode;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::state::State;
use crate::text::{Detokenizer, StopText};
use crate::worker::{Ticket, Update};

/// What [`Flow::next`] gives.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    /// More text (never empty).
    Text(String),
    /// The last text (maybe empty) and OpenAI's finish reason: `"stop"` (an end token or a
    /// stop string) or `"length"` (max_tokens reached).
    Last(String, &'static str),
}

/// A request's tokens as text.
#[derive(Debug)]
pub(crate) struct Flow {
    state: Arc<State>,
    _ticket: Ticket,
    updates: UnboundedReceiver<Update>,
    detokenizer: Detokenizer,
    stops: StopText,
    generated: usize,
    last: Option<u32>,
}

impl Flow {
    pub(crate) fn new(
        state: Arc<State>,
        ticket: Ticket,
        updates: UnboundedReceiver<Update>,
        stops: Vec<String>,
    ) -> Flow {
        Flow {
            state,
            _ticket: ticket,
            updates,
            detokenizer: Detokenizer::default(),
            stops: StopText::new(stops),
            generated: 0,
            last: None,
        }
    }

    /// Tokens generated so far (the end token included).
    pub(crate) fn generated(&self) -> usize {
        self.generated
    }

    /// The next piece of text; after [`Piece::Last`] the flow must not be asked again.
    pub(crate) async fn next(&mut self) -> Result<Piece, ApiError> {
        let decode = |e: crate::text::DecodeError| {
            ApiError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the tokenizer could not decode a generated token: {e}"),
            )
        };
        loop {
            match self.updates.recv().await {
                Some(Update::Token(token)) => {
                    self.generated += 1;
                    self.last = Some(token);
                    let piece = self
                        .detokenizer
                        .push(&self.state.tokenizer, token)
                        .map_err(decode)?;
                    let released = self.stops.push(&piece);
                    if released.stopped {
                        return Ok(Piece::Last(released.text, "stop"));
                    }
                    if !released.text.is_empty() {
                        return Ok(Piece::Text(released.text));
                    }
                }
                Some(Update::Finished) => {
                    let rest = self
                        .detokenizer
                        .finish(&self.state.tokenizer)
                        .map_err(decode)?;
                    let released = self.stops.push(&rest);
                    let mut text = released.text;
                    if !released.stopped {
                        text.push_str(&self.stops.finish());
                    }
                    let ended = self.last.is_some_and(|t| self.state.eos.contains(&t));
                    let reason = if released.stopped || ended {
                        "stop"
                    } else {
                        "length"
                    };
                    return Ok(Piece::Last(text, reason));
                }
                Some(Update::Refused(message)) => {
                    return Err(ApiError::status(StatusCode::BAD_REQUEST, message));
                }
                Some(Update::Failed(message)) => {
                    return Err(ApiError::status(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("generation failed: {message}"),
                    ));
                }
                None => {
                    return Err(ApiError::status(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the engine stopped before the request finished",
                    ));
                }
            }
        }
    }
}
