//! graft-testkit: what graft's tests and benches share across both backends.
//!
//! [`TestQueue`] is the set of calls the shared test bodies make on a body's queue
//! (`ctx.queue()`): four elementwise `f32` kernels over graft [`Buffer`]s (fill, add, mul,
//! `a * x + b`), and the raw allocation and synchronize calls that misuse tests make inside
//! captures. [`TestDevice`] is a device whose queue provides them. Both backends implement
//! it, so every scenario body runs on the simulator in CI and on a GPU with `--ignored`:
//!
//! - on [`SimQueue`], the kernels are `launch_kernel` closures over [`graft_sim::SimMemory`];
//! - on [`CudaQueue`], they are launches of one small NVRTC module (`kernels.cu`) through
//!   graft-cuda's checked launch API. [`CudaTestKernels::load`] compiles and loads it for a
//!   device; the value it returns owns the module, and while it lives the device's queue
//!   finds the kernels. The testkit keeps only a weak reference per device, so no device is
//!   kept alive by it.
//!
//! Every kernel touches `n` elements from the start of each buffer; a buffer shorter than
//! `n` elements, of another device, or no longer valid is refused before anything is
//! launched (with [`Buffer::device_addr`]'s errors), so the kernels are safe to call.
//!
//! [`TestGroupDevice`] adds what multi-device tests need: several devices of one backend and
//! an all-reduce among them ([`SimComm`] on the simulator, [`NcclComm`] on GPUs), and
//! [`skip_without_cuda_gpus`] lets such a test skip itself on a machine with fewer GPUs.
//!
//! [`steps`] shortens long GPU test loops when `scripts/gpu-run.sh` runs the tests under
//! compute-sanitizer (it sets [`UNDER_SANITIZER`]).

pub mod procs;
mod sanitizer;
mod skip;

pub use sanitizer::{UNDER_SANITIZER, steps, under_sanitizer};
pub use skip::skip_without_cuda_gpus;

use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use graft_core::{Buffer, Device, DeviceError, DeviceId, DeviceOp, DevicePtr};
use graft_cuda::{CudaDevice, CudaModule, CudaQueue, KernelArg, NcclComm};
use graft_sim::{SimComm, SimDevice, SimQueue};

const F32_BYTES: usize = std::mem::size_of::<f32>();
const OP: DeviceOp = DeviceOp::KernelLaunch;

/// The calls the shared test bodies make on a body's queue, on either backend.
pub trait TestQueue {
    /// `dst[i] = value` for the first `n` `f32`s of `dst`, as a kernel.
    fn fill_f32(&self, dst: &Buffer, n: usize, value: f32) -> Result<(), DeviceError>;
    /// `dst[i] = a[i] + b[i]` for `n` `f32`s, as a kernel. `dst` may be an input.
    fn add_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError>;
    /// `dst[i] = a[i] * b[i]` for `n` `f32`s, as a kernel. `dst` may be an input.
    fn mul_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError>;
    /// `dst[i] = a * x[i] + b` for `n` `f32`s, as a kernel, computed as one fused multiply-add
    /// on both backends so they round identically. `dst` may be `x`.
    fn axpb_f32(
        &self,
        dst: &Buffer,
        x: &Buffer,
        a: f32,
        b: f32,
        n: usize,
    ) -> Result<(), DeviceError>;
    /// `dst[i] = value` for `n` `f32`s, as a slow kernel (it spins for about `spins` clock
    /// cycles first) that lets a programmatic dependent launched after it start at once.
    fn slow_fill_f32(
        &self,
        dst: &Buffer,
        n: usize,
        value: f32,
        spins: u64,
    ) -> Result<(), DeviceError>;
    /// `dst[i] = src[i]` for `n` `f32`s, launched as a programmatic dependent of the kernel
    /// before it. With `early`, each thread reads its first element of `src` before the
    /// kernel's wait: the race programmatic launch allows (the simulator reports it as
    /// `ProgrammaticRace`; a GPU may copy what `src` held before the kernel before it wrote).
    fn dependent_copy_f32(
        &self,
        dst: &Buffer,
        src: &Buffer,
        n: usize,
        early: bool,
    ) -> Result<(), DeviceError>;
    /// Whether a dependent launched on this queue may start before the kernel before it ends
    /// (the simulator models it; CUDA: compute capability 9.0 and a driver of CUDA 12.3+).
    fn dependents_overlap(&self) -> bool;
    /// An allocation made by user code outside graft (`cudaMalloc`): illegal during capture.
    fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError>;
    /// Frees a [`TestQueue::raw_alloc`] allocation: illegal during capture.
    fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError>;
    /// Waits for the stream: illegal during capture.
    fn synchronize(&self) -> Result<(), DeviceError>;
}

/// [`TestQueue`]'s raw allocation and synchronize, which both queues have as inherent methods
/// (raw allocation behind their `test-support` feature).
macro_rules! inherent_hooks {
    ($queue:ty) => {
        fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
            <$queue>::raw_alloc(self, bytes)
        }

        fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
            <$queue>::raw_free(self, ptr)
        }

        fn synchronize(&self) -> Result<(), DeviceError> {
            <$queue>::synchronize(self)
        }
    };
}

/// A device whose queue runs the test calls.
pub trait TestDevice: Device<Queue: TestQueue> + Clone {}

impl<D: Device<Queue: TestQueue> + Clone> TestDevice for D {}

/// A [`TestDevice`] backend with several devices and an all-reduce among them, for tests of
/// tensor-parallel groups. Each backend hands out `world` devices and one communicator per
/// device (rank `i` on device `i`).
pub trait TestGroupDevice: TestDevice {
    /// One rank's communicator.
    type Comm: Send + Sync + 'static;

    /// `world` devices of this backend, ready for [`TestQueue`]'s kernels.
    ///
    /// # Panics
    /// If the devices cannot be had (on CUDA: fewer than `world` GPUs, or the test kernels do
    /// not load). A CUDA test asks [`skip_without_cuda_gpus`] first, so that a machine with
    /// fewer GPUs skips it instead.
    fn devices(world: usize) -> Vec<Self>;

    /// One communicator per device of `devices`, rank `i` on `devices[i]`.
    ///
    /// # Panics
    /// If the communicators cannot be made (on CUDA: NCCL is missing or fails to initialize).
    fn comms(devices: &[Self]) -> Vec<Self::Comm>;

    /// Enqueues an in-place all-reduce (sum) of the first `n` `f32`s of `buf` on `comm`'s
    /// device's runtime stream (recorded when capturing).
    fn all_reduce(comm: &Self::Comm, buf: &Buffer, n: usize) -> Result<(), DeviceError>;
}

/// Device memory of each simulated device [`TestGroupDevice::devices`] makes (64 MiB): small,
/// so that a test can take all of it with raw allocations (the simulator really allocates them
/// on the host).
pub const SIM_GROUP_MEMORY: usize = 64 << 20;

/// How long a [`SimComm`] collective of [`TestGroupDevice::comms`] waits for its peers before
/// it fails (where NCCL would hang).
pub const SIM_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(5);

impl TestGroupDevice for SimDevice {
    type Comm = SimComm;

    /// Fresh devices of [`SIM_GROUP_MEMORY`] bytes each.
    fn devices(world: usize) -> Vec<SimDevice> {
        (0..world)
            .map(|_| SimDevice::with_memory_limit(SIM_GROUP_MEMORY))
            .collect()
    }

    /// A [`SimComm`] group whose collectives wait at most [`SIM_COLLECTIVE_TIMEOUT`].
    fn comms(devices: &[SimDevice]) -> Vec<SimComm> {
        SimComm::group(devices, SIM_COLLECTIVE_TIMEOUT)
    }

    fn all_reduce(comm: &SimComm, buf: &Buffer, n: usize) -> Result<(), DeviceError> {
        comm.all_reduce_sum_f32(buf, n)
    }
}

/// The CUDA devices opened so far by [`TestGroupDevice::devices`], by ordinal, each with its
/// test kernels loaded: opened once per process and kept, like the kernels, until it exits.
static CUDA_GROUP: OnceLock<Mutex<Vec<(CudaDevice, CudaTestKernels)>>> = OnceLock::new();

impl TestGroupDevice for CudaDevice {
    type Comm = NcclComm;

    /// GPUs `0..world`, each opened once per process with the test kernels loaded (later calls
    /// return the same devices).
    fn devices(world: usize) -> Vec<CudaDevice> {
        let available = CudaDevice::device_count().unwrap_or(0);
        assert!(
            available >= world,
            "this test needs {world} CUDA GPUs; {available} found"
        );
        let mut opened = CUDA_GROUP
            .get_or_init(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for ordinal in opened.len()..world {
            let dev = CudaDevice::new(ordinal)
                .unwrap_or_else(|e| panic!("CUDA device {ordinal} cannot be opened: {e}"));
            let kernels = CudaTestKernels::load(&dev).unwrap_or_else(|e| {
                panic!("the test kernels do not load on CUDA device {ordinal}: {e}")
            });
            opened.push((dev, kernels));
        }
        opened[..world].iter().map(|(d, _)| d.clone()).collect()
    }

    /// NCCL communicators over the devices (`ncclCommInitAll`).
    fn comms(devices: &[CudaDevice]) -> Vec<NcclComm> {
        NcclComm::init_all(devices)
            .unwrap_or_else(|e| panic!("NCCL communicators cannot be made: {e}"))
    }

    fn all_reduce(comm: &NcclComm, buf: &Buffer, n: usize) -> Result<(), DeviceError> {
        comm.all_reduce_sum_f32(buf, n)
    }
}

/// The byte length of `n` `f32`s, refused when it overflows.
fn f32_bytes(n: usize) -> Result<usize, DeviceError> {
    n.checked_mul(F32_BYTES)
        .ok_or(DeviceError::InvalidArgument {
            op: OP,
            what: "the element count overflows the address space",
        })
}

/// `dst[i] = f(a[i], b[i])` for `n` `f32`s of `[dst, a, b]`, as a simulator kernel.
fn sim_binary(
    queue: &SimQueue,
    name: &'static str,
    [dst, a, b]: [&Buffer; 3],
    n: usize,
    f: fn(f32, f32) -> f32,
) -> Result<(), DeviceError> {
    let bytes = f32_bytes(n)?;
    let (dst, a, b) = (
        queue.buffer_addr(dst, 0, bytes)?,
        queue.buffer_addr(a, 0, bytes)?,
        queue.buffer_addr(b, 0, bytes)?,
    );
    let args = [addr(dst), addr(a), addr(b), (n as u64).to_le_bytes()];
    queue.launch_kernel_with_args(name, &args.each_ref().map(|a| &a[..]), move |m| {
        m.zip_f32(dst, a, b, n, f)
    })
}

/// An address as a kernel argument's bytes.
fn addr(at: DevicePtr) -> [u8; 8] {
    at.0.to_le_bytes()
}

impl TestQueue for SimQueue {
    fn fill_f32(&self, dst: &Buffer, n: usize, value: f32) -> Result<(), DeviceError> {
        let bytes = f32_bytes(n)?;
        let dst = self.buffer_addr(dst, 0, bytes)?;
        let (at, count, v) = (addr(dst), (n as u64).to_le_bytes(), value.to_le_bytes());
        self.launch_kernel_with_args("fill_f32", &[&at, &count, &v], move |m| {
            m.fill_f32(dst, n, value)
        })
    }

    fn add_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError> {
        sim_binary(self, "add_f32", [dst, a, b], n, |x, y| x + y)
    }

    fn mul_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError> {
        sim_binary(self, "mul_f32", [dst, a, b], n, |x, y| x * y)
    }

    fn axpb_f32(
        &self,
        dst: &Buffer,
        x: &Buffer,
        a: f32,
        b: f32,
        n: usize,
    ) -> Result<(), DeviceError> {
        let bytes = f32_bytes(n)?;
        let (dst, x) = (
            self.buffer_addr(dst, 0, bytes)?,
            self.buffer_addr(x, 0, bytes)?,
        );
        // As the CUDA kernel's: (dst, x, a, b, n).
        let args = [
            &addr(dst)[..],
            &addr(x),
            &a.to_le_bytes(),
            &b.to_le_bytes(),
            &(n as u64).to_le_bytes(),
        ];
        self.launch_kernel_with_args("axpb_f32", &args, move |m| {
            m.map_f32(dst, x, n, |v| a.mul_add(v, b))
        })
    }

    fn slow_fill_f32(
        &self,
        dst: &Buffer,
        n: usize,
        value: f32,
        spins: u64,
    ) -> Result<(), DeviceError> {
        let bytes = f32_bytes(n)?;
        let dst = self.buffer_addr(dst, 0, bytes)?;
        let args = [
            &addr(dst)[..],
            &(n as u64).to_le_bytes(),
            &value.to_le_bytes(),
            &spins.to_le_bytes(),
        ];
        self.launch_kernel_with_args("slow_fill_f32", &args, move |m| m.fill_f32(dst, n, value))
    }

    fn dependent_copy_f32(
        &self,
        dst: &Buffer,
        src: &Buffer,
        n: usize,
        early: bool,
    ) -> Result<(), DeviceError> {
        let bytes = f32_bytes(n)?;
        let (dst, src) = (
            self.buffer_addr(dst, 0, bytes)?,
            self.buffer_addr(src, 0, bytes)?,
        );
        let args = [
            &addr(dst)[..],
            &addr(src),
            &(n as u64).to_le_bytes(),
            &u32::from(early).to_le_bytes(),
        ];
        self.launch_dependent(
            "dependent_copy_f32",
            &args,
            move |m| match early {
                true => m.bytes(src, bytes).map(drop),
                false => Ok(()),
            },
            move |m| m.copy(dst, src, bytes),
        )
    }

    fn dependents_overlap(&self) -> bool {
        true
    }

    inherent_hooks!(SimQueue);
}

/// CUDA C++ source of the test kernels.
const KERNELS_CU: &str = include_str!("kernels.cu");

/// The kernels of [`KERNELS_CU`], in module index order.
const NAMES: [&str; 6] = [
    "graft_fill_f32",
    "graft_add_f32",
    "graft_mul_f32",
    "graft_axpb_f32",
    "graft_slow_fill_f32",
    "graft_dependent_copy_f32",
];
const FILL: usize = 0;
const ADD: usize = 1;
const MUL: usize = 2;
const AXPB: usize = 3;
const SLOW_FILL: usize = 4;
const DEPENDENT_COPY: usize = 5;

/// Threads per block of every launch.
const BLOCK: u32 = 256;
/// Most blocks of one launch; the kernels' grid-stride loops cover any larger `n`.
const MAX_BLOCKS: usize = 1 << 16;

/// For each CUDA device with loaded test kernels, a weak reference to its module: the
/// [`CudaTestKernels`] value that loaded it owns it.
static LOADED: Mutex<Vec<(DeviceId, Weak<CudaModule>)>> = Mutex::new(Vec::new());

/// The test kernels compiled and loaded on one CUDA device. While this value (or a clone)
/// lives, the device's [`CudaQueue`] runs [`TestQueue`]'s kernels with them; drop it (after
/// the work using them finished) to unload the module. Keeps its device alive.
#[derive(Clone, Debug)]
pub struct CudaTestKernels {
    module: Arc<CudaModule>,
}

impl CudaTestKernels {
    /// Compiles the test kernels with NVRTC and loads them on `queue`'s device (see
    /// [`CudaQueue::load_module`] for the errors). The device's queue finds them while this
    /// value or any clone of it lives (or another value loaded for the same device).
    pub fn load(queue: &CudaQueue) -> Result<CudaTestKernels, DeviceError> {
        let module = Arc::new(queue.load_module(KERNELS_CU, &NAMES)?);
        let mut loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
        loaded.retain(|(_, m)| m.strong_count() > 0);
        loaded.push((queue.device_id(), Arc::downgrade(&module)));
        Ok(CudaTestKernels { module })
    }

    /// `dst[i] = value` for the first `n` `f32`s of `dst`, launched on the device's side
    /// stream and not joined back ([`CudaQueue::launch_function_on_side_stream`]).
    pub fn fill_f32_on_side_stream(
        &self,
        queue: &CudaQueue,
        dst: &Buffer,
        n: usize,
        value: f32,
    ) -> Result<(), DeviceError> {
        check(queue, &[dst], n)?;
        let args = [
            KernelArg::Buffer(dst),
            KernelArg::U64(n as u64),
            KernelArg::F32(value),
        ];
        queue.launch_function_on_side_stream(&self.module, FILL, grid(n), block(), 0, &args)
    }
}

/// The loaded test kernels of `queue`'s device.
fn module(queue: &CudaQueue) -> Result<Arc<CudaModule>, DeviceError> {
    let loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
    loaded
        .iter()
        .filter(|(id, _)| *id == queue.device_id())
        .find_map(|(_, m)| m.upgrade())
        .ok_or(DeviceError::Unavailable {
            op: OP,
            what: "no test kernels are loaded on this device; keep a graft_testkit::CudaTestKernels::load value alive",
        })
}

/// Checks that every buffer belongs to `queue`'s device, is valid and holds `n` `f32`s.
fn check(queue: &CudaQueue, buffers: &[&Buffer], n: usize) -> Result<(), DeviceError> {
    let bytes = f32_bytes(n)?;
    for b in buffers {
        b.device_addr(OP, queue.device_id(), 0, bytes)?;
    }
    Ok(())
}

fn grid(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32, 1, 1)
}

fn block() -> (u32, u32, u32) {
    (BLOCK, 1, 1)
}

/// Checks the buffers and launches kernel `kernel` of the device's test module over `n`
/// elements (nothing for `n == 0`).
fn launch(
    queue: &CudaQueue,
    kernel: usize,
    buffers: &[&Buffer],
    n: usize,
    args: &[KernelArg],
) -> Result<(), DeviceError> {
    check(queue, buffers, n)?;
    let module = module(queue)?;
    if n == 0 {
        return Ok(());
    }
    queue.launch_function(&module, kernel, grid(n), block(), 0, args)
}

/// Kernel `kernel` (add or mul, `(float*, const float*, const float*, unsigned long long)`)
/// over `n` `f32`s of `[dst, a, b]`.
fn cuda_binary(
    queue: &CudaQueue,
    kernel: usize,
    [dst, a, b]: [&Buffer; 3],
    n: usize,
) -> Result<(), DeviceError> {
    let args = [
        KernelArg::Buffer(dst),
        KernelArg::Buffer(a),
        KernelArg::Buffer(b),
        KernelArg::U64(n as u64),
    ];
    launch(queue, kernel, &[dst, a, b], n, &args)
}

impl TestQueue for CudaQueue {
    fn fill_f32(&self, dst: &Buffer, n: usize, value: f32) -> Result<(), DeviceError> {
        let args = [
            KernelArg::Buffer(dst),
            KernelArg::U64(n as u64),
            KernelArg::F32(value),
        ];
        launch(self, FILL, &[dst], n, &args)
    }

    fn add_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError> {
        cuda_binary(self, ADD, [dst, a, b], n)
    }

    fn mul_f32(&self, dst: &Buffer, a: &Buffer, b: &Buffer, n: usize) -> Result<(), DeviceError> {
        cuda_binary(self, MUL, [dst, a, b], n)
    }

    fn axpb_f32(
        &self,
        dst: &Buffer,
        x: &Buffer,
        a: f32,
        b: f32,
        n: usize,
    ) -> Result<(), DeviceError> {
        let args = [
            KernelArg::Buffer(dst),
            KernelArg::Buffer(x),
            KernelArg::F32(a),
            KernelArg::F32(b),
            KernelArg::U64(n as u64),
        ];
        launch(self, AXPB, &[dst, x], n, &args)
    }

    fn slow_fill_f32(
        &self,
        dst: &Buffer,
        n: usize,
        value: f32,
        spins: u64,
    ) -> Result<(), DeviceError> {
        let args = [
            KernelArg::Buffer(dst),
            KernelArg::U64(n as u64),
            KernelArg::F32(value),
            KernelArg::U64(spins),
        ];
        launch(self, SLOW_FILL, &[dst], n, &args)
    }

    fn dependent_copy_f32(
        &self,
        dst: &Buffer,
        src: &Buffer,
        n: usize,
        early: bool,
    ) -> Result<(), DeviceError> {
        check(self, &[dst, src], n)?;
        let module = module(self)?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            KernelArg::Buffer(dst),
            KernelArg::Buffer(src),
            KernelArg::U64(n as u64),
            KernelArg::U32(u32::from(early)),
        ];
        let config = graft_cuda::Launch {
            grid: grid(n),
            block: block(),
            shared_bytes: 0,
        };
        self.launch_dependent(&module, DEPENDENT_COPY, &config, &args)
    }

    fn dependents_overlap(&self) -> bool {
        self.compute_capability().0 >= 9 && graft_cuda::programmatic::supported()
    }

    inherent_hooks!(CudaQueue);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_defines_every_kernel() {
        for name in NAMES {
            assert!(
                KERNELS_CU.contains(&format!("void {name}(")),
                "{name} missing"
            );
        }
    }

    /// NVRTC compiles the source, and the PTX exports its kernels.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc), present on GPU machines"]
    fn nvrtc_compiles_the_source() {
        let image = graft_cuda::compile_ptx(KERNELS_CU, "graft_test_kernels.cu")
            .expect("kernels.cu compiles");
        let text = String::from_utf8_lossy(&image);
        for name in NAMES {
            assert!(text.contains(&format!(".entry {name}(")), "{name} missing");
        }
    }

    #[test]
    fn sim_kernels_check_their_buffers() {
        use graft_core::{Config, Graft};
        let dev = graft_sim::SimDevice::new();
        let mut g: Graft<_, ()> = Graft::new(dev.clone(), Config::default());
        let b = g.alloc(16).unwrap();
        dev.fill_f32(&b, 4, 2.0).unwrap();
        assert_eq!(g.read_f32(&b).unwrap(), vec![2.0; 4]);
        assert!(matches!(
            dev.fill_f32(&b, 5, 2.0),
            Err(DeviceError::InvalidArgument { op: OP, .. })
        ));
        assert!(matches!(
            dev.axpb_f32(&b, &b, 1.0, 0.0, usize::MAX),
            Err(DeviceError::InvalidArgument { op: OP, .. })
        ));
        let other = graft_sim::SimDevice::new();
        assert!(matches!(
            other.fill_f32(&b, 1, 0.0),
            Err(DeviceError::InvalidArgument { op: OP, .. })
        ));
    }
}
