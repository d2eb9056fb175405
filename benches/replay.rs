//! CPU cost of the replay fast path on the simulator: a 10-kernel graph with 8 inputs (7
//! static, 1 copied), graft's replay versus launching the same graph (input copy node and
//! chain) directly, and the invariant check alone. The difference is graft's overhead; the
//! simulated kernels cost the same in both. At scale: the same replay with 64 inputs (56 more
//! static ones the chain does not read) in a tree of 1,000 recorded nodes.

use criterion::{Criterion, criterion_group, criterion_main};
use graft::backend::CoreOnly;
use graft::sim::SimDevice;
use graft::{BodyError, Buffer, Config, Ctx, Device, FunctionSpec, Graft, Output};
use graft_testkit::TestQueue;

/// The token of the device's sealed calls, which the raw-graph baseline makes itself.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const N: usize = 1;

/// Ten kernels over the inputs: acc = x; acc = acc * w_i + b, ...
fn chain(ctx: &mut Ctx<'_, SimDevice>) -> Result<Vec<Output<()>>, BodyError> {
    let inputs = ctx.inputs();
    let out = ctx.alloc(N * 4)?;
    let d = ctx.queue();
    let o = &out;
    d.axpb_f32(o, &inputs[7], 1.0, 0.0, N)?;
    for w in &inputs[..7] {
        d.mul_f32(o, o, w, N)?;
    }
    d.axpb_f32(o, o, 0.5, 1.0, N)?;
    d.add_f32(o, o, &inputs[7], N)?;
    Ok(vec![Output::new(out, ())])
}

fn bench(c: &mut Criterion) {
    let dev = SimDevice::new();
    let mut g: Graft<SimDevice, ()> = Graft::new(dev.clone(), Config::default());
    let f = g.register("chain", FunctionSpec::inference([0, 1, 2, 3, 4, 5, 6]));
    let inputs: Vec<Buffer> = (0..8).map(|_| g.alloc(N * 4).unwrap()).collect();
    for b in &inputs {
        g.write_f32(b, &[1.0; N]).unwrap();
    }
    let refs: Vec<&Buffer> = inputs.iter().collect();
    let mut out = Vec::new();
    for _ in 0..3 {
        g.call_into(f, &refs, &[], chain, &mut out).unwrap();
    }

    // The same ten kernels captured directly, without graft, on buffers of the same size.
    let raw = {
        let mut g2: Graft<SimDevice, ()> = Graft::new(dev.clone(), Config::default());
        // 0..7 weights, 7 the placeholder, 8 the output, 9 the caller's copied input.
        let bufs: Vec<Buffer> = (0..10).map(|_| g2.alloc(N * 4).unwrap()).collect();
        let p: Vec<_> = bufs.iter().map(|b| b.addr().unwrap()).collect();
        // The graph graft records: the input copy into the placeholder, then the chain.
        dev.begin_capture(CORE, Default::default()).unwrap();
        dev.copy(CORE, p[7], p[9], N * 4).unwrap();
        let (out, placeholder) = (&bufs[8], &bufs[7]);
        dev.axpb_f32(out, placeholder, 1.0, 0.0, N).unwrap();
        for w in &bufs[..7] {
            dev.mul_f32(out, out, w, N).unwrap();
        }
        dev.axpb_f32(out, out, 0.5, 1.0, N).unwrap();
        dev.add_f32(out, out, placeholder, N).unwrap();
        let graph = dev.end_capture(CORE).unwrap();
        (g2, bufs, graph)
    };

    // 64 inputs, 1,000 nodes (999 siblings of other keys), replaying key 0.
    let mut g64: Graft<SimDevice, ()> = Graft::new(dev.clone(), Config::default());
    let statics: Vec<usize> = (0..7).chain(8..64).collect();
    let f64 = g64.register("chain", FunctionSpec::inference(statics));
    let inputs64: Vec<Buffer> = (0..64).map(|_| g64.alloc(N * 4).unwrap()).collect();
    for b in &inputs64 {
        g64.write_f32(b, &[1.0; N]).unwrap();
    }
    let refs64: Vec<&Buffer> = inputs64.iter().collect();
    for key in (1..1000).chain([0, 0, 0]) {
        for _ in 0..2 {
            g64.call_into(f64, &refs64, &[key], chain, &mut out)
                .unwrap();
        }
    }

    let mut group = c.benchmark_group("replay_fast_path");
    group.bench_function("raw_graph_launch", |b| {
        b.iter(|| dev.launch(CORE, &raw.2).unwrap())
    });
    group.bench_function("graft_replay", |b| {
        b.iter(|| g.call_into(f, &refs, &[], chain, &mut out).unwrap())
    });
    group.bench_function("graft_replay_64_inputs_1000_nodes", |b| {
        b.iter(|| g64.call_into(f64, &refs64, &[0], chain, &mut out).unwrap())
    });
    group.bench_function("invariant_check", |b| {
        b.iter(|| {
            g.mark_step_begin();
            g.probe(f, &refs, &[])
                .unwrap()
                .expect("the root node matches")
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
