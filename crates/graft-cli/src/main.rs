//! The `graft` binary: parses the command line and runs it (the logic lives in the library),
//! without the raw-graph baselines (see the library's documentation).

use std::process::ExitCode;

fn main() -> ExitCode {
    graft_cli::main(std::env::args(), None)
}
