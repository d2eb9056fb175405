//! A safe, generic kernel API: compile CUDA C++ with NVRTC once ([`CudaQueue::load_module`]),
//! then launch its kernels on the runtime stream ([`CudaQueue::launch_function`]) with
//! arguments checked against the kernel's real parameter list, so callers need no `unsafe`.
//!
//! Soundness of the safe launch rests on one check: `cuLaunchKernel` reads, for parameter `i`,
//! as many bytes as the kernel declares from the pointer `params[i]`, for as many parameters as
//! the kernel has. At load time every kernel's parameter sizes are read from the driver
//! (`cuFuncGetParamInfo`, CUDA 12.4+), and every launch checks that the arguments match them in
//! count and size before the driver sees them. What the driver then reads is exactly the
//! argument values on this function's stack.
//!
//! Pointer arguments are graft [`Buffer`]s ([`KernelArg::Buffer`], [`KernelArg::BufferAt`]),
//! never raw addresses: each is checked to belong to this device, to be valid (graft has not
//! reused its memory) and to hold the offset ([`Buffer::device_addr`]), so every pointer the
//! driver gets is live device memory of this device, mapped in graft's pool. What a kernel
//! does with its pointers (indexing past a buffer's end) is the kernel's contract, reported
//! by the driver as a device fault, never host memory written through a stray pointer.

use std::ffi::{CString, c_void};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::nvrtc;
use graft_core::{Buffer, DeviceError, DeviceId, DeviceOp};

use crate::device::CudaQueue;
use crate::driver;
use crate::error::invalid_argument;
use crate::inner::Inner;
use crate::programmatic::Launch;

/// Most kernel parameters a launch passes without allocating (a stack array).
const STACK_ARGS: usize = 16;

/// Most parameters a kernel can have: CUDA limits parameters to 32 KiB, each at least a byte.
const MAX_PARAMS: usize = 32 << 10;

/// One kernel argument, passed by value. Its size must equal the kernel parameter's:
/// 8 bytes for pointers (`Buffer`, `BufferAt`, `Null`) and `U64` (`unsigned long long`,
/// `size_t`), 4 for `F32`, `I32` and `U32`.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A pointer (`T*`) to the start of a graft buffer of the launching device.
    Buffer(&'a Buffer),
    /// A pointer (`T*`) `offset` bytes into a graft buffer of the launching device
    /// (`offset <= len`).
    BufferAt(&'a Buffer, usize),
    /// A null pointer, for an optional operand the kernel checks for.
    Null,
    /// A `float`.
    F32(f32),
    /// An `int`.
    I32(i32),
    /// An `unsigned int`.
    U32(u32),
    /// An `unsigned long long` (or `size_t`).
    U64(u64),
}

impl KernelArg<'_> {
    /// The argument's bytes, in the first `size` bytes of an 8-byte slot; buffers are
    /// resolved for device `device` ([`Buffer::device_addr`]).
    #[inline]
    fn encode(self, device: DeviceId) -> Result<([u8; 8], usize), DeviceError> {
        let op = DeviceOp::KernelLaunch;
        let mut slot = [0u8; 8];
        let size = match self {
            KernelArg::Buffer(b) => {
                slot = b.device_addr(op, device, 0, 0)?.0.to_ne_bytes();
                8
            }
            KernelArg::BufferAt(b, offset) => {
                slot = b.device_addr(op, device, offset, 0)?.0.to_ne_bytes();
                8
            }
            KernelArg::Null => 8,
            KernelArg::U64(v) => {
                slot = v.to_ne_bytes();
                8
            }
            KernelArg::F32(v) => {
                slot[..4].copy_from_slice(&v.to_ne_bytes());
                4
            }
            KernelArg::I32(v) => {
                slot[..4].copy_from_slice(&v.to_ne_bytes());
                4
            }
            KernelArg::U32(v) => {
                slot[..4].copy_from_slice(&v.to_ne_bytes());
                4
            }
        };
        Ok((slot, size))
    }
}

/// One kernel of a module: its handle and the byte size of each of its parameters.
struct Kernel {
    name: String,
    function: sys::CUfunction,
    param_sizes: Box<[usize]>,
}

/// A compiled, loaded CUDA module and the kernels looked up in it, in the order their names
/// were given to [`CudaQueue::load_module`]. Launch them with [`CudaQueue::launch_function`]
/// by index ([`CudaModule::index`] finds one by name).
///
/// Keeps its device alive. Dropping it unloads the module (`cuModuleUnload`); a failure there
/// goes to the device's sticky error slot. Drop it only once no launched work still runs its
/// kernels (synchronize first), as with any CUDA module.
pub struct CudaModule {
    device: Arc<Inner>,
    module: sys::CUmodule,
    kernels: Vec<Kernel>,
}

// SAFETY: the module and function handles are driver handles usable from any thread once the
// device's context is current, which every use makes it (`launch_function` enters the device
// first, `Drop` makes it current). They are only read after construction (launches), and the
// module is unloaded once, in `Drop`, with exclusive access.
unsafe impl Send for CudaModule {}
// SAFETY: see `Send`: shared use only passes the immutable handles to `cuLaunchKernel`, which
// the driver allows from several threads at once.
unsafe impl Sync for CudaModule {}

impl CudaModule {
    /// The index of the kernel called `name`, for [`CudaQueue::launch_function`].
    pub fn index(&self, name: &str) -> Option<usize> {
        self.kernels.iter().position(|k| k.name == name)
    }

    /// The kernels' names, in index order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.kernels.iter().map(|k| k.name.as_str())
    }

    /// The byte sizes of kernel `index`'s parameters, as the driver reports them.
    pub fn param_sizes(&self, index: usize) -> Option<&[usize]> {
        self.kernels.get(index).map(|k| &*k.param_sizes)
    }
}

impl fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaModule")
            .field("device", &self.device.id)
            .field("kernels", &self.names().collect::<Vec<_>>())
            .finish()
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let module = std::mem::replace(&mut self.module, ptr::null_mut());
        if module.is_null() {
            return;
        }
        if let Err(err) = self.device.make_current(DeviceOp::ModuleLoad) {
            self.device.record_sticky(err);
            return;
        }
        // `module` came from cuModuleLoadData in `load_module`, is owned by this value alone,
        // and is unloaded exactly once (swapped out above); its function handles die with it
        // and are not used afterwards.
        self.device
            .sticky_on_error(driver::function::unload(DeviceOp::ModuleLoad, module));
    }
}

/// Compiles CUDA C++ source with NVRTC (default options) to a NUL-terminated PTX image. Needs
/// libnvrtc but no GPU, so tests can check that kernel sources compile. A source that does
/// not compile is [`DeviceError::Compile`], with NVRTC's log; libnvrtc missing is
/// [`DeviceError::Unavailable`].
pub fn compile_ptx(source: &str, name: &str) -> Result<Vec<u8>, DeviceError> {
    compile_source(source, name, None)
}

/// [`compile_ptx`] for the virtual architecture of compute capability `capability`
/// (`--gpu-architecture=compute_<major><minor>`, e.g. from
/// [`CudaDevice::compute_capability`](crate::CudaDevice::compute_capability)): what
/// instructions of that architecture need, such as a programmatic dependent's
/// `griddepcontrol.wait` (9.0). The image loads on devices of that capability or later.
pub fn compile_ptx_for(
    source: &str,
    name: &str,
    capability: (u32, u32),
) -> Result<Vec<u8>, DeviceError> {
    compile_source(source, name, Some(capability))
}

/// Compiles CUDA C++ `source` with NVRTC (default options: no fast math) to a NUL-terminated
/// PTX image. Needs no GPU. Errors, with `DeviceOp::ModuleLoad`: a NUL byte in the source or
/// its name (`InvalidArgument`), libnvrtc missing or lacking a function (`Unavailable`), the
/// source not compiling or NVRTC failing (`Compile`, with NVRTC's log).
fn compile_source(
    source: &str,
    name: &str,
    capability: Option<(u32, u32)>,
) -> Result<Vec<u8>, DeviceError> {
    let op = DeviceOp::ModuleLoad;
    // cudarc's `Program::create` panics on interior NULs: refuse them first.
    if source.contains('\0') || name.contains('\0') {
        return Err(DeviceError::InvalidArgument {
            op,
            what: "the CUDA source or its name contains a NUL byte",
        });
    }
    if !driver::function::nvrtc_present() {
        return Err(DeviceError::Unavailable {
            op,
            what: "libnvrtc could not be loaded; install the CUDA toolkit's NVRTC or add it to LD_LIBRARY_PATH",
        });
    }
    let opts = nvrtc::CompileOptions {
        name: Some(name.to_string()),
        options: capability
            .map(|(major, minor)| format!("--gpu-architecture=compute_{major}{minor}"))
            .into_iter()
            .collect(),
        ..Default::default()
    };
    // cudarc panics if an NVRTC symbol is missing; report that instead of unwinding.
    let compiled = catch_unwind(AssertUnwindSafe(|| {
        nvrtc::compile_ptx_with_opts(source, opts)
    }))
    .map_err(|_| DeviceError::Unavailable {
        op,
        what: "libnvrtc lacks a function graft calls (cudarc panicked calling it); install NVRTC 12 or later",
    })?;
    let ptx = compiled.map_err(|e| DeviceError::Compile {
        op,
        log: match e {
            nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into(),
            // NVRTC failed before or after compiling (no compile log exists): its own error.
            other => format!("NVRTC failed: {other}").into(),
        },
    })?;
    let mut image = ptx
        .as_bytes()
        .ok_or(DeviceError::Compile {
            op,
            log: "NVRTC returned no PTX image".into(),
        })?
        .to_vec();
    if image.last() != Some(&0) {
        image.push(0);
    }
    Ok(image)
}

/// What a driver without `cuFuncGetParamInfo` is reported with.
const NO_PARAM_INFO: &str = "libcuda has no cuFuncGetParamInfo, which checked launches need; update the NVIDIA driver to CUDA 12.4 or later";

/// The byte size of each parameter of `f`.
fn param_sizes(f: sys::CUfunction) -> Result<Box<[usize]>, DeviceError> {
    let mut sizes = Vec::new();
    loop {
        // `f` is a function of a loaded module (looked up just before).
        match driver::function::param_info(DeviceOp::ModuleLoad, f, sizes.len())? {
            Some((_, size)) => sizes.push(size),
            None => return Ok(sizes.into_boxed_slice()),
        }
        if sizes.len() > MAX_PARAMS {
            return Err(DeviceError::Unavailable {
                op: DeviceOp::ModuleLoad,
                what: "cuFuncGetParamInfo reported more parameters than a kernel can have; update the NVIDIA driver",
            });
        }
    }
}

impl CudaQueue {
    /// Compiles `cuda_source` with NVRTC for the device's architecture, loads it (`cuModuleLoadData`) and looks up
    /// `kernel_names` (`extern "C" __global__` functions), reading each kernel's parameter
    /// sizes so that [`CudaQueue::launch_function`] can check its arguments. Compile once and
    /// keep the module: compiling costs milliseconds to seconds.
    ///
    /// Not for use during a capture (loading a module is not a stream operation, but keep
    /// setup out of captured bodies). Errors, all with `DeviceOp::ModuleLoad`: the source not
    /// compiling (`Compile`, with NVRTC's log), NVRTC missing or a driver older than CUDA 12.4
    /// (`Unavailable`), a NUL in a kernel name (`InvalidArgument`), the driver rejecting the
    /// PTX or an unknown kernel name (`Driver`, `CUDA_ERROR_NOT_FOUND`).
    pub fn load_module(
        &self,
        cuda_source: &str,
        kernel_names: &[&str],
    ) -> Result<CudaModule, DeviceError> {
        let op = DeviceOp::ModuleLoad;
        let inner = &self.inner;
        inner.make_current(op)?;
        if !driver::function::param_info_available() {
            return Err(DeviceError::Unavailable {
                op,
                what: NO_PARAM_INFO,
            });
        }
        let names: Vec<CString> = kernel_names
            .iter()
            .map(|n| CString::new(*n))
            .collect::<Result<_, _>>()
            .map_err(|_| DeviceError::InvalidArgument {
                op,
                what: "a kernel name contains a NUL byte",
            })?;
        // For the device's own architecture, so its instructions (a programmatic dependent's
        // wait) are there.
        let image = compile_source(cuda_source, "graft_module.cu", Some(inner.capability))?;
        let mut module = CudaModule {
            device: Arc::clone(inner),
            module: ptr::null_mut(),
            kernels: Vec::with_capacity(names.len()),
        };
        // `image` is NUL-terminated (`compile_source`); the device's context is current. The
        // module is owned by `module` from here and unloaded in its Drop (also on the error
        // paths below).
        let handle = driver::function::load(op, &image)?;
        module.module = handle;
        for (name, cname) in kernel_names.iter().zip(&names) {
            let f = driver::function::get(op, handle, cname)?;
            // cudarc panics if the symbol is missing despite the check above; never unwind.
            let sizes = catch_unwind(AssertUnwindSafe(|| param_sizes(f))).unwrap_or(Err(
                DeviceError::Unavailable {
                    op,
                    what: NO_PARAM_INFO,
                },
            ))?;
            module.kernels.push(Kernel {
                name: (*name).to_string(),
                function: f,
                param_sizes: sizes,
            });
        }
        Ok(module)
    }

    /// Launches kernel `kernel` (an index into the names given to
    /// [`CudaQueue::load_module`]) of module `m` on the runtime stream: captured when
    /// capturing, like every other operation of the device. `args` must match the kernel's
    /// parameters in count and byte size (see [`KernelArg`]); otherwise, or for an index out
    /// of range, a grid or block with a zero dimension, a module or buffer of another device,
    /// or an offset past a buffer's end, the launch is refused with `InvalidArgument` before
    /// the driver sees it, and a buffer graft reused with `InvalidBuffer`. No heap allocation
    /// for up to 16 arguments.
    pub fn launch_function(
        &self,
        m: &CudaModule,
        kernel: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        self.inner.make_current(DeviceOp::KernelLaunch)?;
        let config = Launch {
            grid,
            block,
            shared_bytes,
        };
        self.launch_on(self.stream(), m, kernel, &config, false, args)
    }

    /// [`CudaQueue::launch_function`] as a programmatic dependent of the kernel before it on
    /// the runtime stream ([`crate::programmatic`]): it may start while that kernel runs, and
    /// a capture records a programmatic edge. The kernel must execute `griddepcontrol.wait`
    /// before it touches what the kernels before it touch; one that does not reads or writes
    /// memory they are still using (the simulator reports it as `ProgrammaticRace`). Where the
    /// device (compute capability below 9.0) or the driver cannot launch dependents, a plain
    /// launch.
    pub fn launch_dependent(
        &self,
        m: &CudaModule,
        kernel: usize,
        config: &Launch,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        self.inner.make_current(DeviceOp::KernelLaunch)?;
        // Before compute capability 9.0 there is no programmatic launch (nor wait).
        let dependent = self.inner.capability.0 >= 9;
        self.launch_on(self.stream(), m, kernel, config, dependent, args)
    }

    /// [`CudaQueue::launch_function`] on the device's side stream, after the runtime stream's
    /// earlier work (an event recorded on the runtime stream, waited on by the side stream) and
    /// *not* joined back: a test hook modelling framework code that forks work onto another
    /// stream. Eagerly, call [`CudaQueue::join_side_stream`] before relying on the result.
    /// During a capture the fork pulls the side stream into the capture, and leaving it
    /// unjoined makes `end_capture` fail with `Capture { violation: Unjoined, .. }`: the CUDA
    /// counterpart of the simulator's `launch_kernel_on_side_stream`.
    #[cfg(feature = "test-support")]
    pub fn launch_function_on_side_stream(
        &self,
        m: &CudaModule,
        kernel: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        self.inner.make_current(DeviceOp::OtherStream)?;
        let stream = self.inner.side.fork(&self.inner.context)?;
        let config = Launch {
            grid,
            block,
            shared_bytes,
        };
        self.launch_on(stream, m, kernel, &config, false, args)
    }

    /// Checks and launches on `stream`, a live stream of this device, as a programmatic
    /// dependent when `dependent`; the context is current.
    fn launch_on(
        &self,
        stream: sys::CUstream,
        m: &CudaModule,
        kernel: usize,
        config: &Launch,
        dependent: bool,
        args: &[KernelArg],
    ) -> Result<(), DeviceError> {
        let Launch { grid, block, .. } = *config;
        let op = DeviceOp::KernelLaunch;
        let inner = &self.inner;
        if !Arc::ptr_eq(&m.device, inner) {
            return Err(invalid_argument(
                op,
                "the module was loaded on another device",
            ));
        }
        let Some(k) = m.kernels.get(kernel) else {
            return Err(invalid_argument(
                op,
                "no kernel at this index in the module",
            ));
        };
        if args.len() != k.param_sizes.len() {
            return Err(invalid_argument(
                op,
                "the number of arguments differs from the kernel's parameters",
            ));
        }
        if [grid.0, grid.1, grid.2, block.0, block.1, block.2].contains(&0) {
            return Err(invalid_argument(op, "a grid or block dimension is zero"));
        }
        if args.len() <= STACK_ARGS {
            let mut slots = [[0u8; 8]; STACK_ARGS];
            let mut params: [*mut c_void; STACK_ARGS] = [ptr::null_mut(); STACK_ARGS];
            encode(args, &k.param_sizes, inner.id, &mut slots[..args.len()])?;
            for (p, s) in params.iter_mut().zip(slots.iter_mut()) {
                *p = s.as_mut_ptr().cast();
            }
            // SAFETY: see `raw_launch`: `params[..args.len()]` point at `slots`, which hold the
            // arguments, each checked against the kernel's parameter size by `encode`, whose
            // pointers are null or live graft memory of this device (checked by `encode`).
            unsafe { raw_launch(stream, k, config, dependent, &mut params) }
        } else {
            let mut slots = vec![[0u8; 8]; args.len()];
            encode(args, &k.param_sizes, inner.id, &mut slots)?;
            let mut params: Vec<*mut c_void> =
                slots.iter_mut().map(|s| s.as_mut_ptr().cast()).collect();
            // SAFETY: as above, with heap arrays of exactly `args.len()` entries.
            unsafe { raw_launch(stream, k, config, dependent, &mut params) }
        }
    }
}

/// Writes each argument into its slot, checking its size against the kernel's parameter and
/// resolving buffers for device `device`.
#[inline]
fn encode(
    args: &[KernelArg],
    sizes: &[usize],
    device: DeviceId,
    slots: &mut [[u8; 8]],
) -> Result<(), DeviceError> {
    for ((arg, &want), slot) in args.iter().zip(sizes).zip(slots) {
        let (bytes, size) = arg.encode(device)?;
        if size != want {
            return Err(invalid_argument(
                DeviceOp::KernelLaunch,
                "an argument's size differs from the kernel parameter's",
            ));
        }
        *slot = bytes;
    }
    Ok(())
}

/// Launches `k` on `stream` ([`crate::programmatic::launch`]), as a dependent when
/// `dependent`.
///
/// # Safety
/// `params` must hold at least `k.param_sizes.len()` pointers, the `i`-th pointing at
/// `k.param_sizes[i]` (at most 8) readable bytes holding the argument, all live for the call,
/// every device pointer among the arguments null or live device memory of the device;
/// `k` must belong to a module of the device, whose context is current, and `stream` must be a
/// live stream of that device. With `dependent`, the kernel waits before it touches what the
/// kernels before it touch (the caller's promise, see [`CudaQueue::launch_dependent`]).
unsafe fn raw_launch(
    stream: sys::CUstream,
    k: &Kernel,
    config: &Launch,
    dependent: bool,
    params: &mut [*mut c_void],
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the parameter pointers (count and sizes checked against
    // the driver's own parameter layout, so the driver reads only bytes of the slots), that
    // the device pointers among them are null or live memory of this device, that the
    // function belongs to this context, that `stream` is live, and a dependent's wait.
    unsafe { crate::programmatic::launch(stream, k.function, config, dependent, params) }
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_encode_in_their_declared_size() {
        let dev = DeviceId::fresh();
        assert_eq!(KernelArg::Null.encode(dev), Ok(([0; 8], 8)));
        assert_eq!(KernelArg::U64(7).encode(dev).unwrap().1, 8);
        let (bytes, size) = KernelArg::F32(1.5).encode(dev).unwrap();
        assert_eq!(size, 4);
        assert_eq!(&bytes[..4], &1.5f32.to_ne_bytes());
        assert_eq!(KernelArg::I32(-1).encode(dev).unwrap().0[..4], [0xff; 4]);
        assert_eq!(KernelArg::U32(3).encode(dev).unwrap().1, 4);
    }

    #[test]
    fn encode_rejects_size_mismatches() {
        let mut slots = [[0u8; 8]; 2];
        let dev = DeviceId::fresh();
        assert!(
            encode(
                &[KernelArg::F32(1.0), KernelArg::U64(2)],
                &[4, 8],
                dev,
                &mut slots
            )
            .is_ok()
        );
        assert_eq!(&slots[1], &2u64.to_ne_bytes());
        assert!(matches!(
            encode(&[KernelArg::F32(1.0)], &[8], dev, &mut slots),
            Err(DeviceError::InvalidArgument { .. })
        ));
    }

    /// Refused before NVRTC is touched; without libnvrtc a valid source is `Unavailable`.
    #[test]
    fn compile_ptx_refuses_nul_bytes_and_reports_a_missing_nvrtc() {
        assert!(matches!(
            compile_ptx("a\0b", "x.cu"),
            Err(DeviceError::InvalidArgument {
                op: DeviceOp::ModuleLoad,
                ..
            })
        ));
        if !driver::function::nvrtc_present() {
            assert!(matches!(
                compile_ptx(GOOD, "k.cu"),
                Err(DeviceError::Unavailable { .. })
            ));
        }
    }

    const GOOD: &str = "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }";

    #[test]
    #[ignore = "needs NVRTC (libnvrtc), present on GPU machines"]
    fn compile_ptx_compiles_a_kernel() {
        let ptx = compile_ptx(GOOD, "k.cu").expect("NVRTC compiles a valid kernel");
        assert!(String::from_utf8_lossy(&ptx).contains(".entry k("));
        assert_eq!(ptx.last(), Some(&0), "the image is NUL-terminated");
    }

    #[test]
    #[ignore = "needs NVRTC (libnvrtc), present on GPU machines"]
    fn compile_ptx_returns_the_log_of_a_bad_source() {
        match compile_ptx(
            "extern \"C\" __global__ void k() { undefined_name; }",
            "bad.cu",
        ) {
            Err(DeviceError::Compile { op, log }) => {
                assert_eq!(op, DeviceOp::ModuleLoad);
                assert!(log.contains("undefined_name"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
