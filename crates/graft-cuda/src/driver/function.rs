//! Modules, functions and launches: loading and unloading a PTX module, looking up its functions, a function's name and parameter layout, a library kernel's function, `cuLaunchKernel` and `cuLaunchKernelEx` (programmatic dependent launch), and whether libnvrtc (which compiles modules) loads.

use std::ffi::{CStr, c_uint, c_void};
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, invalid_argument, map};

/// Loads a PTX image (`cuModuleLoadData`) into the current context; the caller owns the module
/// and unloads it once with [`unload`]. The image must end with a NUL byte.
pub(crate) fn load(op: DeviceOp, image: &[u8]) -> Result<sys::CUmodule, DeviceError> {
    if image.last() != Some(&0) {
        return Err(invalid_argument(
            op,
            "a module image must end with a NUL byte",
        ));
    }
    let mut module: sys::CUmodule = ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated image (checked above) that outlives the call (the
    // driver copies it); the caller made the context current; `module` is a valid out-pointer.
    check(op, unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
    })?;
    Ok(module)
}

/// Unloads a module from [`load`] (`cuModuleUnload`); its functions die with it.
pub(crate) fn unload(op: DeviceOp, module: sys::CUmodule) -> Result<(), DeviceError> {
    // SAFETY: `module` was loaded by `load`, is owned by the caller alone and unloaded exactly
    // once, with no launch of its functions still to come from the caller.
    check(op, unsafe { sys::cuModuleUnload(module) })
}

/// The function `name` of `module` (`cuModuleGetFunction`), alive as long as the module.
pub(crate) fn get(
    op: DeviceOp,
    module: sys::CUmodule,
    name: &CStr,
) -> Result<sys::CUfunction, DeviceError> {
    let mut f: sys::CUfunction = ptr::null_mut();
    // SAFETY: `module` is a loaded module, `name` is NUL-terminated, and `f` is a valid
    // out-pointer.
    check(op, unsafe {
        sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
    })?;
    Ok(f)
}

/// The function of library kernel `kern` in the current context (`cuKernelGetFunction`).
pub(crate) fn kernel_function(
    op: DeviceOp,
    kern: sys::CUkernel,
) -> Result<sys::CUfunction, DeviceError> {
    let mut func: sys::CUfunction = ptr::null_mut();
    // SAFETY: `kern` is the live library kernel of a captured node; `func` a valid out-pointer.
    check(op, unsafe { sys::cuKernelGetFunction(&mut func, kern) })?;
    Ok(func)
}

/// A function's name (`cuFuncGetName`, mangled as compiled), if the driver tells it.
pub(crate) fn name(func: sys::CUfunction) -> Option<Vec<u8>> {
    let mut name: *const std::ffi::c_char = ptr::null();
    // SAFETY: `func` is a live function; `name` is a valid out-pointer, set to a NUL-terminated
    // string the driver owns while the module is loaded.
    let r = unsafe { sys::cuFuncGetName(&mut name, func) };
    if r != sys::CUresult::CUDA_SUCCESS || name.is_null() {
        return None;
    }
    // SAFETY: the call succeeded, so `name` is a NUL-terminated string valid for this read.
    Some(unsafe { CStr::from_ptr(name) }.to_bytes().to_vec())
}

/// The offset and size of parameter `index` of `func` (`cuFuncGetParamInfo`), or `None` past
/// the last one (the driver answers `CUDA_ERROR_INVALID_VALUE` there).
pub(crate) fn param_info(
    op: DeviceOp,
    func: sys::CUfunction,
    index: usize,
) -> Result<Option<(usize, usize)>, DeviceError> {
    let (mut offset, mut size) = (0usize, 0usize);
    // SAFETY: `func` is a live function; the out-pointers are valid.
    let r = unsafe { sys::cuFuncGetParamInfo(func, index, &mut offset, &mut size) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(Some((offset, size))),
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => Ok(None),
        other => Err(map(op, other, 0)),
    }
}

/// Whether the driver exports `cuFuncGetParamInfo` (CUDA 12.4+), which [`param_info`] calls.
#[cfg(feature = "dynamic-loading")]
pub(crate) fn param_info_available() -> bool {
    // SAFETY: the driver library is loaded (every constructor of a device ran driver_ready),
    // so `culib` returns it without panicking; the symbol is only looked up, never called here.
    let lib = unsafe { sys::culib() };
    // SAFETY: looking a symbol up does not call it; the fn-pointer type is pointer-sized.
    unsafe { lib.get::<unsafe extern "C" fn()>(b"cuFuncGetParamInfo") }.is_ok()
}

/// With `dynamic-linking` the loader bound `cuFuncGetParamInfo` before `main` (or the program
/// did not start).
#[cfg(not(feature = "dynamic-loading"))]
pub(crate) fn param_info_available() -> bool {
    true
}

/// Whether libnvrtc can be loaded (NVRTC compiles graft's kernels; with `dynamic-linking` the
/// loader already found it).
pub(crate) fn nvrtc_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: `is_culib_present` only `dlopen`s candidate names of libnvrtc and drops each
        // handle; it runs no NVRTC code.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    true
}

/// `cuLaunchKernel` of `func` on `stream`, one pointer per parameter in `params`, no `extra`.
///
/// # Safety
/// `params` must hold one pointer per parameter of `func`, the `i`-th pointing at as many
/// readable bytes as parameter `i` is long, all live for the call; every device pointer among
/// the arguments must be null or memory the kernel may use; `func` must belong to a module
/// of the current context and `stream` be a live stream of it.
pub(crate) unsafe fn launch(
    op: DeviceOp,
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees the parameter pointers, the function and the stream;
    // cuLaunchKernel copies the values before returning; `extra` is null.
    check(op, unsafe {
        sys::cuLaunchKernel(
            func,
            grid.0 as c_uint,
            grid.1 as c_uint,
            grid.2 as c_uint,
            block.0 as c_uint,
            block.1 as c_uint,
            block.2 as c_uint,
            shared_bytes as c_uint,
            stream,
            params.as_mut_ptr(),
            ptr::null_mut(),
        )
    })
}

/// `cuLaunchKernelEx` of `func` on `stream` with one launch attribute, programmatic stream
/// serialization allowed: the kernel may begin once the kernel before it on the stream has
/// triggered (`griddepcontrol.launch_dependents`) or ended, and must wait
/// (`griddepcontrol.wait`) before it touches what that kernel writes. Captured, the edge from
/// the kernel before it is a programmatic edge. Parameters as [`launch`]'s.
///
/// # Safety
/// As [`launch`]; and the kernel must wait before it reads or writes bytes the kernels before
/// it on the stream touch (the attribute lets it start while they run).
pub(crate) unsafe fn launch_programmatic(
    op: DeviceOp,
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), DeviceError> {
    // SAFETY: an all-zero launch attribute is a valid value of the plain-data union (its
    // `pad` member); the id and the one member used are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: shared_bytes,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller guarantees the parameter pointers, the function, the stream and the
    // kernel's wait; `config` and its one attribute live for the call, which copies them and
    // the parameter values before returning; `extra` is null.
    check(op, unsafe {
        sys::cuLaunchKernelEx(&config, func, params.as_mut_ptr(), ptr::null_mut())
    })
}
