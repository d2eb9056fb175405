//! Loading the CUDA driver library without ever panicking.
//!
//! With the `dynamic-loading` feature (the default) cudarc opens libcuda on first use, and every driver
//! function is looked up by name on its first call. Both panic when the library or a symbol is
//! missing, which a runtime must not do on a machine without a GPU. So before any driver call,
//! [`driver_ready`] (once per process):
//!
//! 1. asks cudarc whether libcuda can be opened at all (`sys::is_culib_present`, which only
//!    tries `dlopen` on the candidate names and closes them again);
//! 2. looks up every driver symbol this crate calls, so a driver too old for one of them is an
//!    error here rather than a panic in the middle of a capture;
//! 3. calls `cuInit(0)`.
//!
//! The whole sequence also runs under `std::panic::catch_unwind`, as a second guard against a
//! panic inside cudarc (it only helps with the default `panic = "unwind"`). Every constructor
//! goes through here, so the rest of the crate may assume the driver is loaded and initialised.
//!
//! With `dynamic-linking` instead (graft-candle's CUDA build) libcuda is linked: the loader
//! opened it and bound every symbol before `main` (Rust links with `-z now`), so steps 1 and 2
//! have nothing left to check and only `cuInit` runs.

use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::check;

/// Declares the driver symbols this crate calls, each with a static description for when it is
/// missing. Names are exactly those of the functions in `cudarc::driver::sys` (the `_v2`
/// suffixes included): cudarc looks each up by its Rust function name.
macro_rules! driver_symbols {
    ($($name:literal),* $(,)?) => {
        &[$(($name, concat!("libcuda has no ", $name, "; update the NVIDIA driver"))),*]
    };
}

/// Every driver function the crate calls, with the error name reported if it is missing.
/// (Checked at run time only with `dynamic-loading`; with `dynamic-linking` the loader checks.)
#[cfg_attr(not(feature = "dynamic-loading"), allow(dead_code))]
pub(crate) const DRIVER_SYMBOLS: &[(&str, &str)] = driver_symbols![
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGraphMemTrim",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphUpload",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuGraphGetNodes",
    "cuGraphNodeGetType",
    "cuGraphMemcpyNodeGetParams",
    "cuGraphExecMemcpyNodeSetParams",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// `Ok` once libcuda is loaded, has every symbol in [`DRIVER_SYMBOLS`], and `cuInit` succeeded.
/// Computed once per process; never panics.
pub(crate) fn driver_ready() -> Result<(), DeviceError> {
    static READY: OnceLock<Result<(), DeviceError>> = OnceLock::new();
    READY
        .get_or_init(|| {
            catch_unwind(AssertUnwindSafe(load_and_init)).unwrap_or(Err(
                DeviceError::Unavailable {
                    op: DeviceOp::Init,
                    what: "libcuda could not be loaded (cudarc panicked opening it); reinstall the NVIDIA driver",
                },
            ))
        })
        .clone()
}

fn load_and_init() -> Result<(), DeviceError> {
    #[cfg(feature = "dynamic-loading")]
    check_library()?;
    // SAFETY: the library and `cuInit` are present (checked above, or bound by the loader with
    // `dynamic-linking`); 0 is cuInit's only valid flag value, and calling it more than once is
    // allowed.
    check(DeviceOp::Init, unsafe { sys::cuInit(0) })
}

/// Steps 1 and 2: libcuda can be opened and has every symbol in [`DRIVER_SYMBOLS`].
#[cfg(feature = "dynamic-loading")]
fn check_library() -> Result<(), DeviceError> {
    // SAFETY: `is_culib_present` only `dlopen`s the candidate library names and drops each
    // handle again; it calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Unavailable {
            op: DeviceOp::Init,
            what: "libcuda could not be loaded: no NVIDIA driver is installed",
        });
    }
    // SAFETY: the library was just found loadable, so `culib` opens it (once, into a
    // process-lifetime static) instead of panicking.
    let lib = unsafe { sys::culib() };
    for &(symbol, missing) in DRIVER_SYMBOLS {
        // SAFETY: the symbol is only looked up, never called or kept; the fn-pointer type is
        // pointer-sized, as libloading requires.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok();
        if !found {
            return Err(DeviceError::Unavailable {
                op: DeviceOp::Init,
                what: missing,
            });
        }
    }
    Ok(())
}

/// The number of CUDA devices, after [`driver_ready`].
pub(crate) fn device_count() -> Result<usize, DeviceError> {
    driver_ready()?;
    let mut count: c_int = 0;
    // SAFETY: the driver is loaded and initialised (driver_ready); `count` is a valid out-pointer.
    check(DeviceOp::Init, unsafe { sys::cuDeviceGetCount(&mut count) })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_names_are_unique_and_named_in_their_error() {
        let mut seen = std::collections::HashSet::new();
        for &(symbol, missing) in DRIVER_SYMBOLS {
            assert!(seen.insert(symbol), "{symbol} listed twice");
            assert!(missing.contains(symbol));
        }
    }

    #[test]
    fn driver_ready_never_panics() {
        // On a machine without libcuda this is an error; with one, whatever the driver says.
        let first = driver_ready();
        assert_eq!(first, driver_ready(), "the outcome is computed once");
        // Without libcuda (or with one lacking a symbol) the error says what is missing.
        // SAFETY: `is_culib_present` only `dlopen`s candidate names and drops the handles.
        if !unsafe { sys::is_culib_present() } {
            assert!(
                matches!(
                    first,
                    Err(DeviceError::Unavailable {
                        op: DeviceOp::Init,
                        ..
                    })
                ),
                "{first:?}"
            );
        }
    }
}
