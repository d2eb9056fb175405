//! The elementwise f32 kernels: compiled once per device with NVRTC, loaded as a module, and
//! launched with `cuLaunchKernel` (parameters on the stack, no allocation per launch).
//!
//! Source: `kernels.cu`. If NVRTC cannot be loaded, fails to compile, or writes PTX the driver
//! rejects (an NVRTC newer than the driver), the module is loaded from `kernels.ptx`, the same
//! source compiled ahead of time (`scripts/gen-kernels-ptx.py`) for `compute_75` at PTX ISA 8.4,
//! which the driver JIT-compiles for the GPU at hand. [`KernelSource`] says which one is in use.

use std::ffi::{CStr, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use cudarc::driver::sys;
use cudarc::nvrtc;
use graft_core::{DeviceError, DeviceOp};

use crate::error::check;

/// CUDA C++ source of the kernels.
pub(crate) const KERNELS_CU: &str = include_str!("kernels.cu");

/// The same kernels compiled ahead of time, NUL-terminated as `cuModuleLoadData` requires.
pub(crate) const KERNELS_PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

const FILL: &CStr = c"graft_fill_f32";
const ADD: &CStr = c"graft_add_f32";
const MUL: &CStr = c"graft_mul_f32";
const AXPB: &CStr = c"graft_axpb_f32";

/// Threads per block of every launch.
const BLOCK: u32 = 256;
/// Most blocks of one launch; the kernels' grid-stride loops cover any larger `n`.
const MAX_BLOCKS: usize = 1 << 16;

/// Where a device's kernels came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// Compiled at device creation by NVRTC from `kernels.cu`.
    Nvrtc,
    /// Loaded from the PTX shipped in the crate, because the NVRTC path failed for `reason`.
    EmbeddedPtx {
        /// Why NVRTC was not used.
        reason: String,
    },
}

/// A loaded kernel module and its functions. Handles are null until loaded; [`Kernels::unload`]
/// releases the module.
pub(crate) struct Kernels {
    module: sys::CUmodule,
    pub(crate) fill: sys::CUfunction,
    pub(crate) add: sys::CUfunction,
    pub(crate) mul: sys::CUfunction,
    pub(crate) axpb: sys::CUfunction,
    pub(crate) source: KernelSource,
}

impl Kernels {
    /// No module loaded.
    pub(crate) fn empty() -> Kernels {
        Kernels {
            module: ptr::null_mut(),
            fill: ptr::null_mut(),
            add: ptr::null_mut(),
            mul: ptr::null_mut(),
            axpb: ptr::null_mut(),
            source: KernelSource::Nvrtc,
        }
    }

    /// Compiles (or falls back to the shipped PTX) and loads the kernels into the context that
    /// is current on this thread.
    pub(crate) fn load() -> Result<Kernels, DeviceError> {
        let reason = match compile_with_nvrtc() {
            Ok(image) => match Kernels::load_image(&image) {
                Ok(kernels) => return Ok(kernels),
                Err(err) => format!("the driver rejected NVRTC's PTX: {err}"),
            },
            Err(err) => err.to_string(),
        };
        let mut kernels = Kernels::load_image(KERNELS_PTX.as_bytes())?;
        kernels.source = KernelSource::EmbeddedPtx { reason };
        Ok(kernels)
    }

    /// Loads a NUL-terminated PTX image and looks up the four kernels.
    fn load_image(image: &[u8]) -> Result<Kernels, DeviceError> {
        debug_assert_eq!(image.last(), Some(&0), "PTX images must be NUL-terminated");
        let mut kernels = Kernels::empty();
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call (the driver copies
        // it); a context is current (the caller's contract); the module handle is written into
        // a valid out-pointer and released by `unload` (called on error below or by the device).
        check(DeviceOp::ModuleLoad, unsafe {
            sys::cuModuleLoadData(&mut kernels.module, image.as_ptr().cast::<c_void>())
        })?;
        let looked_up = (|| {
            kernels.fill = function(kernels.module, FILL)?;
            kernels.add = function(kernels.module, ADD)?;
            kernels.mul = function(kernels.module, MUL)?;
            kernels.axpb = function(kernels.module, AXPB)?;
            Ok(())
        })();
        match looked_up {
            Ok(()) => Ok(kernels),
            Err(err) => {
                // Unloading a module we just loaded cannot fail in a way worth reporting over
                // the lookup error that brought us here.
                let _ = kernels.unload();
                Err(err)
            }
        }
    }

    /// Unloads the module, if loaded. The context must be current.
    pub(crate) fn unload(&mut self) -> Result<(), DeviceError> {
        let module = std::mem::replace(&mut self.module, ptr::null_mut());
        self.fill = ptr::null_mut();
        self.add = ptr::null_mut();
        self.mul = ptr::null_mut();
        self.axpb = ptr::null_mut();
        if module.is_null() {
            return Ok(());
        }
        // SAFETY: `module` came from cuModuleLoadData in `load_image` and is unloaded exactly
        // once: the handle was swapped out of `self` above.
        check(DeviceOp::ModuleLoad, unsafe { sys::cuModuleUnload(module) })
    }
}

pub(crate) fn function(module: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction, DeviceError> {
    let mut f: sys::CUfunction = ptr::null_mut();
    // SAFETY: `module` is a loaded module (load_image), `name` is NUL-terminated, and `f` is a
    // valid out-pointer. The function handle lives as long as the module.
    check(DeviceOp::ModuleLoad, unsafe {
        sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
    })?;
    Ok(f)
}

/// Compiles `kernels.cu` to a NUL-terminated PTX image, or says why it could not.
fn compile_with_nvrtc() -> Result<Vec<u8>, DeviceError> {
    compile_source(KERNELS_CU, "graft_kernels.cu")
}

/// Compiles CUDA C++ `source` with NVRTC (default options: no fast math) to a NUL-terminated
/// PTX image. Needs no GPU. Errors, with `DeviceOp::ModuleLoad`: a NUL byte in the source or
/// its name (`InvalidArgument`), libnvrtc missing or lacking a function (`Unavailable`), the
/// source not compiling or NVRTC failing (`Compile`, with NVRTC's log).
pub(crate) fn compile_source(source: &str, name: &str) -> Result<Vec<u8>, DeviceError> {
    let op = DeviceOp::ModuleLoad;
    // cudarc's `Program::create` panics on interior NULs: refuse them first.
    if source.contains('\0') || name.contains('\0') {
        return Err(DeviceError::InvalidArgument {
            op,
            what: "the CUDA source or its name contains a NUL byte",
        });
    }
    // SAFETY: `is_culib_present` only `dlopen`s candidate names of libnvrtc and drops each
    // handle; it runs no NVRTC code.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable {
            op,
            what: "libnvrtc could not be loaded; install the CUDA toolkit's NVRTC or add it to LD_LIBRARY_PATH",
        });
    }
    let opts = nvrtc::CompileOptions {
        name: Some(name.to_string()),
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

/// Launches `f` over `n` elements on `stream`: `ceil(n / 256)` blocks of 256 threads, at most
/// [`MAX_BLOCKS`] blocks. `params` holds one pointer to each kernel argument, in order.
///
/// # Safety
/// `f` must be a kernel of a module loaded in the current context whose parameter list matches
/// `params` in count, order and sizes; every device pointer among the arguments must be valid
/// for the `n` elements the kernel touches when it runs; `stream` must be a live stream of the
/// current context. `n` must be > 0.
pub(crate) unsafe fn launch_1d(
    op: DeviceOp,
    f: sys::CUfunction,
    n: usize,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), DeviceError> {
    debug_assert!(n > 0);
    let blocks = n.div_ceil(BLOCK as usize).min(MAX_BLOCKS) as c_uint;
    // SAFETY: the caller guarantees `f`, `stream` and the arguments; `params` is a live array of
    // pointers to the argument values for the duration of the call (cuLaunchKernel copies the
    // values before returning); no dynamic shared memory; `extra` is null.
    check(op, unsafe {
        sys::cuLaunchKernel(
            f,
            blocks,
            1,
            1,
            BLOCK,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_ptx_has_every_kernel_and_is_nul_terminated() {
        assert!(KERNELS_PTX.ends_with('\0'));
        assert_eq!(KERNELS_PTX.matches('\0').count(), 1);
        for name in [FILL, ADD, MUL, AXPB] {
            let name = name.to_str().unwrap();
            assert!(
                KERNELS_PTX.contains(&format!(".visible .entry {name}(")),
                "{name} missing from kernels.ptx"
            );
            assert!(
                KERNELS_CU.contains(&format!("void {name}(")),
                "{name} missing from kernels.cu"
            );
        }
    }

    /// NVRTC compiles the source, and the PTX exports the four kernels.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc), present on GPU machines"]
    fn nvrtc_compiles_the_source() {
        let image = compile_with_nvrtc().expect("kernels.cu compiles");
        let text = String::from_utf8_lossy(&image);
        for name in [FILL, ADD, MUL, AXPB] {
            assert!(text.contains(name.to_str().unwrap()));
        }
    }
}
