//! The driver floor: every CUDA driver, cuBLAS and NCCL call graft-cuda makes, each wrapped
//! once, with its `unsafe`, the invariant it relies on (`// SAFETY:`), and its result turned
//! into a typed [`DeviceError`] (`CUresult` through `crate::error`; cuBLAS's and NCCL's
//! statuses here). The subsystems above (`context`, `vmm`, `blas`, `capture`, `conditional`,
//! `relocate`, `patch`, `graph`, `module`, `side`, the test hooks, `nccl`) call these
//! functions and never cudarc's `sys` modules themselves. Handles passed in (streams, graphs,
//! nodes, modules, communicators) must be live handles of the device whose context is
//! current: the callers own them and keep them alive. The floor decides nothing: which errors
//! a caller tolerates, and the order of calls, stay with the caller.
//!
//! - [`device`]: devices, primary contexts, the driver version, graph-memory trimming;
//! - [`stream`]: streams, events and stream capture;
//! - [`memory`]: allocations, copies, and virtual memory management (the pools);
//! - [`graph`]: graphs, executables and their nodes;
//! - [`edge`]: a graph's edges and their data (programmatic edges);
//! - [`function`]: modules, functions and kernel launches;
//! - [`cublas`]: the cuBLAS handle and its GEMM (cuBLAS's statuses map to `Library` errors);
//! - `nccl` (feature `nccl`): communicators and their all-reduce (NCCL's results map to
//!   `Library` errors);
//! - `peer` (feature `nccl`): peer access, device UUIDs, CUDA IPC handles and mapped host
//!   memory, for the one-shot all-reduce.
//!
//! # Loading the CUDA driver library without ever panicking
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

pub(crate) mod cublas;
pub(crate) mod device;
pub(crate) mod edge;
pub(crate) mod function;
pub(crate) mod graph;
pub(crate) mod memory;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
#[cfg(feature = "nccl")]
pub(crate) mod peer;
pub(crate) mod stream;

/// Declares the driver symbols this crate calls, each with a static description for when it is
/// missing. Names are exactly those of the functions in `cudarc::driver::sys` (the `_v2`
/// suffixes included): cudarc looks each up by its Rust function name.
macro_rules! driver_symbols {
    ($($name:literal),* $(,)?) => {
        &[$(($name, concat!("libcuda has no ", $name, "; update the NVIDIA driver"))),*]
    };
}

/// Every driver function the crate may call before a feature check, with the error reported
/// if it is missing: all of `driver/`'s calls but [`CONDITIONAL_SYMBOLS`], [`PROGRAMMATIC_SYMBOLS`]
/// and [`PEER_SYMBOLS`] (a test derives the four lists from the wrappers' sources). Checked at run time only with `dynamic-loading`; with
/// `dynamic-linking` the loader checks.
#[cfg_attr(not(feature = "dynamic-loading"), allow(dead_code))]
pub(crate) const DRIVER_SYMBOLS: &[(&str, &str)] = driver_symbols![
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGraphMemTrim",
    "cuDeviceGetGraphMemAttribute",
    "cuDeviceSetGraphMemAttribute",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAttribute",
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
    "cuGraphChildGraphNodeGetGraph",
    "cuGraphKernelNodeGetParams_v2",
    "cuGraphMemcpyNodeGetParams",
    "cuGraphMemsetNodeGetParams",
    "cuGraphMemAllocNodeGetParams",
    "cuGraphExecMemcpyNodeSetParams",
    "cuGraphExecKernelNodeSetParams_v2",
    "cuGraphExecUpdate_v2",
    "cuGraphNodeSetEnabled",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAllocationGranularity",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuKernelGetFunction",
    "cuFuncGetName",
    "cuFuncGetParamInfo",
    "cuLaunchKernel",
];

/// The driver functions only conditional nodes (device-side loops) call: their capture into
/// body graphs and the copy of a body into its node. `Conditionals::supported` checks the
/// driver's version, and with `dynamic-loading` these symbols, before any of them is called.
pub(crate) const CONDITIONAL_SYMBOLS: &[&str] = &[
    "cuGraphConditionalHandleCreate",
    "cuGraphAddNode_v2",
    "cuStreamBeginCaptureToGraph",
    "cuStreamGetCaptureInfo_v3",
    "cuGraphNodeGetDependencies_v2",
    "cuGraphAddEmptyNode",
    "cuGraphAddKernelNode_v2",
    "cuGraphAddMemcpyNode",
    "cuGraphAddMemsetNode",
    "cuGraphKernelNodeCopyAttributes",
    "cuGraphMemFreeNodeGetParams",
    "cuGraphAddDependencies_v2",
];

/// The driver functions only programmatic dependent launch calls (CUDA 12.3+): the launch with
/// its attribute and the count of a graph's programmatic edges. `crate::programmatic` checks
/// the driver's version and, with `dynamic-loading`, these symbols before any is called.
pub(crate) const PROGRAMMATIC_SYMBOLS: &[&str] = &["cuLaunchKernelEx", "cuGraphGetEdges_v2"];

/// The driver functions only the one-shot all-reduce calls (`peer`): peer access, UUIDs, IPC
/// handles and mapped host memory. An NCCL communicator checks them, with `dynamic-loading`,
/// before setting the one-shot path up, and goes without it where one is missing.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) const PEER_SYMBOLS: &[&str] = &[
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuDeviceGetUuid_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
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

/// Whether libcuda has every one of `symbols` (with `dynamic-linking`, the loader bound
/// everything, so always), after [`driver_ready`].
pub(crate) fn has_symbols(symbols: &[&str]) -> bool {
    if driver_ready().is_err() {
        return false;
    }
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: `driver_ready` found the library loadable, so `culib` returns the opened
        // library instead of panicking.
        let lib = unsafe { sys::culib() };
        symbols.iter().all(|symbol| {
            // SAFETY: the symbol is only looked up, never called or kept; the fn-pointer type
            // is pointer-sized, as libloading requires.
            unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok()
        })
    }
    #[cfg(not(feature = "dynamic-loading"))]
    {
        let _ = symbols;
        true
    }
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

    /// The driver functions `driver/`'s wrappers call (`sys::cuXxx(`, or `cu::cuXxx(` where
    /// `sys` is another library's), read from their sources.
    fn called_symbols() -> std::collections::BTreeSet<String> {
        let sources = [
            include_str!("mod.rs"),
            include_str!("cublas.rs"),
            include_str!("device.rs"),
            include_str!("edge.rs"),
            include_str!("function.rs"),
            include_str!("graph.rs"),
            include_str!("memory.rs"),
            include_str!("nccl.rs"),
            include_str!("peer.rs"),
            include_str!("stream.rs"),
        ];
        let mut found = std::collections::BTreeSet::new();
        for source in sources {
            // The code, without its tests (this one names the pattern).
            let source = source.split("#[cfg(test)]").next().unwrap_or_default();
            for prefix in ["sys::cu", "cu::cu"] {
                for (at, _) in source.match_indices(prefix) {
                    let name: String = source[at + prefix.len() - 2..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    let rest = &source[at + prefix.len() - 2 + name.len()..];
                    let called = rest.trim_start().starts_with('(');
                    if called && name[2..].starts_with(|c: char| c.is_ascii_uppercase()) {
                        found.insert(name);
                    }
                }
            }
        }
        found
    }

    #[test]
    fn the_symbol_lists_are_exactly_the_wrappers_calls() {
        let called = called_symbols();
        let listed: std::collections::BTreeSet<String> = DRIVER_SYMBOLS
            .iter()
            .map(|&(s, _)| s)
            .chain(CONDITIONAL_SYMBOLS.iter().copied())
            .chain(PROGRAMMATIC_SYMBOLS.iter().copied())
            .chain(PEER_SYMBOLS.iter().copied())
            .map(str::to_owned)
            .collect();
        let missing: Vec<_> = called.difference(&listed).collect();
        let stale: Vec<_> = listed.difference(&called).collect();
        assert!(
            missing.is_empty(),
            "driver/ calls these without listing them in DRIVER_SYMBOLS, CONDITIONAL_SYMBOLS, PROGRAMMATIC_SYMBOLS or PEER_SYMBOLS: {missing:?}"
        );
        assert!(stale.is_empty(), "listed but never called: {stale:?}");
        assert_eq!(
            DRIVER_SYMBOLS.len()
                + CONDITIONAL_SYMBOLS.len()
                + PROGRAMMATIC_SYMBOLS.len()
                + PEER_SYMBOLS.len(),
            listed.len(),
            "a symbol is in two lists"
        );
    }

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
