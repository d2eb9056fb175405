//! Shared test support: devices, the `device_test!` macro and body helpers. The test kernels
//! ([`TestQueue`]) come from graft-testkit, so every scenario body runs on the simulator in CI
//! and on a real GPU with `--ignored`.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use graft::cuda::CudaDevice;
use graft::sim::SimDevice;
use graft::{BodyError, Buffer, Config, Ctx, FunctionSpec, Graft, Outcome, Output};
use graft_testkit::CudaTestKernels;
pub use graft_testkit::{TestDevice, TestQueue};

pub fn sim() -> SimDevice {
    SimDevice::new()
}

/// One device per test process, with the test kernels loaded: creating a context and
/// compiling the kernels once. The kernels stay loaded as long as the process runs.
pub fn cuda() -> CudaDevice {
    static DEVICE: std::sync::OnceLock<(CudaDevice, CudaTestKernels)> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let dev = CudaDevice::new(0).expect("a CUDA GPU is required for the ignored tests");
            let kernels = CudaTestKernels::load(&dev).expect("the test kernels compile and load");
            (dev, kernels)
        })
        .0
        .clone()
}

/// Defines `mod $name { sim, cuda }` running `$body` on each backend.
#[macro_export]
macro_rules! device_test {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn sim() {
                super::$body(super::common::sim());
            }
            #[test]
            #[ignore = "needs a CUDA GPU"]
            fn cuda() {
                super::$body(super::common::cuda());
            }
        }
    };
}

pub type G<D> = Graft<D, u32>;

pub fn graft<D: TestDevice>(device: D, config: Config) -> G<D> {
    Graft::new(device, config)
}

/// graft's defaults without guards: for tests that count body runs, outcomes, spans or
/// allocations of calls a guard would capture instead of replaying (tests/guards.rs covers
/// guards; every other test runs with them on).
#[allow(dead_code)]
pub fn unguarded() -> Config {
    Config {
        guards: None,
        ..Config::default()
    }
}

/// A buffer outside the graph pool holding `values`.
pub fn input<D: TestDevice>(g: &mut G<D>, values: &[f32]) -> Buffer {
    let b = g.alloc(values.len() * 4).unwrap();
    g.write_f32(&b, values).unwrap();
    b
}

pub fn read<D: TestDevice>(g: &G<D>, b: &Buffer) -> Vec<f32> {
    g.read_f32(b).unwrap()
}

/// Counts how often a body ran.
#[derive(Clone, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    pub fn hit(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

pub type Body<'a, D> = Box<dyn FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<u32>>, BodyError> + 'a>;

/// out = a * input0 + b, as a body.
pub fn affine<D: TestDevice>(a: f32, b: f32, runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        ctx.queue().axpb_f32(&out, &x, a, b, n)?;
        Ok(vec![Output::new(out, n as u32)])
    })
}

/// out = input0 + input1.
pub fn add<D: TestDevice>(runs: &Runs) -> Body<'static, D> {
    let runs = runs.clone();
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let (x, y) = (ctx.input(0).clone(), ctx.input(1).clone());
        let out = ctx.alloc(x.len())?;
        ctx.queue().add_f32(&out, &x, &y, x.len() / 4)?;
        Ok(vec![Output::new(out, 0)])
    })
}

/// out = a * x + 1, with `a` read on the host from `scale` when the body runs: what an
/// optimizer's bias correction or a schedule does.
pub fn scaled<D: TestDevice>(scale: &Arc<AtomicU32>, runs: &Runs) -> Body<'static, D> {
    let (scale, runs) = (scale.clone(), runs.clone());
    Box::new(move |ctx: &mut Ctx<'_, D>| {
        runs.hit();
        let a = f32::from_bits(scale.load(Ordering::Relaxed));
        let x = ctx.input(0).clone();
        let n = x.len() / 4;
        let out = ctx.alloc(x.len())?;
        ctx.queue().axpb_f32(&out, &x, a, 1.0, n)?;
        Ok(vec![Output::new(out, n as u32)])
    })
}

/// Registers `step` and calls it `calls` times, with the body [`scaled`], with `a = value(i)` on call `i`; returns what each call did
/// and whether its output was `a * x + 1`.
pub fn run_scaled<D: TestDevice>(
    g: &mut G<D>,
    calls: u32,
    value: impl Fn(u32) -> f32,
    runs: &Runs,
) -> Vec<(Outcome, bool)> {
    let f = g.register("step", FunctionSpec::default());
    let x = input(g, &[1.0, 2.0, 3.0, 4.0]);
    let scale = Arc::new(AtomicU32::new(0));
    let mut body = scaled::<D>(&scale, runs);
    let mut out = Vec::new();
    (0..calls)
        .map(|i| {
            scale.store(value(i).to_bits(), Ordering::Relaxed);
            let o = g.call_into(f, &[&x], &[], &mut body, &mut out).unwrap();
            let right =
                read(g, &out[0].buffer) == host_affine(&[1.0, 2.0, 3.0, 4.0], value(i), 1.0);
            (o, right)
        })
        .collect()
}

/// out = a*x + b computed on the host, for expectations (the kernels are exact for these values).
pub fn host_affine(x: &[f32], a: f32, b: f32) -> Vec<f32> {
    x.iter().map(|v| a.mul_add(*v, b)).collect()
}

/// Counts WARN events whose message contains `needle` while `f` runs on this thread.
///
/// One global subscriber serves every test thread and counts into the calling thread's
/// counter. A scoped subscriber per test (`with_default`) loses events when tests run in
/// parallel: tracing-core caches a callsite's interest from whichever thread reaches it
/// first, and while only one scoped subscriber exists it asks that thread's default alone,
/// so another test reaching the same `warn!` first leaves it switched off for everyone.
pub fn count_warnings(needle: &'static str, f: impl FnOnce()) -> usize {
    use std::cell::Cell;
    use std::sync::Once;

    thread_local! {
        static COUNTING: Cell<Option<(&'static str, usize)>> = const { Cell::new(None) };
    }
    struct Visit<'a>(&'a mut bool, &'static str);
    impl tracing::field::Visit for Visit<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" && format!("{value:?}").contains(self.1) {
                *self.0 = true;
            }
        }
    }
    struct Counter;
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Counter {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let Some((needle, seen)) = COUNTING.get() else {
                return;
            };
            if *event.metadata().level() == tracing::Level::WARN {
                let mut hit = false;
                event.record(&mut Visit(&mut hit, needle));
                if hit {
                    COUNTING.set(Some((needle, seen + 1)));
                }
            }
        }
    }
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Counter))
            .expect("no other global tracing subscriber in graft's test binaries");
    });
    COUNTING.set(Some((needle, 0)));
    f();
    let (_, seen) = COUNTING.take().expect("set above");
    seen
}
