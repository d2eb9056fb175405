//! The progress bar of long runs: drawn on stderr, hidden when stdout is not a terminal (a
//! redirected report stays clean) and when asked.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over `len` steps, or a hidden one when stdout is not a terminal.
pub(crate) fn bar(len: u64) -> ProgressBar {
    let target = if std::io::stdout().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg}") {
        bar.set_style(style);
    }
    bar
}
