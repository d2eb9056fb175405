//! What graft-candle's benchmarks share: the buckets, the flags every timed benchmark takes
//! (rounds, JSON output) and the median.

use graft_candle::candle_core::Device;

pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// A benchmark binary's `main`: runs `run`, and on failure prints the error after the
/// binary's `name` and exits with status 1.
pub fn exit_on_error(name: &str, run: impl FnOnce() -> BenchResult<()>) {
    if let Err(e) = run() {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

/// The GPU a benchmark runs on: graft-candle's device 0, or an error saying there is none.
pub fn gpu() -> BenchResult<Device> {
    graft_candle::device(0).map_err(|e| format!("no CUDA GPU for the benchmark: {e}").into())
}

/// The batch sizes measured (and, for decoding, the buckets the step is registered with).
pub const BUCKETS: [usize; 3] = [1, 8, 32];

/// The flags of every timed benchmark (flattened into each binary's own): how the timed work
/// is split and where the results go.
#[derive(clap::Args, Debug)]
pub struct Timing {
    /// Rounds the variants alternate in.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<String>,
}

impl Timing {
    /// The timed steps of each round when `steps` (the binary's `--steps` or `--launches`) are
    /// split over `--rounds`: an error unless every round gets at least one.
    pub fn per_round(&self, steps: usize) -> BenchResult<usize> {
        if self.rounds == 0 || steps < self.rounds {
            return Err("--rounds must be at least 1 and the timed steps at least --rounds".into());
        }
        Ok(steps / self.rounds)
    }

    /// Writes `rows` (JSON objects) as a JSON array to `--json`, if given.
    pub fn write_json(&self, rows: &[String]) -> BenchResult<()> {
        if let Some(path) = &self.json {
            std::fs::write(path, format!("[\n  {}\n]\n", rows.join(",\n  ")))?;
            println!("wrote {path}");
        }
        Ok(())
    }
}

/// The median of `samples` (sorted in place).
pub fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
