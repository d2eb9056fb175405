//! `graft bench micro`: the replay fast path against a raw graph launch of the same chain.
//!
//! Ten elementwise kernels over 1,024 floats and 8 inputs (7 static, 1 copied), timed per
//! call in one run four ways: eager launches; a raw launch of the same graph graft records
//! (the input's copy node, then the ten kernels); the ten-kernel graph launched after a
//! separate input copy (how PyTorch's trees copy inputs); and graft's tree replay. The two raw
//! launches need graft-core's token (graft-cli's `graft-baselines` bench); without it (the
//! `graft` binary) only eager launches and the tree replay are timed.
//!
//! At scale (`--inputs`, `--tree`): more static inputs per call (passed and checked, not read
//! by the chain), and more recorded nodes in the tree (siblings of other signatures).

use std::time::Instant;

use std::io::Write;

use graft_core::backend::CoreOnly;
use graft_core::{BodyError, Buffer, Config, Ctx, Device, FunctionSpec, Graft, Guards, Output};
use graft_tensor::{DType, Ops, Tensor, TensorError};

use crate::{Backend, CliError, MicroArgs, NO_RAW};

/// Floats per buffer.
pub const N: usize = 1024;

/// Why the micro benchmark could not finish.
#[derive(thiserror::Error, Debug)]
pub enum MicroError {
    /// The device failed.
    #[error(transparent)]
    Device(#[from] graft_core::DeviceError),
    /// A graft call failed.
    #[error(transparent)]
    Call(#[from] graft_core::CallError),
    /// A buffer was invalidated.
    #[error(transparent)]
    Buffer(#[from] graft_core::BufferError),
    /// Allocating, reading or writing a buffer failed.
    #[error(transparent)]
    Memory(#[from] graft_core::MemoryError),
    /// A kernel launch was refused.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Not every timed call was a replay, so the numbers would not measure the fast path.
    #[error(
        "only {replayed} of {calls} timed calls replayed; this is a bug in graft, please report it"
    )]
    NotReplayed {
        /// Replays counted.
        replayed: u64,
        /// Calls made.
        calls: u64,
    },
    /// The replay computed something else than the chain.
    #[error(
        "the tree replay gave {got} where the chain gives {expected}; this is a correctness bug, please report it"
    )]
    WrongResult {
        /// Value read.
        got: f32,
        /// Value expected.
        expected: f32,
    },
}

/// Per-call times in nanoseconds (medians over repeats).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MicroResult {
    /// Ten eager kernel launches.
    pub eager_ns: f64,
    /// One tree replay through `Graft::call_into`.
    pub tree_ns: f64,
    /// The raw launches, when measured (with graft-core's token).
    pub raw: Option<RawResult>,
}

/// Per-call times of the raw launches in nanoseconds (medians over repeats).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawResult {
    /// One raw graph launch of the graph graft records (the input copy node, then the chain).
    pub raw_ns: f64,
    /// One input copy, then a raw launch of the chain alone: copying outside the graph, as
    /// PyTorch's trees do.
    pub raw_copy_ns: f64,
    /// Tree replay over raw launch: the median of the ratios of blocks timed back to back
    /// (raw, then tree, in every repeat), so that drift of the machine cancels out.
    pub tree_over_raw: f64,
}

/// How to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// Synchronize after every call: latency of one step.
    Latency,
    /// Synchronize after each block of calls: launch throughput.
    Throughput,
}

/// The chain: acc = x + w0; acc += w1..w6; acc += x; acc += w0; acc += w1 (ten kernels).
fn chain<K: Ops>(k: &K, acc: &Tensor, w: &[Tensor], x: &Tensor) -> graft_tensor::Result<()> {
    k.add(acc, x, &w[0])?;
    for wi in &w[1..7] {
        k.add(acc, acc, wi)?;
    }
    k.add(acc, acc, x)?;
    k.add(acc, acc, &w[0])?;
    k.add(acc, acc, &w[1])
}

/// `N` floats over `buffer`.
fn floats(buffer: &Buffer) -> graft_tensor::Result<Tensor> {
    Tensor::from_buffer(buffer.clone(), &[N], DType::F32)
}

fn body<D: graft_tensor::Backend>(
    k: &D::Ops,
    ctx: &mut Ctx<'_, D>,
) -> Result<Vec<Output<()>>, BodyError> {
    let inputs: Vec<Tensor> = ctx.inputs()[..8]
        .iter()
        .map(floats)
        .collect::<Result<_, _>>()?;
    let out = ctx.alloc(N * 4)?;
    chain(k, &floats(&out)?, &inputs[..7], &inputs[7])?;
    Ok(vec![Output::new(out, ())])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Captures what `f` enqueues into one graph.
fn capture<D: Device>(
    core: &CoreOnly,
    device: &D,
    f: impl FnOnce() -> graft_tensor::Result<()>,
) -> Result<D::Graph, MicroError> {
    device.begin_capture(core, Default::default())?;
    match f() {
        Ok(()) => Ok(device.end_capture(core)?),
        Err(e) => {
            device.abort_capture(core)?;
            Err(e.into())
        }
    }
}

/// Times `f` per call: `repeats` blocks of `per_block` calls, median of the block means.
fn time<D: Device>(
    device: &D,
    timing: Timing,
    repeats: usize,
    per_block: usize,
    mut f: impl FnMut() -> Result<(), MicroError>,
) -> Result<f64, MicroError> {
    for _ in 0..per_block {
        f()?;
    }
    device.synchronize()?;
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        samples.push(block(device, timing, per_block, &mut f)?);
    }
    Ok(median(samples))
}

/// Nanoseconds per call of one block of `per_block` calls.
fn block<D: Device>(
    device: &D,
    timing: Timing,
    per_block: usize,
    f: &mut impl FnMut() -> Result<(), MicroError>,
) -> Result<f64, MicroError> {
    let start = Instant::now();
    for _ in 0..per_block {
        f()?;
        if timing == Timing::Latency {
            device.synchronize()?;
        }
    }
    device.synchronize()?;
    Ok(start.elapsed().as_nanos() as f64 / per_block as f64)
}

/// Times `a` and `b` in alternating blocks (a warmup block of each first): the medians of
/// each, and the median of the per-repeat ratios b / a.
fn time_pair<D: Device>(
    device: &D,
    timing: Timing,
    repeats: usize,
    per_block: usize,
    mut a: impl FnMut() -> Result<(), MicroError>,
    mut b: impl FnMut() -> Result<(), MicroError>,
) -> Result<(f64, f64, f64), MicroError> {
    block(device, timing, per_block, &mut a)?;
    block(device, timing, per_block, &mut b)?;
    let (mut sa, mut sb, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats {
        let ta = block(device, timing, per_block, &mut a)?;
        let tb = block(device, timing, per_block, &mut b)?;
        ratios.push(tb / ta);
        sa.push(ta);
        sb.push(tb);
    }
    Ok((median(sa), median(sb), median(ratios)))
}

/// The size of the measurement: inputs per call (at least 8) and recorded nodes in the tree,
/// and whether graft's default guards are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    /// Inputs per call: the chain's 8, then static ones it does not read.
    pub inputs: usize,
    /// Nodes in the tree: the timed one and siblings of other signatures.
    pub nodes: usize,
    /// Guards on their default schedule, past its first 1,024 calls (a guarded call, a
    /// capture, every 1,024 calls among the timed ones); off, the timed calls are the replay
    /// fast path alone.
    pub guards: bool,
}

/// Runs the four measurements on `device` (the two raw launches only with graft-core's token
/// `raw`).
pub fn run<D: graft_tensor::Backend>(
    device: D,
    timing: Timing,
    repeats: usize,
    per_block: usize,
    scale: Scale,
    raw: Option<&CoreOnly>,
) -> Result<MicroResult, MicroError> {
    let k = device.load_ops()?;
    // Guards off by default: the timed calls are the replay fast path alone, with none of them
    // a guard's capture (`graft bench guard` measures those); an unguarded replay runs the
    // same check. With `scale.guards`, the default schedule's guards fall among them.
    let config = Config {
        guards: scale.guards.then(Guards::default),
        ..Config::default()
    };
    let mut g: Graft<D, ()> = Graft::new(device.clone(), config);
    let inputs = scale.inputs.max(8);
    let statics: Vec<usize> = (0..7).chain(8..inputs).collect();
    let f = g.register("chain", FunctionSpec::inference(statics));
    let mut bufs: Vec<Buffer> = (0..10).map(|_| g.alloc(N * 4)).collect::<Result<_, _>>()?;
    for (i, b) in bufs.iter().enumerate() {
        g.write_f32(b, &vec![i as f32 * 0.001; N])?;
    }
    let t: Vec<Tensor> = bufs.iter().map(floats).collect::<Result<_, _>>()?;
    let (w, x, acc, placeholder) = (&t[..7], &t[7], &t[8], &t[9]);

    let eager_ns = time(&device, timing, repeats, per_block, || {
        Ok(chain(&k, acc, w, x)?)
    })?;

    // The graph graft records: the input copy into the placeholder, then the chain; and the
    // chain alone, with the input copied before each launch (how PyTorch's trees copy).
    let raw_graphs = match raw {
        Some(core) => {
            let same_graph = capture(core, &device, || {
                device.copy(core, placeholder.ptr()?, x.ptr()?, N * 4)?;
                chain(&k, acc, w, placeholder)
            })?;
            let kernels_only = capture(core, &device, || chain(&k, acc, w, placeholder))?;
            let (x_at, placeholder_at) = (x.ptr()?, placeholder.ptr()?);
            let raw_copy_ns = time(&device, timing, repeats, per_block, || {
                device.copy(core, placeholder_at, x_at, N * 4)?;
                Ok(device.launch(core, &kernels_only)?)
            })?;
            Some((core, same_graph, raw_copy_ns))
        }
        None => None,
    };

    for _ in 8..inputs {
        bufs.push(g.alloc(N * 4)?);
    }
    let refs: Vec<&Buffer> = bufs[..8].iter().chain(&bufs[10..]).collect();
    let mut out = Vec::with_capacity(1);
    for key in 1..scale.nodes.max(1) as u64 {
        for _ in 0..2 {
            g.call_into(f, &refs, &[key], |ctx| body::<D>(&k, ctx), &mut out)?;
        }
    }
    // With guards, past the schedule's doubling start (calls 1, 2, 4, ... 1,024 after the
    // recording): the timed calls see its steady state, a guard every 1,024 calls.
    let settle = if scale.guards { 3 + 1024 } else { 3 };
    for _ in 0..settle {
        g.call_into(f, &refs, &[0], |ctx| body::<D>(&k, ctx), &mut out)?;
    }
    let replays_before = g.stats().replays;
    let replay = || {
        g.call_into(f, &refs, &[0], |ctx| body::<D>(&k, ctx), &mut out)?;
        Ok(())
    };
    // Raw launch and tree replay of the same graph, in alternating blocks; or the tree alone.
    let (tree_ns, raw) = match raw_graphs {
        Some((core, same_graph, raw_copy_ns)) => {
            let launch = || Ok(device.launch(core, &same_graph)?);
            let (raw_ns, tree_ns, tree_over_raw) =
                time_pair(&device, timing, repeats, per_block, launch, replay)?;
            let raw = RawResult {
                raw_ns,
                raw_copy_ns,
                tree_over_raw,
            };
            (tree_ns, Some(raw))
        }
        None => (time(&device, timing, repeats, per_block, replay)?, None),
    };
    let replayed = g.stats().replays - replays_before;
    let calls = ((repeats + 1) * per_block) as u64;
    if replayed != calls {
        return Err(MicroError::NotReplayed { replayed, calls });
    }

    // The tree computed what the chain computes.
    let mut expected = vec![0f32; N];
    let host = |i: usize| i as f32 * 0.001;
    for v in expected.iter_mut() {
        *v = host(7) + host(0);
        for i in 1..7 {
            *v += host(i);
        }
        *v += host(7) + host(0) + host(1);
    }
    let got = g.read_f32(&out[0].buffer)?;
    if let Some((&got, &expected)) = got
        .iter()
        .zip(&expected)
        .find(|(a, b)| (**a - **b).abs() > 1e-5)
    {
        return Err(MicroError::WrongResult { got, expected });
    }
    Ok(MicroResult {
        eager_ns,
        tree_ns,
        raw,
    })
}

/// `graft bench micro`: runs both timings on the picked backend and prints a table (the raw
/// launches' columns only with graft-core's token `raw`).
pub fn report(
    args: &MicroArgs,
    raw: Option<&CoreOnly>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let backend = Backend::pick(args.sim, out)?;
    let name = backend.describe();
    let scale = Scale {
        inputs: args.inputs.max(8),
        nodes: args.tree.max(1),
        guards: args.guards,
    };
    writeln!(
        out,
        "replay fast path on {name}: 10 kernels over {N} floats, {} inputs (1 copied), {} recorded nodes in the tree, guards {}, per call",
        scale.inputs,
        scale.nodes,
        if scale.guards { "on" } else { "off" }
    )?;
    writeln!(
        out,
        "{:<11} {:>10} {:>10} {:>14} {:>10} {:>9}",
        "timing", "eager", "raw graph", "copy + graph", "tree", "tree/raw"
    )?;
    for timing in [Timing::Latency, Timing::Throughput] {
        let r = match &backend {
            Backend::Cuda(d) => run(d.clone(), timing, args.repeats, args.calls, scale, raw),
            Backend::Sim(d) => run(d.clone(), timing, args.repeats, args.calls, scale, raw),
        }?;
        let us = |ns: f64| format!("{:.2}us", ns / 1e3);
        let (raw_us, raw_copy_us, tree_over_raw) = match r.raw {
            Some(raw) => (
                us(raw.raw_ns),
                us(raw.raw_copy_ns),
                format!("{:.3}", raw.tree_over_raw),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        writeln!(
            out,
            "{:<11} {:>10} {:>10} {:>14} {:>10} {:>9}",
            format!("{timing:?}").to_lowercase(),
            us(r.eager_ns),
            raw_us,
            raw_copy_us,
            us(r.tree_ns),
            tree_over_raw
        )?;
    }
    if raw.is_none() {
        writeln!(out, "{NO_RAW}")?;
    }
    Ok(())
}
