//! `graft` with the raw-graph baselines: the `graft` command line, run with graft-core's token
//! for tests and benchmarks, so that `graft bench`, `bench micro`, `bench update`, `bench tp`
//! (whose `--procs` ranks are copies of this executable) and the demo also capture the same
//! work as a plain graph and launch it raw, and print the tree/raw ratios. The `graft` binary
//! has no token and leaves those columns out.
//!
//! ```text
//! cargo bench -p graft-cli --bench graft-baselines -- bench micro
//! stage/bin/graft-baselines bench tp --procs 2        (staged by scripts/stage.sh)
//! ```
//!
//! cargo passes `--bench`, which is dropped; without a command (a plain `cargo bench`) it only
//! says how to use it.

use std::process::ExitCode;

use graft_core::backend::CoreOnly;

/// The token of the device's sealed capture, launch and copy calls the baselines make.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    if args.len() < 2 {
        println!(
            "graft-baselines: give a graft command line, e.g. `cargo bench -p graft-cli --bench graft-baselines -- bench micro`"
        );
        return ExitCode::SUCCESS;
    }
    graft_cli::main(args, Some(CORE))
}
