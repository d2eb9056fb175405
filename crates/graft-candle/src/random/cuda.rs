//! The generator's CUDA kernels: their source, compiled with NVRTC once per process
//! (graft-candle-kernels' `Kernels`), loaded into a candle device, and launched on the
//! device's stream with the state read through a pointer (never as a kernel parameter, which
//! a recorded graph would freeze).

use std::ops::Range;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{Result, bail};
use graft_candle_kernels::{Args, Kernels};

/// The module's name in candle's per-device table of custom modules.
const MODULE: &str = "graft_candle_philox";
/// Writes `n` uniforms from the state; one thread per 4-word block.
const UNIFORM: &str = "graft_philox_uniform";
/// Adds a block count to the state's offset; one thread.
const ADVANCE: &str = "graft_philox_advance";
/// Threads per CUDA block of the uniform kernel.
const THREADS: u32 = 256;
/// The advance kernel's launch.
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// The kernels: graft-philox's generator, then the counter layout and the f32 conversion of
/// `philox.rs` (`uniform.cu`).
const SOURCE: &str = concat!(graft_philox::philox_cu!(), include_str!("uniform.cu"));

/// The module, compiled on first use and kept for the process.
static KERNELS: Kernels = Kernels::new(MODULE, SOURCE);

/// Compiles the kernels if this process has not yet, and loads them into `device` (a no-op
/// when it holds them already).
pub(super) fn load(device: &CudaDevice) -> Result<()> {
    let ptx = KERNELS.ptx(device)?;
    for name in [UNIFORM, ADVANCE] {
        device.get_or_load_custom_func(name, MODULE, &ptx)?;
    }
    Ok(())
}

/// `n` (> 0) uniforms drawn from the state words at `range` of `state`, in a new f32 tensor's
/// storage on the same device and stream.
pub(super) fn uniform(state: &CudaStorage, range: Range<usize>, n: usize) -> Result<CudaStorage> {
    let device = &state.device;
    let grid = u32::try_from(n.div_ceil(4).div_ceil(THREADS as usize));
    let Ok(grid) = grid else {
        bail!(
            "a draw of {n} random numbers needs more CUDA blocks than a launch allows; draw fewer at a time"
        );
    };
    let words = state.as_cuda_slice::<u32>()?.slice(range);
    // SAFETY: the uniform kernel writes all `n` elements (threads cover ceil(n / 4) blocks of 4
    // lanes, bounded by `n`) before anything reads them: the kernel is launched just below on
    // the device's stream, which orders every later use of the tensor.
    let out = unsafe { device.alloc::<f32>(n)? };
    let n = n as u64;
    // Loaded by `DeviceRng::new`: the launch below finds the module and only looks the
    // function up.
    let stream = device.cuda_stream();
    let words = words.device_ptr(&stream).0;
    let out_ptr = out.device_ptr(&stream).0;
    let mut args = Args::new();
    args.arg(&words).arg(&out_ptr).arg(&n);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `graft_philox_uniform(const unsigned int*, float*, unsigned
    // long long)`: `words` is 4 u32 (checked by the caller's `state_range`), `out` holds `n`
    // f32 and the kernel writes no element at or past `n`; both live until the launch is
    // enqueued, and the stream orders the kernel after the state's last write.
    unsafe { KERNELS.launch(device, &stream, UNIFORM, cfg, false, &mut args) }?;
    Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
}

/// Adds `blocks` to the offset of the state words at `range` of `state`, on the device.
pub(super) fn advance(state: &mut CudaStorage, range: Range<usize>, blocks: u64) -> Result<()> {
    let device = state.device.clone();
    let slice = state.as_cuda_slice_mut::<u32>()?;
    let mut words = slice.slice_mut(range);
    let stream = device.cuda_stream();
    let words = words.device_ptr_mut(&stream).0;
    let mut args = Args::new();
    args.arg(&words).arg(&blocks);
    // SAFETY: the arguments match `graft_philox_advance(unsigned int*, unsigned long long)`;
    // `words` is the state's 4 u32 (checked by the caller's `state_range`), written by one
    // thread; the stream orders this kernel after the draw that read the old offset.
    unsafe { KERNELS.launch(&device, &stream, ADVANCE, ONE_THREAD, false, &mut args) }?;
    Ok(())
}
