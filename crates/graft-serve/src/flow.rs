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

    /// The whole text and the finish reason. Without stop strings the tokens are decoded once
    /// at the end (the same text as the pieces joined: a piece always ends on a whole
    /// character); with them, piece by piece.
    pub(crate) async fn whole(&mut self) -> Result<(String, &'static str), ApiError> {
        if !self.stops.is_empty() {
            let mut text = String::new();
            loop {
                match self.next().await? {
                    Piece::Text(t) => text.push_str(&t),
                    Piece::Last(t, reason) => {
                        text.push_str(&t);
                        return Ok((text, reason));
                    }
                }
            }
        }
        let mut ids = Vec::new();
        loop {
            match self.updates.recv().await {
                Some(Update::Token(token)) => ids.push(token),
                Some(Update::Finished) => break,
                other => return Err(ended(other)),
            }
        }
        self.generated = ids.len();
        self.last = ids.last().copied();
        let text = self.state.tokenizer.decode(&ids, true).map_err(decode)?;
        Ok((text, self.reason(false)))
    }

    /// `"stop"` if a stop string matched or the last token ends sequences, else `"length"`.
    fn reason(&self, stopped: bool) -> &'static str {
        let ended = self.last.is_some_and(|t| self.state.eos.contains(&t));
        if stopped || ended { "stop" } else { "length" }
    }

    /// The next piece of text; after [`Piece::Last`] the flow must not be asked again.
    pub(crate) async fn next(&mut self) -> Result<Piece, ApiError> {
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
                    return Ok(Piece::Last(text, self.reason(released.stopped)));
                }
                other => return Err(ended(other)),
            }
        }
    }
}

/// A tokenizer failure on generated tokens.
fn decode(e: crate::text::DecodeError) -> ApiError {
    ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("the tokenizer could not decode a generated token: {e}"),
    )
}

/// What an update other than a token or the end means for the request.
fn ended(update: Option<Update>) -> ApiError {
    match update {
        Some(Update::Refused(message)) => ApiError::status(StatusCode::BAD_REQUEST, message),
        Some(Update::Failed(message)) => ApiError::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("generation failed: {message}"),
        ),
        Some(Update::Token(_) | Update::Finished) | None => ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine stopped before the request finished",
        ),
    }
}
