//! The CUDA plumbing the ops share: a module's source compiled with NVRTC once per process (per
//! device architecture for native modules: programmatic dependents, tensor cores) and loaded
//! into a candle device (candle keeps it per device by module name), the one launch every
//! kernel goes through ([`Kernels::launch`], plain or as a programmatic dependent), the CUDA C
//! prelude every module starts with (dtype conversions by hand, warp reductions, the
//! programmatic-launch trigger and wait; no headers), the typed device view of a contiguous
//! input, and the device address of a tensor an op holds.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{Layout, Result, Storage, Tensor};

use crate::KernelError;

/// The start of every module's source after graft-cuda's 16-bit floats and their conversions
/// to and from f32 ([`graft_cuda::HALF_CU`], shared with graft-cuda's own kernels): 16-byte
/// loads unpacked to f32 (`GraftVec`), and warp reductions over all 32 lanes (every block of
/// these kernels is a whole number of warps).
const PRELUDE: &str = r#"
#define GRAFT_NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ float graft_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}
__device__ __forceinline__ float graft_warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The sum of v over the block (whole warps, at most 1,024 threads) in a fixed order, returned
// to every thread; `scratch` is 32 floats of shared memory, free again when it returns.
__device__ __forceinline__ float graft_block_sum(float v, float* scratch) {
    v = graft_warp_sum(v);
    const unsigned int lane = threadIdx.x & 31u;
    __syncthreads();
    if (lane == 0) {
        scratch[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const float t = lane < (blockDim.x >> 5) ? scratch[lane] : 0.0f;
    return graft_warp_sum(t);
}

// The maximum of v over the block, as graft_block_sum.
__device__ __forceinline__ float graft_block_max(float v, float* scratch) {
    v = graft_warp_max(v);
    const unsigned int lane = threadIdx.x & 31u;
    __syncthreads();
    if (lane == 0) {
        scratch[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const float t = lane < (blockDim.x >> 5) ? scratch[lane] : GRAFT_NEG_INF;
    return graft_warp_max(t);
}

// 16 bytes of T as f32: E elements.
template <typename T> struct GraftVec;
template <> struct GraftVec<float> {
    static const unsigned int E = 4;
    __device__ static void unpack(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
};
template <> struct GraftVec<GraftBf16> {
    static const unsigned int E = 8;
    __device__ static void unpack(uint4 v, float* f) {
        const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
};
template <> struct GraftVec<GraftF16> {
    static const unsigned int E = 8;
    __device__ static void unpack(uint4 v, float* f) {
        const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            GraftF16 lo, hi;
            lo.bits = (unsigned short)(u[i] & 0xffffu);
            hi.bits = (unsigned short)(u[i] >> 16);
            f[2 * i] = graft_to_f32(lo);
            f[2 * i + 1] = graft_to_f32(hi);
        }
    }
};

// Programmatic dependent launch (compute capability 9.0+; nothing before): a kernel lets the
// kernel after it on the stream start (`graft_pdl_trigger`, at its very start, so the next
// kernel's blocks can load their weights while this one runs), and waits for the kernel before
// it to finish and flush its writes (`graft_pdl_wait`) before it reads or writes anything that
// kernel (or any kernel before it) touches. Launched plainly, both do nothing.
__device__ __forceinline__ void graft_pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void graft_pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Asks L2 for `bytes` (a multiple of 16) at `p` (16-byte aligned) without waiting for them:
// one bulk prefetch on compute capability 9.0, a prefetch per 128-byte line before it.
__device__ __forceinline__ void graft_prefetch_l2(const void* p, unsigned int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    for (unsigned int at = 0; at < bytes; at += 128u) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)p + at));
    }
#endif
}

// The row (of head_dim elements) of a [blocks, kv_heads, block_size, head_dim] cache that holds
// position j of KV head kvh for one sequence: in block tb[j / block_size] of the sequence's
// block-table row `tb` (a paged cache), or in block `own` without a table (a static cache:
// block_size is its max_seq, and `own` its row). A block id past the cache is clamped to the
// last (the kernels cannot report data; the CPU twins refuse it).
__device__ __forceinline__ unsigned long long graft_cache_place(
    const unsigned int* tb, unsigned int own, unsigned int blocks, unsigned int kv_heads,
    unsigned int kvh, unsigned int block_size, unsigned int j) {
    unsigned int blk = tb ? tb[j / block_size] : own;
    if (blk >= blocks) {
        blk = blocks - 1u;
    }
    return ((unsigned long long)blk * kv_heads + kvh) * block_size + j % block_size;
}

// Two 16-bit floats' bits as one 32-bit word, `lo` in the low half (an mma operand, or two
// elements of a 16-byte store).
template <typename T>
__device__ __forceinline__ unsigned int graft_pack2(T lo, T hi) {
    return (unsigned int)lo.bits | ((unsigned int)hi.bits << 16);
}

// One tensor-core step, c += a * b: a 16 x 16 (rows by k, row-major fragments), b 16 x 8 (k
// by columns, column-major), c 16 x 8 in f32, for bf16 and f16 operands (compute capability
// 8.0 or later; nothing before, where no kernel calls it).
template <typename T>
__device__ __forceinline__ void graft_mma_16816(float* c, unsigned int a0, unsigned int a1,
                                                unsigned int a2, unsigned int a3,
                                                unsigned int b0, unsigned int b1);
#if __CUDA_ARCH__ >= 800
#define GRAFT_MMA_16816(T, ptx)                                                              \
    template <>                                                                              \
    __device__ __forceinline__ void graft_mma_16816<T>(float* c, unsigned int a0,            \
                                                       unsigned int a1, unsigned int a2,     \
                                                       unsigned int a3, unsigned int b0,     \
                                                       unsigned int b1) {                    \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ptx "." ptx                    \
                     ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"            \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                        \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                \
    }
GRAFT_MMA_16816(GraftBf16, "bf16")
GRAFT_MMA_16816(GraftF16, "f16")
#endif

// X(suffix, type) for every dtype the kernels take: the extern "C" names end in the suffix.
#define GRAFT_FOR_DTYPES(X) X(f32, float) X(bf16, GraftBf16) X(f16, GraftF16)
"#;

/// Whether launches asked for as programmatic dependents are ([`set_programmatic`]).
static PROGRAMMATIC: AtomicBool = AtomicBool::new(true);

/// Whether the kernels this crate launches as programmatic dependents (`decode_step`'s) are
/// launched so (on, the default, where the device and driver can) or plainly, with full
/// edges between kernels (off): for measuring what the programmatic edges give. Work already
/// recorded keeps its edges. The results are the same either way.
pub fn set_programmatic(on: bool) {
    PROGRAMMATIC.store(on, Ordering::Relaxed);
}

/// A module's PTX for one architecture, or why NVRTC gave none.
type Compiled = std::result::Result<Arc<str>, KernelError>;

/// One CUDA module of candle custom kernels: its name in candle's per-device table, its source
/// (after the prelude) and its PTX, compiled on first use and kept for the process (or NVRTC's
/// error). Kept in a `static`, so that a process compiles each module once (a native module
/// once per device architecture). Public for
/// the other candle crates' own kernels (graft-candle's random numbers).
#[derive(Debug)]
pub struct Kernels {
    module: &'static str,
    source: &'static str,
    /// Compiled for the device's architecture ([`Kernels::native`]); otherwise for NVRTC's
    /// default one.
    native: bool,
    /// The PTX compiled for each compute capability asked for (major * 10 + minor; 0: NVRTC's
    /// default architecture).
    ptx: Mutex<Vec<(u32, Compiled)>>,
}

/// The arguments of one launch: a pointer to each parameter's value, in order, borrowed for
/// the launch (device buffers are passed as their `u64` addresses).
#[derive(Debug)]
pub struct Args<'a> {
    pointers: Vec<*mut c_void>,
    values: PhantomData<&'a ()>,
}

impl<'a> Args<'a> {
    /// No arguments yet.
    pub fn new() -> Self {
        Args {
            pointers: Vec::with_capacity(24),
            values: PhantomData,
        }
    }

    /// Adds the next parameter's value.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.pointers.push((value as *const T).cast_mut().cast());
        self
    }
}

impl Default for Args<'_> {
    fn default() -> Self {
        Args::new()
    }
}

impl Kernels {
    /// A module named `module` (unique in the process) with `source` after the prelude,
    /// compiled for NVRTC's default architecture (its kernels' math the same on every device).
    pub const fn new(module: &'static str, source: &'static str) -> Self {
        Self {
            module,
            source,
            native: false,
            ptx: Mutex::new(Vec::new()),
        }
    }

    /// [`Kernels::new`] compiled for each device's own architecture: for kernels that are
    /// launched as programmatic dependents (their trigger and wait are instructions of compute
    /// capability 9.0; before it they compile to nothing) or that run on tensor cores
    /// (`graft_mma_16816`, 8.0).
    pub const fn native(module: &'static str, source: &'static str) -> Self {
        Self {
            module,
            source,
            native: true,
            ptx: Mutex::new(Vec::new()),
        }
    }

    /// The module's name in candle's per-device table of custom modules.
    pub fn module(&self) -> &'static str {
        self.module
    }

    /// The module's PTX for `device` (for its architecture, if native), compiled if
    /// this process has not yet; pass it with [`Self::module`] to
    /// `CudaDevice::get_or_load_custom_func`, which loads it into a device only once.
    pub fn ptx(&self, device: &CudaDevice) -> Result<Arc<str>> {
        self.ptx_for(self.arch(device)?)
    }

    /// The compute capability the module is compiled for on `device` (major * 10 + minor; 0:
    /// NVRTC's default, for a module that is not native).
    fn arch(&self, device: &CudaDevice) -> Result<u32> {
        if !self.native {
            return Ok(0);
        }
        let (major, minor) = capability(self.module, device)?;
        Ok((major * 10 + minor) as u32)
    }

    /// The module's PTX for `arch`, compiled if this process has not yet.
    fn ptx_for(&self, arch: u32) -> Result<Arc<str>> {
        let mut compiled = self.ptx.lock().unwrap_or_else(PoisonError::into_inner);
        let at = match compiled.iter().position(|(a, _)| *a == arch) {
            Some(at) => at,
            None => {
                compiled.push((arch, compile(self.module, self.source, arch)));
                compiled.len() - 1
            }
        };
        match &compiled[at].1 {
            Ok(ptx) => Ok(Arc::clone(ptx)),
            Err(err) => Err(candle_core::Error::wrap(err.clone())),
        }
    }

    /// Launches kernel `name` of the module on `stream` (the device's own or a side stream of
    /// it) with `config` and `args`; as a programmatic dependent of the kernel before it when
    /// `dependent`, the module is [`Kernels::native`] and the device has compute
    /// capability 9.0 or later (through graft-cuda's
    /// [`programmatic::launch`](graft_cuda::programmatic::launch), which launches plainly
    /// where the driver cannot).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type; every address
    /// among them must be memory of `device` that the kernel may read or write as it does,
    /// alive until the launch has run; `config` must be one the kernel supports (its block
    /// size and shared memory). With `dependent`, the kernel must call `graft_pdl_wait()`
    /// before it touches bytes that kernels before it on the stream touch.
    pub unsafe fn launch(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        name: &str,
        config: LaunchConfig,
        dependent: bool,
        args: &mut Args<'_>,
    ) -> Result<()> {
        let arch = self.arch(device)?;
        let func = device.get_or_load_custom_func(name, self.module, &self.ptx_for(arch)?)?;
        // Only a native module is compiled for the device (arch 0 otherwise), and only from
        // compute capability 9.0 has it the trigger and the wait.
        let dependent = dependent && arch >= 90 && PROGRAMMATIC.load(Ordering::Relaxed);
        let launch = graft_cuda::Launch {
            grid: config.grid_dim,
            block: config.block_dim,
            shared_bytes: config.shared_mem_bytes,
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
        // SAFETY: the caller's contract (arguments, memory, configuration, the dependent's
        // wait); the function belongs to a module loaded in `stream`'s context (candle's
        // device), made current just above.
        unsafe {
            graft_cuda::programmatic::launch(
                stream.cu_stream(),
                func.cu_function(),
                &launch,
                dependent,
                &mut args.pointers,
            )
        }
        .map_err(|source| KernelError::Launch {
            kernel: name.to_owned(),
            source,
        })?;
        Ok(())
    }
}

/// `device`'s compute capability, major and minor.
pub(crate) fn capability(module: &'static str, device: &CudaDevice) -> Result<(i32, i32)> {
    device
        .cuda_stream()
        .context()
        .compute_capability()
        .map_err(|source| KernelError::Capability { module, source }.into())
}

/// Compiles `source` for compute capability `arch` (major * 10 + minor; 0: NVRTC's default).
fn compile(module: &'static str, source: &str, arch: u32) -> Compiled {
    let opts = nvrtc::CompileOptions {
        name: Some(format!("{module}.cu")),
        options: match arch {
            0 => Vec::new(),
            arch => vec![format!("--gpu-architecture=compute_{arch}")],
        },
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts([graft_cuda::HALF_CU, PRELUDE, source].concat(), opts)
        .map_err(|e| match e {
        nvrtc::CompileError::CompileError { log, .. } => KernelError::Compile {
            module,
            log: log.to_string_lossy().into_owned(),
        },
        other => KernelError::Nvrtc {
            module,
            reason: other.to_string(),
        },
    })?;
    let text = match ptx.as_bytes() {
        Some(image) => {
            let text = image.split(|&b| b == 0).next().unwrap_or_default();
            String::from_utf8(text.to_vec()).map_err(|_| KernelError::PtxNotText { module })?
        }
        None => ptx.to_src(),
    };
    Ok(text.into())
}

/// The elements of the contiguous tensor (`slice`, `layout`) as a device view (its start
/// offset applied).
pub(crate) fn view<'a, T>(
    op: &'static str,
    input: &'static str,
    slice: &'a CudaSlice<T>,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(KernelError::NotContiguous { op, input }.into());
    };
    Ok(slice.slice(start..end))
}

/// The device address of the first element of `t` (f32, bf16, f16, u32 or i64, on a CUDA device), for
/// a kernel argument: an op holds a clone of each tensor it reaches this way (candle's custom
/// ops take at most three typed inputs), which keeps the storage alive until the launch is
/// enqueued; candle's stream orders the launch after every earlier use of the storage.
pub(crate) fn address(
    op: &'static str,
    t: &Tensor,
    input: &'static str,
    device: &CudaDevice,
) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(KernelError::Device { op, input }.into());
    };
    let stream = device.cuda_stream();
    let base = match &cuda.slice {
        CudaStorageSlice::U32(s) => s.device_ptr(&stream).0,
        CudaStorageSlice::I64(s) => s.device_ptr(&stream).0,
        CudaStorageSlice::BF16(s) => s.device_ptr(&stream).0,
        CudaStorageSlice::F16(s) => s.device_ptr(&stream).0,
        CudaStorageSlice::F32(s) => s.device_ptr(&stream).0,
        _ => {
            return Err(KernelError::UnsupportedDType {
                op,
                input,
                got: t.dtype(),
            }
            .into());
        }
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}
