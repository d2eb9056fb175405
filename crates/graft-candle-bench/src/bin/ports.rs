//! graft-candle-ports: the speedup of graft-candle's ports over candle-transformers' own eager
//! models, per decode step at batch 1, 8 and 32, for a small and a ~1B config of each
//! architecture (bf16; Q4_K for the GGUF Llama; for the mixtures of experts, Mixtral,
//! Qwen3-MoE and Qwen2-MoE with its shared expert, ~1B parameters active per token), all in one
//! run on one GPU.
//!
//! Both load the same random checkpoint (safetensors tensors through one `VarBuilder`, or
//! one GGUF file). Each (architecture, size, batch) first decodes 64 greedy steps with both
//! from the same tokens and reports how many steps agree (in bf16 the two add in other orders,
//! so tokens may part; tests/gpu.rs checks equality in f32). Then both are timed from
//! position 5 + `--from` (0 by default; each round restarts at 0): each step is one call and
//! a synchronize of candle's stream, timed on the host; the two alternate in rounds; the
//! figure is the median step. candle's models attend over the positions so far, and so does
//! the port (its attention reads up to each position; its launch covers the whole static
//! cache, `--max-seq`, 256, so one recording serves them all).
//!
//! usage: graft-candle-ports [--steps N] [--rounds R] [--only NAME] [--skip-1b] [--skip-small]
//!                           [--from P] [--max-seq S] [--block-size N] [--skip-eager] [--per-op] [--no-pdl]
//!                           [--profile-steps N] [--json PATH]

#[path = "ports/overlap.rs"]
mod overlap;

use std::collections::HashMap;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, gguf_file};
use candle_core::{D, DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as ct;
use graft_candle::{Buckets, CandleGraft, StepId};
use graft_candle_bench::common::{BUCKETS, BenchResult, Timing, median};
use graft_candle_bench::decode::{CHECK_STEPS, first_tokens};
use graft_candle_models::{
    Decoder, DecoderSpec, KvCache, checkpoint, llama, mistral, mixtral, quantized_llama, qwen2,
    qwen2_moe, qwen3, qwen3_moe,
};

/// The benchmark's flags.
#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-ports",
    about = "graft-candle's ports against candle-transformers' eager models"
)]
struct Options {
    /// Timed steps per variant and batch (split over the rounds).
    #[arg(long, default_value_t = 150)]
    steps: usize,
    #[command(flatten)]
    timing: Timing,
    /// Untimed steps before each round's timed ones, so that those run at positions `from +
    /// 5` on (the decode step's attention grows with the position; a round starts at 0).
    #[arg(long, default_value_t = 0)]
    from: usize,
    /// Positions of the port's static cache.
    #[arg(long, default_value_t = 256)]
    max_seq: usize,
    /// Only the architectures whose name contains one of these, comma-separated (llama,
    /// mistral, qwen2, qwen3, q4k, mixtral, qwen3moe, qwen2moe).
    #[arg(long)]
    only: Option<String>,
    /// Leave out the ~1B configs.
    #[arg(long)]
    skip_1b: bool,
    /// Leave out the small configs.
    #[arg(long)]
    skip_small: bool,
    /// Run the ports' decode steps op by op, not as graft-candle-kernels' one chain of
    /// kernels (`Decoder::set_chained_step(false)`).
    #[arg(long)]
    per_op: bool,
    /// Launch the chain's kernels plainly, with full edges between them, not as programmatic
    /// dependents (`graft_candle_kernels::set_programmatic(false)`).
    #[arg(long)]
    no_pdl: bool,
    /// Put the port's cache in pages of this many positions (`Decoder::new_paged_cache`, each
    /// sequence's blocks strided over the cache) instead of static rows: the paged decode
    /// step against the static one.
    #[arg(long)]
    block_size: Option<usize>,
    /// Time graft-candle's steps only, not candle-transformers' (which would take every
    /// `--from` step eagerly first); the token check still runs.
    #[arg(long)]
    skip_eager: bool,
    /// After each batch's timing, this many more graft steps (from position `--from`) inside a
    /// CUDA profiler range, for `ncu --profile-from-start off`: the replayed step's kernels
    /// alone.
    #[arg(long, default_value_t = 0)]
    profile_steps: usize,
}

/// candle-transformers' own model, eager.
enum Theirs {
    Llama(
        ct::llama::Llama,
        ct::llama::Config,
        Option<ct::llama::Cache>,
    ),
    Mistral(ct::mistral::Model),
    Qwen2(ct::qwen2::ModelForCausalLM),
    Qwen3(ct::qwen3::ModelForCausalLM),
    Quantized(ct::quantized_llama::ModelWeights),
    /// The model, and what remakes it (it has no way to clear its cache).
    Mixtral(ct::mixtral::Model, ct::mixtral::Config, VarBuilder<'static>),
    Qwen3Moe(ct::qwen3_moe::ModelForCausalLM),
    Qwen2Moe(ct::qwen2_moe::Model),
}

impl Theirs {
    /// Forgets every sequence (the next step is at position 0).
    fn reset(&mut self, dtype: DType, device: &Device) -> BenchResult<()> {
        match self {
            Theirs::Llama(_, cfg, cache) => {
                *cache = Some(ct::llama::Cache::new(true, dtype, cfg, device)?)
            }
            Theirs::Mistral(m) => m.clear_kv_cache(),
            Theirs::Qwen2(m) => m.clear_kv_cache(),
            Theirs::Qwen3(m) => m.clear_kv_cache(),
            Theirs::Qwen3Moe(m) => m.clear_kv_cache(),
            Theirs::Qwen2Moe(m) => m.clear_kv_cache(),
            Theirs::Mixtral(m, cfg, vb) => *m = ct::mixtral::Model::new(cfg, vb.clone())?,
            // Its step at position 0 starts over.
            Theirs::Quantized(_) => {}
        }
        Ok(())
    }

    /// One greedy step: `tokens` `[batch]` in, the next tokens out.
    fn step(&mut self, tokens: &Tensor, pos: usize) -> BenchResult<Tensor> {
        let x = tokens.unsqueeze(1)?;
        let logits = match self {
            Theirs::Llama(m, _, cache) => {
                m.forward(&x, pos, cache.as_mut().ok_or("reset first")?)?
            }
            Theirs::Mistral(m) => m.forward(&x, pos)?,
            Theirs::Qwen2(m) => m.forward(&x, pos)?,
            Theirs::Qwen3(m) => m.forward(&x, pos)?,
            Theirs::Quantized(m) => m.forward(&x, pos)?,
            Theirs::Mixtral(m, ..) => m.forward(&x, pos)?,
            Theirs::Qwen3Moe(m) => m.forward(&x, pos)?,
            Theirs::Qwen2Moe(m) => m.forward(&x, pos)?,
        };
        Ok(logits.flatten_from(1)?.argmax(D::Minus1)?)
    }
}

/// An architecture at one size.
struct Case {
    name: String,
    theirs: Theirs,
    ours: Decoder,
    dtype: DType,
}

fn json_config<T: serde::de::DeserializeOwned>(json: &str) -> BenchResult<T> {
    Ok(serde_json::from_str(json)?)
}

/// `spec`'s random weights on `device` as one `VarBuilder` both models load from.
fn weights(spec: &DecoderSpec, dtype: DType, device: &Device) -> BenchResult<VarBuilder<'static>> {
    let w: HashMap<String, Tensor> = checkpoint::random_weights(spec, 11, dtype, device)?;
    Ok(VarBuilder::from_tensors(w, dtype, device))
}

/// Sizes: (hidden, intermediate, layers, heads, kv_heads, vocab).
fn sizes(big: bool) -> (usize, usize, usize, usize, usize, usize) {
    if big {
        (2048, 8192, 16, 32, 8, 32_000)
    } else {
        (512, 1536, 4, 8, 4, 8192)
    }
}

/// Mixture-of-experts sizes: (experts, per token, expert width, shared expert width).
/// Mixtral's: 8 experts, 2 per token, wide; Qwen3-MoE's: many narrow ones; Qwen2-MoE's: fewer,
/// with a shared expert. The ~1B configs read about 1B parameters per token
/// (`DecoderSpec::active_parameters`).
fn experts(arch: &str, big: bool) -> (usize, usize, usize, usize) {
    match (arch, big) {
        ("mixtral", false) => (8, 2, 1536, 0),
        ("mixtral", true) => (8, 2, 4096, 0),
        ("qwen2moe", false) => (16, 4, 384, 1536),
        ("qwen2moe", true) => (32, 4, 1024, 2816),
        (_, false) => (16, 4, 384, 0),
        (_, true) => (64, 8, 768, 0),
    }
}

fn case(arch: &str, big: bool, device: &Device) -> BenchResult<Case> {
    let (d, f, layers, heads, kv, vocab) = sizes(big);
    let (n_experts, top_k, expert_f, shared_f) = experts(arch, big);
    let f = if arch == "mixtral" { expert_f } else { f };
    let common = format!(
        r#""hidden_size": {d}, "intermediate_size": {f}, "vocab_size": {vocab}, "num_hidden_layers": {layers},
           "num_attention_heads": {heads}, "num_key_value_heads": {kv}, "max_position_embeddings": 4096"#
    );
    let size = if big { "~1B" } else { "small" };
    let bf16 = DType::BF16;
    let (theirs, ours, dtype) = match arch {
        "llama" => {
            let cfg: ct::llama::LlamaConfig = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
                    "rope_scaling": {{"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}}}}"#
            ))?;
            let cfg = cfg.into_config(false);
            let vb = weights(&llama::spec(&cfg), bf16, device)?;
            let theirs =
                Theirs::Llama(ct::llama::Llama::load(vb.clone(), &cfg)?, cfg.clone(), None);
            (theirs, llama::load(vb, &cfg)?, bf16)
        }
        "mistral" => {
            let cfg: ct::mistral::Config = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096}}"#
            ))?;
            let vb = weights(&mistral::spec(&cfg), bf16, device)?;
            (
                Theirs::Mistral(ct::mistral::Model::new(&cfg, vb.clone())?),
                mistral::load(vb, &cfg)?,
                bf16,
            )
        }
        "qwen2" => {
            let cfg: ct::qwen2::Config = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 4096,
                    "max_window_layers": {layers}, "tie_word_embeddings": true, "use_sliding_window": false,
                    "hidden_act": "silu"}}"#
            ))?;
            let vb = weights(&qwen2::spec(&cfg, true), bf16, device)?;
            (
                Theirs::Qwen2(ct::qwen2::ModelForCausalLM::new(&cfg, vb.clone())?),
                qwen2::load(vb, &cfg)?,
                bf16,
            )
        }
        "qwen3" => {
            let cfg: ct::qwen3::Config = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": null,
                    "max_window_layers": {layers}, "tie_word_embeddings": true, "use_sliding_window": false,
                    "hidden_act": "silu", "head_dim": {}, "attention_bias": false}}"#,
                d / heads
            ))?;
            let vb = weights(&qwen3::spec(&cfg), bf16, device)?;
            (
                Theirs::Qwen3(ct::qwen3::ModelForCausalLM::new(&cfg, vb.clone())?),
                qwen3::load(vb, &cfg)?,
                bf16,
            )
        }
        "mixtral" => {
            let json = format!(
                r#"{{{common}, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": 4096,
                    "hidden_act": "silu", "num_experts_per_tok": {top_k}, "num_local_experts": {n_experts},
                    "use_flash_attn": false}}"#
            );
            let cfg: mixtral::Config = json_config(&json)?;
            let theirs_cfg: ct::mixtral::Config = json_config(&json)?;
            // f32: candle's Mixtral multiplies bf16 states by its f32 routing weights and
            // fails ("dtype mismatch in mul").
            let vb = weights(&mixtral::spec(&cfg), DType::F32, device)?;
            let model = ct::mixtral::Model::new(&theirs_cfg, vb.clone())?;
            (
                Theirs::Mixtral(model, theirs_cfg, vb.clone()),
                mixtral::load(vb, &cfg)?,
                DType::F32,
            )
        }
        "qwen3moe" => {
            let cfg: ct::qwen3_moe::Config = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": null,
                    "max_window_layers": {layers}, "tie_word_embeddings": true, "use_sliding_window": false,
                    "hidden_act": "silu", "head_dim": {}, "attention_bias": false, "decoder_sparse_step": 1,
                    "moe_intermediate_size": {expert_f}, "num_experts_per_tok": {top_k},
                    "num_experts": {n_experts}, "norm_topk_prob": true}}"#,
                d / heads
            ))?;
            let vb = weights(&qwen3_moe::spec(&cfg), bf16, device)?;
            (
                Theirs::Qwen3Moe(ct::qwen3_moe::ModelForCausalLM::new(&cfg, vb.clone())?),
                qwen3_moe::load(vb, &cfg)?,
                bf16,
            )
        }
        "qwen2moe" => {
            let cfg: ct::qwen2_moe::Config = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 4096,
                    "max_window_layers": {layers}, "tie_word_embeddings": false, "use_sliding_window": false,
                    "hidden_act": "silu", "decoder_sparse_step": 1, "moe_intermediate_size": {expert_f},
                    "shared_expert_intermediate_size": {shared_f}, "num_experts_per_tok": {top_k},
                    "num_experts": {n_experts}, "norm_topk_prob": false}}"#
            ))?;
            let vb = weights(&qwen2_moe::spec(&cfg), bf16, device)?;
            (
                Theirs::Qwen2Moe(ct::qwen2_moe::Model::new(&cfg, vb.clone())?),
                qwen2_moe::load(vb, &cfg)?,
                bf16,
            )
        }
        "q4k" => {
            let cfg: ct::llama::LlamaConfig = json_config(&format!(
                r#"{{{common}, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}}"#
            ))?;
            let spec = llama::spec(&cfg.into_config(false));
            let w = checkpoint::random_weights(&spec, 11, DType::F32, &Device::Cpu)?;
            let dir = std::env::temp_dir().join(format!("graft-ports-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let path = dir.join(format!("{size}.gguf"));
            checkpoint::write_gguf(&spec, &w, GgmlDType::Q4K, &path)?;
            drop(w);
            let mut file = std::fs::File::open(&path)?;
            let theirs = ct::quantized_llama::ModelWeights::from_gguf(
                gguf_file::Content::read(&mut file)?,
                &mut file,
                device,
            )?;
            let mut file = std::fs::File::open(&path)?;
            let ours =
                quantized_llama::load(&gguf_file::Content::read(&mut file)?, &mut file, device)?;
            std::fs::remove_dir_all(&dir)?;
            (Theirs::Quantized(theirs), ours, DType::F32)
        }
        other => return Err(format!("unknown architecture {other}").into()),
    };
    let params = ours.spec().parameters() as f64 / 1e6;
    let active = ours.spec().active_parameters() as f64 / 1e6;
    let active = if active < params {
        format!(", {active:.0} M active")
    } else {
        String::new()
    };
    Ok(Case {
        name: format!(
            "{arch} {size} ({params:.0} M parameters{active}{})",
            match (arch, dtype) {
                ("q4k", _) => ", Q4_K",
                (_, DType::F32) => ", f32",
                _ => ", bf16",
            }
        ),
        theirs,
        ours,
        dtype,
    })
}

/// One batch of one case: the steps on which the tokens agreed, and the two median steps
/// (candle-transformers' eager one `None` with `--skip-eager`).
struct Measured {
    agreed: usize,
    eager_us: Option<f64>,
    graft_us: f64,
}

fn ours_step(
    c: &Case,
    graft: &mut CandleGraft,
    step: StepId,
    cache: &KvCache,
    t: &Tensor,
) -> BenchResult<Tensor> {
    Ok(c.ours.decode(graft, step, cache, t)?.outputs.remove(0))
}

/// The port's cache for `rows` sequences: static rows, or with `--block-size` pages, sequence
/// r's j-th block being block `j * rows + r` (every sequence's blocks strided over the cache,
/// as a serving cache's end up).
fn port_cache(ours: &Decoder, rows: usize, o: &Options) -> BenchResult<KvCache> {
    let Some(size) = o.block_size else {
        return Ok(ours.new_cache(rows, o.max_seq)?);
    };
    let per_row = o.max_seq.div_ceil(size);
    let cache = ours.new_paged_cache(rows, o.max_seq, rows * per_row, size)?;
    for r in 0..rows {
        let blocks: Vec<u32> = (0..per_row).map(|j| (j * rows + r) as u32).collect();
        cache.set_blocks(r, &blocks)?;
    }
    Ok(cache)
}

/// `steps` graft steps from position 0, each timed to its synchronize after `untimed` (µs).
#[allow(clippy::too_many_arguments)]
fn time_graft(
    c: &Case,
    graft: &mut CandleGraft,
    step: StepId,
    cache: &KvCache,
    batch: usize,
    steps: usize,
    untimed: usize,
    device: &Device,
) -> BenchResult<Vec<f64>> {
    cache.reset()?;
    let mut t = first_tokens(batch, c.ours.spec().vocab, device)?;
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + untimed {
        let start = Instant::now();
        t = ours_step(c, graft, step, cache, &t)?;
        device.synchronize()?;
        if i >= untimed {
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(times)
}

fn measure(
    c: &mut Case,
    graft: &mut CandleGraft,
    step: StepId,
    cache: &KvCache,
    batch: usize,
    o: &Options,
    device: &Device,
) -> BenchResult<Measured> {
    let vocab = c.ours.spec().vocab;
    c.theirs.reset(c.dtype, device)?;
    cache.reset()?;
    let (mut a, mut b) = (
        first_tokens(batch, vocab, device)?,
        first_tokens(batch, vocab, device)?,
    );
    let mut agreed = 0;
    for pos in 0..CHECK_STEPS {
        a = c.theirs.step(&a, pos)?;
        b = ours_step(c, graft, step, cache, &b)?;
        if a.to_vec1::<u32>()? != b.to_vec1::<u32>()? {
            break;
        }
        agreed += 1;
    }
    let per_round = o.timing.per_round(o.steps)?;
    let (mut eager, mut ours) = (Vec::new(), Vec::new());
    let untimed = 5 + o.from;
    for _ in 0..o.timing.rounds {
        c.theirs.reset(c.dtype, device)?;
        let mut t = first_tokens(batch, vocab, device)?;
        for pos in 0..(per_round + untimed) * usize::from(!o.skip_eager) {
            let start = Instant::now();
            t = c.theirs.step(&t, pos)?;
            device.synchronize()?;
            if pos >= untimed {
                eager.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        ours.extend(time_graft(
            c, graft, step, cache, batch, per_round, untimed, device,
        )?);
    }
    if o.profile_steps > 0 {
        cache.reset()?;
        let mut t = first_tokens(batch, vocab, device)?;
        for _ in 0..o.from {
            t = ours_step(c, graft, step, cache, &t)?;
        }
        graft_candle_bench::profiler::profiled(|| {
            for _ in 0..o.profile_steps {
                t = ours_step(c, graft, step, cache, &t)?;
            }
            Ok(device.synchronize()?)
        })?;
    }
    Ok(Measured {
        agreed,
        eager_us: (!o.skip_eager).then(|| median(&mut eager)),
        graft_us: median(&mut ours),
    })
}

/// How many recordings each reason made, from graft's decision log.
fn record_reasons(g: &graft_candle::Diagnostics<'_>) -> String {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for d in g.explain() {
        if let graft_core::Decision::Record(reason) = &d.decision {
            match counts.iter_mut().find(|(name, _)| *name == reason.name()) {
                Some((_, n)) => *n += 1,
                None => counts.push((reason.name(), 1)),
            }
        }
    }
    let shown: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
    shown.join(", ")
}

fn main() {
    graft_candle_bench::common::exit_on_error("graft-candle-ports", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    if o.max_seq < CHECK_STEPS.max(o.timing.per_round(o.steps)? + 5 + o.from) {
        return Err("--max-seq must hold the checked and the timed steps".into());
    }
    let device = graft_candle_bench::common::gpu()?;
    let (mut rows, mut json) = (Vec::new(), Vec::new());
    let mut failed = false;
    println!(
        "decode step, candle-transformers eager against graft-candle's port; {} timed steps per variant in {} rounds (positions {} to {}), median; port cache {} positions",
        o.steps,
        o.timing.rounds,
        5 + o.from,
        4 + o.from + o.timing.per_round(o.steps)?,
        o.max_seq
    );
    graft_candle_kernels::set_programmatic(!o.no_pdl);
    for big in [false, true] {
        if (big && o.skip_1b) || (!big && o.skip_small) {
            continue;
        }
        for arch in [
            "llama", "mistral", "qwen2", "qwen3", "q4k", "mixtral", "qwen3moe", "qwen2moe",
        ] {
            if o.only
                .as_deref()
                .is_some_and(|only| !only.split(',').any(|name| arch.contains(name)))
            {
                continue;
            }
            let started = Instant::now();
            let mut c = match case(arch, big, &device) {
                Ok(c) => c,
                Err(e) => {
                    failed = true;
                    rows.push(format!("{arch} big={big}: loading failed: {e}"));
                    println!("{}", rows.last().map_or("", String::as_str));
                    continue;
                }
            };
            c.ours.set_chained_step(!o.per_op);
            println!(
                "{} (loaded in {:.1} s)",
                c.name,
                started.elapsed().as_secs_f64()
            );
            // A decision log long enough for every non-replay of the case.
            let config = graft_core::Config {
                decision_log: 4096,
                ..graft_core::Config::default()
            };
            // The earlier cases' graphs are gone: give their memory back, so the figure below
            // is this case's.
            graft_candle::cuda::trim_graph_memory(device.as_cuda_device()?)?;
            let mut graft = CandleGraft::with_config(&device, config)?;
            let step = graft.register_bucketed("decode", Buckets::new(BUCKETS)?);
            let cache = port_cache(&c.ours, *BUCKETS.last().unwrap_or(&1), &o)?;
            for batch in BUCKETS {
                let row = match measure(&mut c, &mut graft, step, &cache, batch, &o, &device) {
                    Ok(m) => {
                        // Without the eager timing: null in the JSON, "skipped" in the row.
                        let (eager, speedup, eager_row) = match m.eager_us {
                            Some(e) => (
                                format!("{e:.1}"),
                                format!("{:.3}", e / m.graft_us),
                                format!(
                                    "eager {e:9.1} us   graft-candle {:9.1} us   eager/graft {:5.2}x",
                                    m.graft_us,
                                    e / m.graft_us
                                ),
                            ),
                            None => (
                                "null".to_string(),
                                "null".to_string(),
                                format!("eager skipped   graft-candle {:9.1} us", m.graft_us),
                            ),
                        };
                        json.push(format!(
                            "{{\"model\":\"{}\",\"batch\":{batch},\"eager_us\":{eager},\"graft_us\":{:.1},\"speedup\":{speedup},\"tokens_agreed\":{}}}",
                            c.name, m.graft_us, m.agreed
                        ));
                        format!(
                            "{:<44} B={batch:<3} {eager_row}   tokens agree {}/{CHECK_STEPS} steps",
                            c.name, m.agreed
                        )
                    }
                    Err(e) => {
                        failed = true;
                        format!("{} B={batch}: failed: {e}", c.name)
                    }
                };
                println!("{row}");
                rows.push(row);
            }
            if c.ours.spec().moe.is_some_and(|m| m.shared.is_some()) {
                match overlap::overlap(&mut c, &cache, &o, &device) {
                    Ok(medians) => {
                        for (batch, (side, one)) in BUCKETS.iter().zip(medians) {
                            let row = format!(
                                "{:<44} B={batch:<3} shared expert on a side stream {side:9.1} us, on the device stream {one:9.1} us: {:5.3}x",
                                c.name,
                                one / side
                            );
                            json.push(format!(
                                "{{\"model\":\"{}\",\"batch\":{batch},\"side_stream_us\":{side:.1},\"one_stream_us\":{one:.1}}}",
                                c.name
                            ));
                            println!("{row}");
                            rows.push(row);
                        }
                    }
                    Err(e) => {
                        failed = true;
                        rows.push(format!("{}: the overlap timing failed: {e}", c.name));
                    }
                }
            }
            if let Some(g) = graft.graft() {
                let s = g.stats();
                println!(
                    "  graft: {} recordings, {} replays, {} warmups, {} eager; recordings by reason: {}",
                    s.recordings,
                    s.replays,
                    s.warmups,
                    s.eager_runs,
                    record_reasons(&g)
                );
                // Kernels of each recorded step, by bucket (`keys[0]`).
                let kernels: Vec<String> = g
                    .nodes()
                    .iter()
                    .map(|n| format!("B={}: {}", n.keys.first().unwrap_or(&0), n.graph.kernels))
                    .collect();
                println!("  kernels per step: {}", kernels.join(", "));
                // What the recordings of every bucket hold (activations; the weights and the
                // cache are the caller's).
                let memory = graft_candle::cuda::graph_memory(device.as_cuda_device()?)?;
                println!(
                    "  graph memory: {:.1} MiB mapped for the recordings of {} buckets",
                    memory.mapped_current as f64 / (1 << 20) as f64,
                    BUCKETS.len()
                );
            }
        }
    }
    println!("\nsummary:");
    for row in &rows {
        println!("  {row}");
    }
    o.timing.write_json(&json)?;
    if failed {
        return Err("a case failed (see above)".into());
    }
    Ok(())
}
