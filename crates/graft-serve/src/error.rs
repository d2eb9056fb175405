//! The server's errors: what a request gets back (an HTTP status with OpenAI's error body)
//! and why the server could not start.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// A request's failure, sent as OpenAI's `{"error": {...}}` body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (HTTP {status})")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What happened and what to do.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 naming the field `param`.
    pub(crate) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// A body that is not the JSON the endpoint takes.
    pub(crate) fn json(e: serde_json::Error) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("the request body is not valid for this endpoint: {e}"),
            param: None,
        }
    }

    /// A failure with no field at fault.
    pub(crate) fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's error type for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub(crate) fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": null,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Why the server did not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The model could not be loaded.
    #[error(transparent)]
    Load(Box<crate::model::LoadError>),
    /// The device, the cache or the recordings failed.
    #[error("the engine could not start: {source}")]
    Engine {
        #[source]
        source: graft_candle::Error,
    },
    /// `max_seq` is beyond the model's context.
    #[error(
        "max_seq {max_seq} is beyond the model's context of {limit} positions: ask for at most {limit}"
    )]
    MaxSeq { max_seq: usize, limit: usize },
    /// No bucket could be made: `max_batch` or `max_seq` is 0.
    #[error(
        "the engine's buckets are empty ({source}): ask for at least one sequence and one position"
    )]
    Buckets {
        #[source]
        source: graft_core::BucketsError,
    },
    /// The engine's thread ended before it was ready (it panicked).
    #[error("the engine's thread ended before it was ready: see the log above")]
    EngineGone,
    /// Binding or serving the socket failed.
    #[error("the server's socket failed: {source}")]
    Io {
        #[from]
        source: std::io::Error,
    },
}

impl From<crate::model::LoadError> for ServeError {
    fn from(e: crate::model::LoadError) -> ServeError {
        ServeError::Load(Box::new(e))
    }
}
