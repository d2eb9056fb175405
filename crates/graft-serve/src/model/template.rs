//! A model's chat template (the Jinja template of its `tokenizer_config.json`), compiled once
//! with minijinja and rendered the way Hugging Face transformers renders it: blocks trimmed and
//! left-stripped, Python's string methods (`.strip()`, `.startswith()`, ...), and the
//! `raise_exception`, `strftime_now` and `tojson` that chat templates call.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value, context};
use serde::Serialize;

/// The template's name in its environment.
const NAME: &str = "chat";

/// One message of a conversation, as the OpenAI API and chat templates see it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct Message {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// The text.
    pub content: String,
}

/// Why a chat template did not compile or render.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template is not valid Jinja (or uses a tag minijinja lacks).
    #[error("the chat template does not compile: {source}; fix the template")]
    Compile {
        /// minijinja's error.
        source: minijinja::Error,
    },
    /// The template called `raise_exception`: it refuses these messages (for example a role
    /// it does not know, or roles out of order).
    #[error("the chat template rejected the messages: {message}; change the messages to fit it")]
    Raised {
        /// What the template said.
        message: String,
    },
    /// Rendering failed otherwise.
    #[error(
        "rendering the chat template failed: {source}; check the messages fit the model's chat format"
    )]
    Render {
        /// minijinja's error.
        source: minijinja::Error,
    },
}

/// What `raise_exception(message)` raises, kept as the source of minijinja's error so that
/// [`ChatTemplate::render`] can tell it from the template's own mistakes.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A compiled chat template with the model's `bos_token` and `eos_token`.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` (empty when absent) are in the context of
    /// every rendering.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|source| TemplateError::Compile { source })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|source| TemplateError::Compile { source })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// The prompt `messages` make; with `add_generation_prompt`, followed by the start of
    /// the assistant's turn.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|source| TemplateError::Render { source })?;
        let ctx = context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        template.render(ctx).map_err(|source| {
            match std::error::Error::source(&source).and_then(|s| s.downcast_ref::<Raised>()) {
                Some(Raised(message)) => TemplateError::Raised {
                    message: message.clone(),
                },
                None => TemplateError::Render { source },
            }
        })
    }
}

/// Chat templates' `raise_exception(message)`: fails the rendering with `message`.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(Raised(message)),
    )
}

/// Python's `json.dumps` as transformers' `tojson` calls it (`ensure_ascii=False`): `", "`
/// and `": "` between items, or lines indented by `indent=N` spaces.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonSeparators,
        )),
    };
    written.map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "tojson could not serialize")
            .with_source(e)
    })?;
    String::from_utf8(out).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "tojson wrote invalid utf-8")
            .with_source(e)
    })
}

/// Python's default separators, `", "` and `": "`.
struct PythonSeparators;

impl serde_json::ser::Formatter for PythonSeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// transformers' `strftime_now(format)`: the time now, in UTC, formatted as Python's
/// `strftime` does (Llama 3.1's templates write today's date with it).
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "the clock is before 1970")
            .with_source(e)
    })?;
    strftime(now.as_secs(), &format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `secs` after the Unix epoch (UTC) formatted by `format`'s directives: `%Y %y %m %B %b %d
/// %e %j %A %a %H %I %p %M %S %%`, numbers without padding after a `-` (`%-d`).
fn strftime(secs: u64, format: &str) -> Result<String, minijinja::Error> {
    let days = secs / 86_400;
    let (hour, minute, second) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Howard Hinnant's days-to-civil, for days since 1970-01-01 (no negative dates here).
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + u64::from(leap && month > 2);
    let weekday = WEEKDAYS[((days + 3) % 7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next();
        let pad = directive != Some('-');
        if !pad {
            directive = chars.next();
        }
        let number = |n: u64, width: usize| {
            if pad {
                format!("{n:0width$}")
            } else {
                n.to_string()
            }
        };
        let piece = match directive {
            Some('Y') => year.to_string(),
            Some('y') => number(year % 100, 2),
            Some('m') => number(month, 2),
            Some('B') => month_name.to_string(),
            Some('b') => month_name[..3].to_string(),
            Some('d') => number(day, 2),
            Some('e') => format!("{day:>2}"),
            Some('j') => number(yday, 3),
            Some('A') => weekday.to_string(),
            Some('a') => weekday[..3].to_string(),
            Some('H') => number(hour, 2),
            Some('I') => number((hour + 11) % 12 + 1, 2),
            Some('p') => if hour < 12 { "AM" } else { "PM" }.to_string(),
            Some('M') => number(minute, 2),
            Some('S') => number(second, 2),
            Some('%') => "%".to_string(),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now does not support %{}: use %Y %y %m %B %b %d %e %j %A %a %H %I %p %M %S",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::strftime;

    #[test]
    fn strftime_formats_like_python() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(strftime(t, "%d %b %Y").unwrap(), "23 Jul 2024");
        assert_eq!(
            strftime(t, "%A %a %B %m/%-d/%y %j %H:%M:%S %I%p %%").unwrap(),
            "Tuesday Tue July 07/23/24 205 14:05:09 02PM %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        // 2000-02-29 (a leap day of a century divisible by 400) and 2100-03-01.
        assert_eq!(
            strftime(951_782_400, "%Y-%m-%d %j").unwrap(),
            "2000-02-29 060"
        );
        assert_eq!(
            strftime(4_107_542_400, "%Y-%m-%d %e").unwrap(),
            "2100-03-01  1"
        );
        let e = strftime(0, "%Q").unwrap_err().to_string();
        assert!(e.contains("does not support %Q"), "{e}");
    }
}
