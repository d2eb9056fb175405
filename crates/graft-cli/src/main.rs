//! The `graft` binary: parses the command line and runs it (the logic lives in the library).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = graft_cli::Cli::parse();
    let mut out = std::io::stdout().lock();
    match graft_cli::run(cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            drop(out);
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
