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

/// A Llama of candle-transformers' config with random weights (seed 11) in `dtype` on
/// `device`: the ~1B shape and config of graft-candle-ports' Llama (d = 2048, 16 layers, 32 / 8
/// heads, ffn 8192, vocab 32,000, tied embeddings, Llama 3's rope) when `big`, else a small
/// one (d = 512, 4 layers, 8 / 4 heads, ffn 1408).
pub fn random_llama(
    big: bool,
    dtype: graft_candle::candle_core::DType,
    device: &Device,
) -> BenchResult<graft_candle_models::Decoder> {
    let (cfg, weights) = random_llama_weights(big, dtype, device)?;
    load_llama(&cfg, weights, dtype, device)
}

/// [`random_llama`]'s config and weights, by checkpoint name.
pub fn random_llama_weights(
    big: bool,
    dtype: graft_candle::candle_core::DType,
    device: &Device,
) -> BenchResult<(
    candle_transformers::models::llama::Config,
    std::collections::HashMap<String, graft_candle::candle_core::Tensor>,
)> {
    use graft_candle_models::{checkpoint, llama};
    let (d, f, layers, heads, kv) = if big {
        (2048, 8192, 16, 32, 8)
    } else {
        (512, 1408, 4, 8, 4)
    };
    let cfg: candle_transformers::models::llama::LlamaConfig = serde_json::from_str(&format!(
        r#"{{"vocab_size": 32000, "hidden_size": {d}, "intermediate_size": {f},
        "num_hidden_layers": {layers}, "num_attention_heads": {heads}, "num_key_value_heads": {kv},
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": true, "rope_scaling": {{"factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}}}"#
    ))?;
    let cfg = cfg.into_config(false);
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 11, dtype, device)?;
    Ok((cfg, weights))
}

/// A Llama of `cfg` over `weights` (by checkpoint name; tensors its layers do not name are
/// left out, and the ones it takes are shared, not copied).
pub fn load_llama(
    cfg: &candle_transformers::models::llama::Config,
    weights: std::collections::HashMap<String, graft_candle::candle_core::Tensor>,
    dtype: graft_candle::candle_core::DType,
    device: &Device,
) -> BenchResult<graft_candle_models::Decoder> {
    let vb = candle_nn::VarBuilder::from_tensors(weights, dtype, device);
    Ok(graft_candle_models::llama::load(vb, cfg)?)
}
