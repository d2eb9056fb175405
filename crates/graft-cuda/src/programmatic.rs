//! Programmatic dependent launch: the one kernel launch with attributes graft's kernel crates use, which lets a kernel start while the kernel before it on its stream still runs and is recorded by a capture as a programmatic edge (CUDA 12.3+ drivers, compute capability 9.0+ devices).
//!
//! cudarc's safe launch has no launch attributes, so the kernel crates launch through
//! [`launch`]. A kernel launched as a *dependent* must execute `griddepcontrol.wait` (CUDA C's
//! `cudaGridDependencySynchronize`) before it reads or writes anything the kernels before it
//! touch; before the wait it may only read what no kernel of the step writes (its weights).
//! Where the driver cannot launch so, the kernel is launched plainly (a full edge, the same
//! results) and a warning says so once per process.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::driver;

/// The oldest driver with programmatic edges in graphs (CUDA 12.3).
const MIN_DRIVER: c_int = 12030;

/// A kernel's launch configuration: grid and block dimensions and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

/// Whether this process's driver launches dependents (version 12.3 or later, with
/// `cuLaunchKernelEx` and `cuGraphGetEdges_v2`). Whether the device can is the caller's to
/// know (compute capability 9.0 or later: its kernels only wait there).
pub fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        driver::driver_ready().is_ok()
            && driver::device::driver_version().unwrap_or(0) >= MIN_DRIVER
            && driver::has_symbols(driver::PROGRAMMATIC_SYMBOLS)
    })
}

/// Launches `func` on `stream` with `params` (one pointer per parameter) and `config`; as a
/// dependent of the kernel before it when `dependent` and the driver [`supported`] it, plainly
/// otherwise (with a warning, once per process, when `dependent` was asked for). Returns
/// whether it launched as a dependent.
///
/// # Safety
/// `params` must hold one pointer per parameter of `func`, the `i`-th pointing at as many
/// readable bytes as parameter `i` is long, all live for the call; every device pointer
/// among the arguments must be memory the kernel may use while it runs; `func` must belong to
/// a module loaded in the context current on this thread and `stream` be a live stream of
/// it. With `dependent`, the kernel must execute `griddepcontrol.wait` before it touches bytes
/// that kernels before it on the stream read or write.
pub unsafe fn launch(
    stream: sys::CUstream,
    func: sys::CUfunction,
    config: &Launch,
    dependent: bool,
    params: &mut [*mut c_void],
) -> Result<bool, DeviceError> {
    let op = DeviceOp::KernelLaunch;
    let Launch {
        grid,
        block,
        shared_bytes,
    } = *config;
    if dependent && supported() {
        // SAFETY: the caller's contract, which includes the wait a dependent needs.
        unsafe {
            driver::function::launch_programmatic(
                op,
                func,
                grid,
                block,
                shared_bytes,
                stream,
                params,
            )
        }?;
        return Ok(true);
    }
    if dependent {
        static WARNED: OnceLock<()> = OnceLock::new();
        WARNED.get_or_init(|| {
            tracing::warn!(
                "this driver cannot launch kernels as programmatic dependents (CUDA 12.3 or later is needed): graphs record full edges between kernels, with the same results and less overlap"
            );
        });
    }
    // SAFETY: the caller's contract; a plain launch starts after the kernel before it ends.
    unsafe { driver::function::launch(op, func, grid, block, shared_bytes, stream, params) }?;
    Ok(false)
}
