//! OpenAI's request bodies as the server accepts them: parsed strictly (an unknown field, a
//! wrong type or a value out of range is a 400 naming it), then checked against the model.

use serde::Deserialize;

use crate::error::ApiError;
use crate::model::Message;

/// One string or several (`stop`).
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: bool,
}

/// The fields both endpoints share (serde cannot refuse unknown fields through `flatten`:
/// [`parse`] does, by these names).
#[derive(Deserialize, Debug, Default)]
pub(crate) struct Common {
    pub(crate) model: Option<String>,
    pub(crate) max_tokens: Option<u64>,
    /// The chat API's newer name for `max_tokens`.
    pub(crate) max_completion_tokens: Option<u64>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    /// Not OpenAI's, but vLLM's and others': 0 or -1 keeps every token.
    pub(crate) top_k: Option<i64>,
    pub(crate) seed: Option<u64>,
    pub(crate) stop: Option<OneOrMany>,
    #[serde(default)]
    pub(crate) stream: bool,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) n: Option<u64>,
    pub(crate) user: Option<String>,
    pub(crate) frequency_penalty: Option<f32>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) logprobs: Option<serde_json::Value>,
    pub(crate) top_logprobs: Option<u64>,
}

/// [`Common`]'s fields.
const COMMON: [&str; 16] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    // The chat API's, harmless for completions.
    "top_logprobs",
];

/// An endpoint's body: a JSON object whose fields are [`COMMON`]'s and `own`; any other field
/// is a 400 naming it.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    own: &[&str],
) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(ApiError::json)?;
    let Some(fields) = value.as_object() else {
        return Err(ApiError::status(
            axum::http::StatusCode::BAD_REQUEST,
            "the request body is not a JSON object",
        ));
    };
    if let Some(unknown) = fields
        .keys()
        .find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        return Err(ApiError::invalid(
            unknown,
            format!("unknown field {unknown:?}: check its spelling, or leave it out"),
        ));
    }
    serde_json::from_value(value).map_err(ApiError::json)
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub(crate) struct CompletionBody {
    pub(crate) prompt: Prompt,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// A completion's prompt: text or tokens.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub(crate) struct ChatBody {
    pub(crate) messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// A chat message: its content text, or text parts.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    pub(crate) content: Content,
    /// A participant's name: accepted, not passed to the template.
    #[serde(rename = "name")]
    _name: Option<String>,
}

/// A message's content.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a message's content: only text parts are served.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) text: Option<String>,
}

impl ChatMessage {
    /// The message as the chat template takes it.
    pub(crate) fn to_message(&self) -> Result<Message, ApiError> {
        let content = match &self.content {
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!(
                                    "content parts of type {:?} are not served: send text parts",
                                    p.kind
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        Ok(Message {
            role: self.role.clone(),
            content,
        })
    }
}

/// Sampling as the request asked, checked for range; the model's defaults fill what it left
/// out.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Asked {
    pub(crate) max_tokens: Option<u64>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) top_k: Option<u32>,
    pub(crate) seed: Option<u64>,
    pub(crate) stops: Vec<String>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
}

/// The most stop strings a request may send (OpenAI's limit).
const MAX_STOPS: usize = 4;

impl Common {
    /// Checks every field's range; returns what the request asked.
    pub(crate) fn check(self) -> Result<Asked, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid("n", "only n = 1 is served"));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(
                    name,
                    format!("{name} is not served: leave it out or send 0"),
                ));
            }
        }
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| !(v.is_null() || *v == serde_json::Value::Bool(false)))
            || self.top_logprobs.is_some_and(|n| n > 0)
        {
            return Err(ApiError::invalid("logprobs", "logprobs are not served"));
        }
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature {t} is out of range: use 0 to 2 (0 is greedy)"),
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p {p} is out of range: use a value above 0 and at most 1"),
            ));
        }
        let top_k = match self.top_k {
            None => None,
            Some(-1 | 0) => Some(0),
            Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k {k} is out of range: use -1 or 0 (every token) or above 0"),
                ));
            }
        };
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(
                "max_tokens",
                "max_tokens is 0: ask for at least one token",
            ));
        }
        let stops = match self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s],
            Some(OneOrMany::Many(v)) => v,
        };
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!("{} stop strings: send at most {MAX_STOPS}", stops.len()),
            ));
        }
        let include_usage = match (self.stream, self.stream_options) {
            (_, None) => false,
            (true, Some(o)) => o.include_usage,
            (false, Some(_)) => {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed with stream: true",
                ));
            }
        };
        let _ = (self.model, self.user);
        Ok(Asked {
            max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k,
            seed: self.seed,
            stops,
            stream: self.stream,
            include_usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Asked, ApiError> {
        let body: CompletionBody = super::parse(json.as_bytes(), &["prompt"])?;
        body.common.check()
    }

    #[test]
    fn fields_out_of_range_name_themselves() {
        for (json, param) in [
            (r#"{"prompt": "a", "temperature": 3}"#, "temperature"),
            (r#"{"prompt": "a", "top_p": 0}"#, "top_p"),
            (r#"{"prompt": "a", "top_k": -2}"#, "top_k"),
            (r#"{"prompt": "a", "n": 2}"#, "n"),
            (r#"{"prompt": "a", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "a", "stop": ["a","b","c","d","e"]}"#, "stop"),
            (
                r#"{"prompt": "a", "presence_penalty": 1}"#,
                "presence_penalty",
            ),
            (
                r#"{"prompt": "a", "stream_options": {"include_usage": true}}"#,
                "stream_options",
            ),
        ] {
            let e = parse(json).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{json}: {e:?}");
        }
    }

    #[test]
    fn unknown_fields_and_wrong_types_are_refused() {
        let e = parse(r#"{"prompt": "a", "temprature": 1}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temprature"));
        assert!(parse(r#"[1]"#).is_err());
        assert!(parse(r#"{"prompt": "a", "max_tokens": "3"}"#).is_err());
        assert!(parse(r#"{"prompt": 3}"#).is_err());
    }

    #[test]
    fn what_is_asked_comes_through() {
        let a = parse(r#"{"prompt": "a", "max_tokens": 5, "top_k": -1, "stop": "x", "seed": 9, "stream": true, "stream_options": {"include_usage": true}}"#).unwrap();
        assert_eq!(a.max_tokens, Some(5));
        assert_eq!(a.top_k, Some(0));
        assert_eq!(a.stops, vec!["x".to_string()]);
        assert_eq!(a.seed, Some(9));
        assert!(a.stream && a.include_usage);
    }
}
