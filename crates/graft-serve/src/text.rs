//! Tokens to text as they arrive: incremental detokenization (text is released only once
//! its bytes are whole characters) and stop strings (text that could still begin one is
//! held back, and a match ends the text before it).

use tokenizers::Tokenizer;

/// The text of a growing sequence of tokens, released piece by piece.
#[derive(Debug, Default)]
pub(crate) struct Detokenizer {
    ids: Vec<u32>,
    /// Where the window decoded for context starts.
    prefix: usize,
    /// Tokens whose text was released.
    read: usize,
}

/// A decoding failure (the tokenizer's own error).
pub(crate) type DecodeError = tokenizers::Error;

impl Detokenizer {
    /// Adds `token`; returns the text it completes (empty while its bytes end inside a
    /// character). Decoding a window rather than the token alone keeps the spaces and
    /// merges that depend on the tokens before it.
    pub(crate) fn push(&mut self, t: &Tokenizer, token: u32) -> Result<String, DecodeError> {
        self.ids.push(token);
        let before = self.decode(t, self.prefix, self.read)?;
        let now = self.decode(t, self.prefix, self.ids.len())?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(now[before.len()..].to_string());
        }
        Ok(String::new())
    }

    /// The text not yet released (incomplete characters as U+FFFD).
    pub(crate) fn finish(&mut self, t: &Tokenizer) -> Result<String, DecodeError> {
        let before = self.decode(t, self.prefix, self.read)?;
        let now = self.decode(t, self.prefix, self.ids.len())?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }

    fn decode(&self, t: &Tokenizer, from: usize, to: usize) -> Result<String, DecodeError> {
        t.decode(&self.ids[from..to], true)
    }
}

/// What [`StopText::push`] gives.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Released {
    /// Text safe to send.
    pub(crate) text: String,
    /// Whether a stop string matched: the text ends before it, and nothing follows.
    pub(crate) stopped: bool,
}

/// Text checked against stop strings as it grows.
#[derive(Debug)]
pub(crate) struct StopText {
    stops: Vec<String>,
    /// Text received but held back: it could be the start of a stop string.
    held: String,
}

impl StopText {
    /// Empty stop strings are ignored.
    pub(crate) fn new(stops: Vec<String>) -> StopText {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopText {
            stops,
            held: String::new(),
        }
    }

    /// Whether there are no stop strings.
    pub(crate) fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Adds `piece`; returns what may be released.
    pub(crate) fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.held.truncate(at);
            return Released {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        // Keep the longest end of the text that begins a stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| longest_overlap(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// The held text, once the sequence ended without a match.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest proper prefix of `stop` that `text` ends with (on character
/// boundaries of both).
fn longest_overlap(text: &str, stop: &str) -> usize {
    stop.char_indices()
        .map(|(i, _)| i)
        .skip(1)
        .filter(|&n| text.ends_with(&stop[..n]))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = s.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_over_pieces_ends_the_text_before_it() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D more"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["xy", "b"], &["a", "b", "xy"]), ("a".into(), true));
    }

    #[test]
    fn a_near_miss_is_released_whole() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "d"]),
            ("abc ENd".into(), false)
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a"]), ("a".into(), false));
    }

    #[test]
    fn held_text_is_never_released_before_it_is_safe() {
        let mut s = StopText::new(vec!["éé".into()]);
        assert_eq!(s.push("aé").text, "a");
        assert_eq!(s.push("x").text, "éx");
    }
}
