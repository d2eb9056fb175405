//! `graft bench tp --procs 2 --sim` with the raw-graph baselines. The job's ranks are copies of
//! the running executable (`tp_procs`), so this test executable (`harness = false`) is their
//! program too: started as a rank (`--as-rank`) it runs the `graft` command line with
//! graft-core's token, as the `graft-baselines` bench does; otherwise it runs the test.
//! libtest's arguments (a filter, `--include-ignored`, `--test-threads`) are accepted and
//! ignored.

use std::process::ExitCode;

use clap::Parser;
use graft_cli::Cli;
use graft_core::backend::CoreOnly;

/// The token of the raw graphs' sealed capture and launch calls.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const NAME: &str = "tensor_parallel_benchmark_runs_as_processes_with_raw_graphs";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--as-rank") {
        return graft_cli::main(args, Some(CORE));
    }
    if args.iter().any(|a| a == "--list") {
        println!("{NAME}: test");
        return ExitCode::SUCCESS;
    }
    println!("\nrunning 1 test");
    tensor_parallel_benchmark_runs_as_processes_with_raw_graphs();
    println!("test {NAME} ... ok\n");
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
    ExitCode::SUCCESS
}

/// Two processes (votes and all-reduces over TCP) whose tokens match the same ranks as
/// threads, eagerly, through graft and as raw graphs.
fn tensor_parallel_benchmark_runs_as_processes_with_raw_graphs() {
    let line = "graft bench tp --procs 2 --sim --batches 1,8 --check 6 --steps 2 --rounds 1 --procs-timeout 120";
    let cli = Cli::try_parse_from(line.split_whitespace()).expect("the command line parses");
    let mut out = Vec::new();
    graft_cli::run_with(cli, Some(CORE), &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
    let report = String::from_utf8(out).unwrap();
    assert!(
        report.contains("as 2 processes, one per simulated device, voting over TCP"),
        "{report}"
    );
    assert!(
        report.contains("tokens: every process = every thread = eager = raw graph"),
        "{report}"
    );
    assert!(report.contains("| 8 | pipelined |"), "{report}");
}
