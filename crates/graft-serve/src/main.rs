//! `graft-serve`: serve a model directory (or a GGUF file) over OpenAI's HTTP API, or write a
//! random model directory to try it with.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use candle_core::DType;
use clap::{Parser, Subcommand, ValueEnum};
use graft_serve::random_model::{Preset, write_random_model};
use graft_serve::{ServeOptions, Server};

#[derive(Parser, Debug)]
#[command(
    name = "graft-serve",
    about = "An OpenAI-compatible server over graft's graphed engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a Hugging Face model directory or a GGUF file.
    Serve {
        /// The model: a directory with config.json, the safetensors and tokenizer.json, or a
        /// .gguf file with tokenizer.json beside it.
        #[arg(long)]
        model: PathBuf,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// Port to listen on (0: any free one, printed).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Weights and activations (default: bf16 on a GPU, f32 on the CPU).
        #[arg(long)]
        dtype: Option<Dtype>,
        /// Positions per sequence, prompt and output (default: the model's context, at most
        /// 4,096).
        #[arg(long)]
        max_seq: Option<usize>,
        /// Sequences decoding at once (default: 8 on the CPU; on a GPU what memory holds, at
        /// most 64).
        #[arg(long)]
        max_batch: Option<usize>,
        /// Requests that may wait beyond the running ones; more are answered 429.
        #[arg(long, default_value_t = 256)]
        max_queue: usize,
        /// Run every step eagerly with candle (the baseline), not under graft.
        #[arg(long)]
        eager: bool,
        /// Speculative decoding with prompt lookup, up to N drafts a sequence a pass, of every
        /// running sequence (the same tokens as without it).
        #[arg(long, value_name = "N")]
        speculate: Option<usize>,
    },
    /// Generate greedily for a trace of requests (scripts/serve_load.py --dump-trace) all at
    /// once, through the server's engine without HTTP; prints the throughput as JSON.
    Offline {
        /// The model, as for `serve`.
        #[arg(long)]
        model: PathBuf,
        /// The trace: a JSON list of {"prompt": [token ids], "max_tokens": n}.
        #[arg(long)]
        trace: PathBuf,
        /// As for `serve`.
        #[arg(long)]
        dtype: Option<Dtype>,
        /// As for `serve`.
        #[arg(long)]
        max_seq: Option<usize>,
        /// As for `serve`.
        #[arg(long)]
        max_batch: Option<usize>,
        /// As for `serve`.
        #[arg(long)]
        eager: bool,
        /// As for `serve`.
        #[arg(long, value_name = "N")]
        speculate: Option<usize>,
        /// Runs of the trace before the timed one (the first run after a start pays for
        /// lazily loaded kernels and the clocks' ramp).
        #[arg(long, default_value_t = 1)]
        warmup: usize,
    },
    /// Write a Llama model directory with random weights and a byte-level tokenizer.
    RandomModel {
        /// The directory to write.
        #[arg(long)]
        out: PathBuf,
        /// Its size.
        #[arg(long, value_enum, default_value_t = Preset::Tiny)]
        preset: Preset,
        /// The weights' dtype.
        #[arg(long, value_enum, default_value_t = Dtype::F32)]
        dtype: Dtype,
        /// The weights' seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// A dtype on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl From<Dtype> for DType {
    fn from(d: Dtype) -> DType {
        match d {
            Dtype::F32 => DType::F32,
            Dtype::Bf16 => DType::BF16,
            Dtype::F16 => DType::F16,
        }
    }
}

fn main() -> ExitCode {
    // Spans report their time when they close (warmups, recordings: RUST_LOG=debug).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("graft-serve: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::RandomModel {
            out,
            preset,
            dtype,
            seed,
        } => {
            write_random_model(&out, preset, dtype.into(), seed)?;
            println!(
                "graft-serve: wrote a random {preset:?} model to {}",
                out.display()
            );
            Ok(())
        }
        Command::Offline {
            model,
            trace,
            dtype,
            max_seq,
            max_batch,
            eager,
            speculate,
            warmup,
        } => {
            #[derive(serde::Deserialize)]
            struct Traced {
                prompt: Vec<u32>,
                max_tokens: usize,
            }
            let trace: Vec<Traced> = serde_json::from_slice(&std::fs::read(&trace)?)?;
            let requests: Vec<(Vec<u32>, usize)> = trace
                .into_iter()
                .map(|t| (t.prompt, t.max_tokens))
                .collect();
            let options = ServeOptions {
                model,
                dtype: dtype.map(Into::into),
                max_seq,
                max_batch,
                max_queue: requests.len(),
                eager,
                speculate,
            };
            let server = Server::start(&options, &device()?)?;
            for _ in 0..warmup {
                server.generate(&requests)?;
            }
            let started = std::time::Instant::now();
            let tokens: usize = server.generate(&requests)?.iter().map(Vec::len).sum();
            let wall_s = started.elapsed().as_secs_f64();
            let figures = serde_json::json!({
                "requests": requests.len(), "tokens": tokens, "wall_s": wall_s,
                "tokens_per_s": tokens as f64 / wall_s, "eager": eager, "speculate": speculate,
            });
            println!("{figures}");
            Ok(())
        }
        Command::Serve {
            model,
            host,
            port,
            dtype,
            max_seq,
            max_batch,
            max_queue,
            eager,
            speculate,
        } => {
            let device = device()?;
            let options = ServeOptions {
                model,
                dtype: dtype.map(Into::into),
                max_seq,
                max_batch,
                max_queue,
                eager,
                speculate,
            };
            // The port first: a taken port fails at once, not after the model loads.
            let listener = std::net::TcpListener::bind(SocketAddr::new(host, port))?;
            listener.set_nonblocking(true)?;
            let server = Server::start(&options, &device)?;
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                println!(
                    "graft-serve: serving {} on http://{} ({} sequences, ready in {:.1} s); Ctrl-C stops",
                    server.model_name(),
                    listener.local_addr()?,
                    server.sequences,
                    server.ready_s
                );
                let shutdown = async {
                    let _ = tokio::signal::ctrl_c().await;
                    println!("graft-serve: stopping: finishing the requests in flight");
                };
                server.serve(listener, shutdown).await?;
                Ok(())
            })
        }
    }
}

/// The GPU when there is one, else the CPU.
fn device() -> Result<candle_core::Device, candle_core::Error> {
    graft_candle::device(0).or_else(|e| {
        tracing::warn!(error = %e, "no CUDA device: serving on the CPU");
        Ok(candle_core::Device::Cpu)
    })
}
