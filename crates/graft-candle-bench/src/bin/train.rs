//! graft-candle-train: the Llama port's training step (forward, backward, AdamW) on the
//! GPU, at batch 1, 8 and 32 and sequence 128, in one run: candle eager, graft-candle with
//! one graph per step, graft-candle with the step as a path of two nodes (forward and
//! backward into gradient sums, then the update), and a hand-made single graph of the step.
//!
//! Before timing, 3 steps of graft-candle from a fresh model are checked equal to eager's
//! bit for bit (losses and parameters). Memory: eager's peak above what the model and its
//! optimizer hold (the default pool's high-water mark), against the graph memory each graphed
//! variant adds (the driver's graph memory, plus graft's pool). Each timed step is one call
//! and a synchronize, variants alternate in rounds, and the figure is the median.
//!
//! `--kernels fused,autograd,unfused,mixed` measures the model with graft-candle-kernels'
//! fused training ops and the explicit backward program (the default), with the same ops
//! under candle's autograd, with candle's unfused ops (the reference), and in bf16 mixed
//! precision (f32 masters, bf16 working copies, `AdamW::mixed`; the default otherwise f32).
//!
//! usage: graft-candle-train [--steps N] [--rounds R] [--seq S] [--models LIST] [--batches LIST] [--guards]
//! [--kernels LIST] [--json PATH]

#[path = "train/guards.rs"]
mod guards;

use std::time::Instant;

use graft_candle::candle_core::{DType, Device, Tensor};
use graft_candle::cuda::{eager_memory, graph_memory, reset_eager_high, trim_graph_memory};
use graft_candle::{CandleGraft, StepId};
use graft_candle_bench::HandmadeGraph;
use graft_candle_bench::common::{BenchResult, Timing, median};
use graft_candle_models::SequenceKernels;
use graft_candle_models::llama::Sizes;
use graft_candle_train::optim::{AdamW, AdamWConfig, GradAccumulator};
use graft_candle_train::{Backward, Trainable};
use graft_core::{FunctionSpec, Mode};

/// The benchmark's flags.
#[derive(clap::Parser, Debug)]
#[command(
    name = "graft-candle-train",
    about = "A candle training step: eager, graft-candle (one graph or a path), a hand-made graph"
)]
struct Options {
    /// Timed steps per variant (split over the rounds).
    #[arg(long, default_value_t = 60)]
    steps: usize,
    #[command(flatten)]
    timing: Timing,
    /// Sequence length.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// The models, comma-separated: bench (4 layers at d=512), large (8 layers at d=1024,
    /// ~150M parameters) and gpt2-124m (GPT-2 124M's sizes as Llama blocks, llm.c's anchor:
    /// 12 layers, d=768, vocab 50304, the head tied to the embedding; llm.c trains it at
    /// `--seq 1024`).
    #[arg(long, value_delimiter = ',', default_value = "bench")]
    models: Vec<Model>,
    /// The batches, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Also measure guards on the benchmark model: a guarded call of the step against its
    /// replay, and candle-nn's AdamW (host bias corrections and rate, so every call of it
    /// captures once a guard found them) under graft-candle against eager.
    #[arg(long)]
    guards: bool,
    /// The model's kernels, comma-separated: fused (graft-candle-kernels' training ops and the
    /// explicit backward program, f32, the default), autograd (the same ops, gradients by
    /// candle's autograd), unfused (candle's elementwise ops) and mixed (fused, in bf16 mixed
    /// precision: f32 masters, bf16 copies).
    #[arg(long, value_delimiter = ',', default_value = "fused")]
    kernels: Vec<Kernels>,
    /// Instead of measuring: this many replayed steps of the last of `--models` with the
    /// first `--kernels` at batch
    /// `--profile-batch`, inside a profiled range (`ncu --profile-from-start off` sees only
    /// their kernels; scripts/ncu_step.py sums them).
    #[arg(long, default_value_t = 0)]
    profile_steps: usize,
    /// The batch of `--profile-steps`.
    #[arg(long, default_value_t = 1)]
    profile_batch: usize,
}

/// `--models`' values.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Model {
    Bench,
    Large,
    #[value(name = "gpt2-124m")]
    Gpt2_124m,
}

impl Model {
    fn name(self) -> &'static str {
        match self {
            Model::Bench => "bench",
            Model::Large => "large",
            Model::Gpt2_124m => "gpt2-124m",
        }
    }

    /// The model's sizes at sequence `seq`.
    fn sizes(self, seq: usize) -> Sizes {
        let sizes = match self {
            Model::Bench => Sizes::BENCH,
            Model::Large => Sizes {
                layers: 8,
                hidden: 1024,
                heads: 16,
                kv_heads: 8,
                intermediate: 2816,
                vocab: 16384,
                ..Sizes::BENCH
            },
            Model::Gpt2_124m => Sizes::GPT2_124M,
        };
        Sizes {
            max_positions: seq,
            ..sizes
        }
    }
}

/// `--kernels`' values.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Kernels {
    Fused,
    Autograd,
    Unfused,
    Mixed,
}

impl Kernels {
    fn of(self) -> (SequenceKernels, Backward) {
        match self {
            Kernels::Fused | Kernels::Mixed => (SequenceKernels::Fused, Backward::Explicit),
            Kernels::Autograd => (SequenceKernels::Fused, Backward::Autograd),
            Kernels::Unfused => (SequenceKernels::Unfused, Backward::Autograd),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kernels::Fused => "fused, f32",
            Kernels::Autograd => "fused, autograd, f32",
            Kernels::Unfused => "unfused, f32",
            Kernels::Mixed => "fused, bf16 mixed precision",
        }
    }
}

/// One way of running a training step on the shared model and optimizer.
enum Variant {
    Eager,
    Graph(StepId),
    Path(StepId, StepId),
    Handmade(HandmadeGraph),
}

const NAMES: [&str; 4] = [
    "eager",
    "graft (one graph)",
    "graft (path)",
    "hand-made graph",
];

/// The model, its optimizer and accumulator, and the runtime the graphed variants share.
struct Trainer {
    model: Trainable,
    opt: AdamW,
    acc: GradAccumulator,
    graft: CandleGraft,
    statics: Vec<Tensor>,
}

impl Trainer {
    fn new(sizes: Sizes, kernels: Kernels, device: &Device) -> BenchResult<Trainer> {
        let cfg = sizes.config();
        let mut model = match kernels {
            Kernels::Mixed => Trainable::random_mixed(&cfg, 1234, DType::BF16, device)?,
            _ => Trainable::random(&cfg, 1234, DType::F32, device)?,
        };
        let (ops, backward) = kernels.of();
        model.set_kernels(ops);
        model.set_backward(backward);
        let opt = match kernels {
            Kernels::Mixed => AdamW::new(model.masters().to_vec(), AdamWConfig::default())?
                .mixed(model.vars().to_vec())?,
            _ => AdamW::new(model.vars().to_vec(), AdamWConfig::default())?,
        };
        let acc = GradAccumulator::new(model.vars())?;
        let mut statics: Vec<Tensor> = opt.statics().into_iter().cloned().collect();
        statics.extend(model.constants().into_iter().cloned());
        statics.extend(acc.statics().into_iter().cloned());
        Ok(Trainer {
            model,
            opt,
            acc,
            graft: CandleGraft::new(device)?,
            statics,
        })
    }

    /// One step of `variant` on `data` (`[batch, seq + 1]` u32); the loss, when it has one.
    fn step(&mut self, variant: &Variant, data: &Tensor) -> BenchResult<Option<Tensor>> {
        let Trainer {
            model,
            opt,
            acc,
            graft,
            statics,
        } = self;
        let statics: Vec<&Tensor> = statics.iter().collect();
        let (tokens, targets) = split(data)?;
        Ok(match variant {
            Variant::Eager => Some(full_step(model, opt, &tokens, &targets)?),
            Variant::Graph(id) => {
                let out = graft.call(*id, &[&tokens, &targets], &statics, &[], |x| {
                    Ok(vec![full_step(model, opt, &x[0], &x[1])?])
                })?;
                out.outputs.into_iter().next()
            }
            Variant::Path(micro, update) => {
                let out = graft.call(*micro, &[&tokens, &targets], &statics, &[], |x| {
                    let grads = model.gradients(&x[0], &x[1], None)?;
                    acc.accumulate(&grads)?;
                    Ok(vec![grads.loss().clone()])
                })?;
                graft.call(*update, &[], &statics, &[], |_| {
                    opt.step(acc)?;
                    acc.zero()?;
                    Ok(vec![])
                })?;
                out.outputs.into_iter().next()
            }
            Variant::Handmade(graph) => {
                graph.launch()?;
                None
            }
        })
    }
}

fn split(data: &Tensor) -> graft_candle::candle_core::Result<(Tensor, Tensor)> {
    let seq = data.dim(1)? - 1;
    Ok((
        data.narrow(1, 0, seq)?.contiguous()?,
        data.narrow(1, 1, seq)?.contiguous()?,
    ))
}

fn full_step(
    model: &Trainable,
    opt: &mut AdamW,
    tokens: &Tensor,
    targets: &Tensor,
) -> graft_candle::candle_core::Result<Tensor> {
    let grads = model.gradients(tokens, targets, None)?;
    opt.step(&grads)?;
    Ok(grads.loss().clone())
}

/// Random `[batch, seq + 1]` tokens below `vocab`.
fn data(batch: usize, seq: usize, vocab: usize, device: &Device) -> BenchResult<Tensor> {
    let mut state = 0x2545_F491_4F6C_DD1D_u64 ^ batch as u64;
    let values: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect();
    Ok(Tensor::from_vec(values, (batch, seq + 1), device)?)
}

/// 3 steps of graft-candle (one graph) from a fresh model equal eager's bit for bit (the
/// losses, the weights the passes read and, with mixed precision, the masters).
fn check(sizes: Sizes, kernels: Kernels, data: &Tensor, device: &Device) -> BenchResult<bool> {
    let mut eager = Trainer::new(sizes, kernels, device)?;
    let mut graphed = Trainer::new(sizes, kernels, device)?;
    let id = graphed.graft.register("check");
    let mut same = true;
    for _ in 0..3 {
        let a = eager.step(&Variant::Eager, data)?.ok_or("no loss")?;
        let b = graphed.step(&Variant::Graph(id), data)?.ok_or("no loss")?;
        same &= a.to_vec1::<f32>()? == b.to_vec1::<f32>()?;
    }
    let weights = |t: &Trainer| -> Vec<Tensor> {
        let (model, held) = (&t.model, t.model.vars().iter());
        held.chain(model.masters())
            .map(|v| v.as_tensor().clone())
            .collect()
    };
    for (a, b) in weights(&eager).iter().zip(&weights(&graphed)) {
        let diff = (a - b)?
            .abs()?
            .to_dtype(DType::F32)?
            .max_all()?
            .to_scalar::<f32>()?;
        same &= diff == 0.0;
    }
    Ok(same)
}

/// Graph memory the driver and graft hold now, in bytes: the driver's, and graft's pool's.
fn graph_bytes(t: &Trainer, device: &Device) -> BenchResult<[u64; 2]> {
    let driver = graph_memory(device.as_cuda_device()?)?.mapped_current;
    let pool = t
        .graft
        .graft()
        .map_or(0, |g| g.memory_report().mapped_bytes);
    Ok([driver, pool as u64])
}

struct Row {
    model: &'static str,
    ops: Kernels,
    batch: usize,
    us: [f64; 4],
    memory: [u64; 4],
    /// graft's pool's share of `memory[1]` (the rest is the driver's graph memory).
    pool: u64,
    kernels: usize,
    identical: bool,
}

fn measure(
    name: &'static str,
    sizes: Sizes,
    ops: Kernels,
    batch: usize,
    o: &Options,
    device: &Device,
) -> BenchResult<Row> {
    let data = data(batch, o.seq, sizes.vocab, device)?;
    let identical = check(sizes, ops, &data, device)?;
    let cuda = device.as_cuda_device()?.clone();
    trim_graph_memory(&cuda)?;
    let mut t = Trainer::new(sizes, ops, device)?;
    let mut memory = [0u64; 4];
    let mut pool = 0;
    // Eager: the default pool's peak above what the model and optimizer hold.
    reset_eager_high(&cuda)?;
    let before = eager_memory(&cuda)?.used_current;
    for _ in 0..2 {
        t.step(&Variant::Eager, &data)?;
    }
    reset_eager_high(&cuda)?;
    t.step(&Variant::Eager, &data)?;
    device.synchronize()?;
    memory[0] = eager_memory(&cuda)?.used_high - before;
    // Each graphed variant: the graph memory it adds once recorded.
    let mut variants = vec![Variant::Eager];
    let one = t.graft.register("train");
    let micro = t
        .graft
        .register_with("micro", FunctionSpec::default().mode(Mode::Forward));
    let update = t
        .graft
        .register_with("update", FunctionSpec::default().mode(Mode::Backward));
    for (i, v) in [Variant::Graph(one), Variant::Path(micro, update)]
        .into_iter()
        .enumerate()
    {
        let base = graph_bytes(&t, device)?;
        for _ in 0..3 {
            t.step(&v, &data)?;
        }
        device.synchronize()?;
        let now = graph_bytes(&t, device)?;
        memory[i + 1] = now[0] + now[1] - base[0] - base[1];
        if i == 0 {
            pool = now[1] - base[1];
        }
        variants.push(v);
    }
    let base = graph_bytes(&t, device)?;
    let handmade = {
        let Trainer { model, opt, .. } = &mut t;
        HandmadeGraph::capture(&cuda, &data, |d| {
            let (tokens, targets) = split(d)?;
            drop(full_step(model, opt, &tokens, &targets)?);
            d.copy()
        })?
    };
    handmade.launch()?;
    device.synchronize()?;
    let now = graph_bytes(&t, device)?;
    memory[3] = now[0] + now[1] - base[0] - base[1];
    variants.push(Variant::Handmade(handmade));
    let kernels = t
        .graft
        .graft()
        .and_then(|g| g.nodes().into_iter().find(|n| &*n.function_name == "train"))
        .map_or(0, |n| n.graph.kernels);

    let per_round = o.timing.per_round(o.steps)?;
    let mut samples = vec![Vec::with_capacity(o.steps); variants.len()];
    for _ in 0..o.timing.rounds {
        for (v, times) in variants.iter().zip(samples.iter_mut()) {
            for _ in 0..2 {
                t.step(v, &data)?;
            }
            device.synchronize()?;
            for _ in 0..per_round {
                let start = Instant::now();
                t.step(v, &data)?;
                device.synchronize()?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    if let Some(g) = t.graft.graft() {
        let s = g.stats();
        println!(
            "    graft: {} recordings, {} replays, {} warmups, {} eager runs, {} guards, {} guard differences, re-recordings {:?}",
            s.recordings,
            s.replays,
            s.warmups,
            s.eager_runs,
            s.guards,
            s.guard_differences,
            s.rerecords
        );
    }
    let mut us = [0.0; 4];
    for (u, s) in us.iter_mut().zip(samples.iter_mut()) {
        *u = median(s);
    }
    Ok(Row {
        model: name,
        ops,
        batch,
        us,
        memory,
        pool,
        kernels,
        identical,
    })
}

/// `--profile-steps` replays of the graphed step, in a profiled range.
fn profile(o: &Options, sizes: Sizes, device: &Device) -> BenchResult<()> {
    let kernels = o.kernels.first().copied().unwrap_or(Kernels::Fused);
    let data = data(o.profile_batch, o.seq, sizes.vocab, device)?;
    let mut t = Trainer::new(sizes, kernels, device)?;
    let id = t.graft.register("train");
    for _ in 0..3 {
        t.step(&Variant::Graph(id), &data)?;
    }
    device.synchronize()?;
    graft_candle_bench::profiler::profiled(|| {
        for _ in 0..o.profile_steps {
            t.step(&Variant::Graph(id), &data)?;
        }
        device.synchronize()?;
        Ok(())
    })?;
    println!(
        "profiled {} replayed steps, {} kernels, batch {}",
        o.profile_steps,
        kernels.name(),
        o.profile_batch
    );
    Ok(())
}

fn main() {
    graft_candle_bench::common::exit_on_error("graft-candle-train", run);
}

fn run() -> BenchResult<()> {
    let o = <Options as clap::Parser>::parse();
    o.timing.per_round(o.steps)?;
    let device = graft_candle_bench::common::gpu()?;
    if o.profile_steps > 0 {
        let model = o.models.last().copied().unwrap_or(Model::Bench);
        return profile(&o, model.sizes(o.seq), &device);
    }
    println!(
        "training step (forward, backward, AdamW), sequence {}; {} timed steps per variant in {} rounds, median",
        o.seq, o.steps, o.timing.rounds
    );
    let mut json = Vec::new();
    let mut failed = false;
    for &model in &o.models {
        let (name, sizes) = (model.name(), model.sizes(o.seq));
        for &kernels in &o.kernels {
            println!("{name}: {sizes}, {} kernels", kernels.name());
            for &batch in &o.batches {
                let r = match measure(name, sizes, kernels, batch, &o, &device) {
                    Ok(r) => r,
                    Err(e) => {
                        failed = true;
                        println!("  B={batch:<3} failed: {e}");
                        continue;
                    }
                };
                failed |= !r.identical;
                let mib = |b: u64| b as f64 / (1 << 20) as f64;
                println!(
                    "  B={batch:<3} {}: {:.1} / {:.1} / {:.1} / {:.1} us   eager/graft {:.2}x   path/graft {:.3}   graft/hand-made {:.3}   {} kernels   memory eager peak {:.1} MiB, graph {:.1} MiB ({:.3}x; graft's pool {:.1} MiB), path {:.1} MiB, hand-made {:.1} MiB   {}",
                    NAMES.join(" / "),
                    r.us[0],
                    r.us[1],
                    r.us[2],
                    r.us[3],
                    r.us[0] / r.us[1],
                    r.us[2] / r.us[1],
                    r.us[1] / r.us[3],
                    r.kernels,
                    mib(r.memory[0]),
                    mib(r.memory[1]),
                    r.memory[1] as f64 / r.memory[0] as f64,
                    mib(r.pool),
                    mib(r.memory[2]),
                    mib(r.memory[3]),
                    if r.identical {
                        "bit-identical to eager"
                    } else {
                        "DIFFERS FROM EAGER"
                    },
                );
                json.push(format!(
                "{{\"model\":\"{}\",\"ops\":\"{}\",\"batch\":{},\"seq\":{},\"eager_us\":{:.1},\"graft_us\":{:.1},\"path_us\":{:.1},\"handmade_us\":{:.1},\"kernels\":{},\"eager_peak_bytes\":{},\"graft_graph_bytes\":{},\"graft_pool_bytes\":{},\"path_graph_bytes\":{},\"handmade_graph_bytes\":{},\"identical\":{}}}",
                r.model, r.ops.name(), r.batch, o.seq, r.us[0], r.us[1], r.us[2], r.us[3], r.kernels,
                r.memory[0], r.memory[1], r.pool, r.memory[2], r.memory[3], r.identical
            ));
            }
        }
    }
    if o.guards {
        let sizes = Sizes {
            max_positions: o.seq,
            ..Sizes::BENCH
        };
        println!("guards, bench model: per step, median");
        for &batch in &o.batches {
            let r = guards::measure_guards(sizes, batch, &o, &device)?;
            failed |= !r.nn_same || r.found == 0;
            println!(
                "  B={batch:<3} replay {:.1} us, guarded call {:.1} us ({:.1}x); candle-nn AdamW eager {:.1} us, under graft-candle {:.1} us (eager/graft {:.2}x), {} findings, losses {}",
                r.replay,
                r.guarded,
                r.guarded / r.replay,
                r.nn_eager,
                r.nn_graft,
                r.nn_eager / r.nn_graft,
                r.found,
                if r.nn_same {
                    "equal to eager"
                } else {
                    "DIFFER FROM EAGER"
                },
            );
            json.push(format!(
                "{{\"guards\":true,\"batch\":{batch},\"replay_us\":{:.1},\"guarded_us\":{:.1},\"nn_eager_us\":{:.1},\"nn_graft_us\":{:.1},\"nn_same\":{},\"findings\":{}}}",
                r.replay, r.guarded, r.nn_eager, r.nn_graft, r.nn_same, r.found
            ));
        }
    }
    o.timing.write_json(&json)?;
    if failed {
        return Err("a variant failed or differed from eager (see above)".into());
    }
    Ok(())
}
