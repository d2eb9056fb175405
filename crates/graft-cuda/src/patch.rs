//! Copy-free and in-place inputs: patching the kernel nodes of an executable that use a range
//! (a placeholder, or the caller's buffer as recorded) to use the caller's buffer of this
//! call instead (`graft_core::Device::redirect`).
//!
//! The kernel nodes' parameters are read once from the graph (`cuGraphKernelNodeGetParams`)
//! with their layout (`cuFuncGetParamInfo`), so every kernel is covered, cuBLAS's included:
//! those launched from a library (`CUkernel`, resolved to the context's function) and those
//! launched with one packed parameter buffer (`extra`, cuBLAS's bf16 kernels), which are set
//! back through `kernelParams` with the same layout.
//! Every 8-byte-aligned word of a parameter whose value lies inside a redirected placeholder
//! is a pointer into it and is moved by the same offset into the caller's buffer. A graph
//! that reads the placeholder any other way (another copy, a memset, a child graph, a kernel
//! whose parameters cannot be read, an NCCL kernel, a conditional node) is refused: it keeps
//! copying.

use std::ffi::c_void;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::error::check;
use crate::graph::{GraphHandles, node_type, nodes};

const OP: DeviceOp = DeviceOp::GraphUpdate;
const KERNEL: u32 = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32;
const MEMCPY: u32 = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32;
const MEMSET: u32 = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET as u32;
const GRAPH: u32 = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_GRAPH as u32;
const CONDITIONAL: u32 = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32;

/// One kernel node as captured: its parameter block, flattened, and where each parameter sits.
pub(crate) struct KernelNode {
    /// The node of the graph the executable was instantiated from.
    node: sys::CUgraphNode,
    /// Its launch parameters as captured (`kernelParams` is replaced at each set).
    pub(crate) params: sys::CUDA_KERNEL_NODE_PARAMS,
    /// `(offset, size)` of each parameter in `bytes`.
    pub(crate) layout: Vec<(usize, usize)>,
    /// The parameter values as captured.
    pub(crate) bytes: Vec<u8>,
    /// The values as last set: `bytes` with the active redirects applied.
    current: Vec<u8>,
}

/// One redirected range.
struct Redirect {
    /// Range start (as recorded) and length, and where its users point now.
    start: u64,
    len: u64,
    to: u64,
    /// The input's copy node, turned off (copy-free inputs; none for in-place ones).
    copy: Option<sys::CUgraphNode>,
    /// Indices (in `Patches::kernels`) of the kernels with a pointer into the range, found
    /// once: a re-patch touches only these.
    readers: Vec<usize>,
}

/// What the patcher knows about one executable.
#[derive(Default)]
pub(crate) struct Patches {
    /// The kernel nodes, read on first use; `None` while unread.
    kernels: Option<Vec<KernelNode>>,
    /// Ranges copies and memsets touch, with their node, and whether a node hides its
    /// accesses (a child graph, a kernel whose parameters cannot be read).
    others: Vec<(sys::CUgraphNode, u64, u64)>,
    opaque: bool,
    /// Active redirects.
    active: Vec<Redirect>,
    /// Scratch for the parameter pointers of one set, reused so a re-patch does not allocate.
    pointers: Vec<*mut c_void>,
}

// SAFETY: the node handles and the parameter block's raw pointers (`func`, `kern`, `ctx`,
// `kernelParams`, `extra`) are driver handles or pointers graft never dereferences itself
// (`kernelParams` is overwritten with a block of its own before every use), and `pointers`
// holds only pointers into `KernelNode::current`, refilled before each use; all are only used
// under the owning CudaGraph's lock or `&mut`.
unsafe impl Send for Patches {}

impl Patches {
    /// After a successful `cuGraphExecUpdate` the executable runs another capture: forget
    /// everything (the caller turns the copies back on).
    pub(crate) fn take_active(&mut self) -> Vec<sys::CUgraphNode> {
        self.kernels = None;
        self.others.clear();
        self.opaque = false;
        self.active.drain(..).filter_map(|r| r.copy).collect()
    }
}

/// `Device::redirect` on one executable: the kernels with a pointer into `[from, + len)` (as
/// captured) point the same offsets into `to`; `copy_node`, the input's copy (found by the
/// caller, see `CudaGraph::repoint_copy`), is turned off while the redirect is in force.
/// Returns false, changing nothing, when the graph uses the range in a way the patcher
/// cannot follow (another copy or a memset touches it, a child graph, a kernel whose
/// parameters cannot be read).
pub(crate) fn redirect(
    h: &mut GraphHandles,
    from: DevicePtr,
    len: usize,
    copy_node: Option<sys::CUgraphNode>,
    to: Option<DevicePtr>,
) -> Result<bool, DeviceError> {
    let (start, end) = (from.0, from.0 + len as u64);
    if h.patches.kernels.is_none() {
        read_graph(h)?;
    }
    let touched_elsewhere = h
        .patches
        .others
        .iter()
        .any(|&(n, s, e)| Some(n) != copy_node && s < end && start < e);
    if to.is_some() && (h.patches.opaque || touched_elsewhere) {
        return Ok(false);
    }
    let exec = h.exec;
    let Patches {
        kernels,
        active,
        pointers,
        ..
    } = &mut h.patches;
    let kernels = kernels.as_deref_mut().unwrap_or_default();
    let at = active.iter().position(|r| r.start == start);
    match (at, to) {
        (Some(i), Some(to)) => {
            if active[i].to == to.0 {
                return Ok(true);
            }
            active[i].to = to.0;
            let active = &active[..];
            for &k in &active[i].readers {
                repatch(exec, &mut kernels[k], active, pointers)?;
            }
        }
        (None, Some(to)) => {
            let readers: Vec<usize> = (0..kernels.len())
                .filter(|&k| {
                    words(&kernels[k].bytes, &kernels[k].layout).any(|(_, v)| v >= start && v < end)
                })
                .collect();
            active.push(Redirect {
                start,
                len: len as u64,
                to: to.0,
                copy: copy_node,
                readers,
            });
            let active = &active[..];
            for &k in &active[active.len() - 1].readers {
                repatch(exec, &mut kernels[k], active, pointers)?;
            }
        }
        (Some(i), None) => {
            let gone = active.swap_remove(i);
            for &k in &gone.readers {
                repatch(exec, &mut kernels[k], active, pointers)?;
            }
        }
        (None, None) => return Ok(true),
    }
    if let Some(copy_node) = copy_node {
        // SAFETY: `exec` is the live executable and `copy_node` a memcpy node of the graph it
        // was instantiated from (found by the caller); both are used under the graph's lock.
        check(OP, unsafe {
            sys::cuGraphNodeSetEnabled(exec, copy_node, u32::from(to.is_none()))
        })?;
    }
    Ok(true)
}

/// Sets `k`'s parameters to the captured ones with every pointer into an `active`
/// placeholder moved by the same offset into its target.
fn repatch(
    exec: sys::CUgraphExec,
    k: &mut KernelNode,
    active: &[Redirect],
    pointers: &mut Vec<*mut c_void>,
) -> Result<(), DeviceError> {
    k.current.copy_from_slice(&k.bytes);
    for (at, v) in words(&k.bytes, &k.layout) {
        if let Some(r) = active.iter().find(|r| v >= r.start && v < r.start + r.len) {
            k.current[at..at + 8].copy_from_slice(&(r.to + (v - r.start)).to_le_bytes());
        }
    }
    set_params(exec, k, pointers)
}

/// The 8-byte-aligned words of parameters laid out as `layout` in `bytes`, as
/// `(byte offset, value)`.
pub(crate) fn words<'a>(
    bytes: &'a [u8],
    layout: &'a [(usize, usize)],
) -> impl Iterator<Item = (usize, u64)> + 'a {
    layout.iter().flat_map(move |&(offset, size)| {
        (0..size / 8).map(move |i| {
            let at = offset + 8 * i;
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            (at, u64::from_le_bytes(w))
        })
    })
}

/// Sets a kernel node's parameters in the executable to `k.current`, through `pointers`
/// (scratch, refilled).
fn set_params(
    exec: sys::CUgraphExec,
    k: &mut KernelNode,
    pointers: &mut Vec<*mut c_void>,
) -> Result<(), DeviceError> {
    pointers.clear();
    let bytes = &mut k.current;
    for &(offset, _) in &k.layout {
        pointers.push(bytes[offset..].as_mut_ptr().cast::<c_void>());
    }
    let mut params = k.params;
    params.kernelParams = pointers.as_mut_ptr();
    params.extra = std::ptr::null_mut();
    // SAFETY: `exec` is the live executable and `k.node` a kernel node of the graph it was
    // instantiated from; `params` is the node's own captured block with `kernelParams`
    // pointing at one pointer per parameter, each into `k.current`, which holds every parameter
    // at its offset with its size (the layout `cuFuncGetParamInfo` reported); both outlive
    // the call, which copies them.
    check(OP, unsafe {
        sys::cuGraphExecKernelNodeSetParams_v2(exec, k.node, &params)
    })
}

/// Reads every node of the graph: kernels with their parameters, and the ranges copies and
/// memsets touch.
fn read_graph(h: &mut GraphHandles) -> Result<(), DeviceError> {
    let current = h.current_graph();
    let mut kernels = Vec::new();
    for (node, source) in nodes(OP, h.graph)?.into_iter().zip(nodes(OP, current)?) {
        match node_type(OP, source)? {
            KERNEL => match read_kernel(node, source)? {
                Some(k) => kernels.push(k),
                None => h.patches.opaque = true,
            },
            MEMCPY => {
                let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::uninit();
                // SAFETY: `source` is a memcpy node of a live graph (type checked) and `p` a
                // valid out-pointer of the type the driver writes.
                check(OP, unsafe {
                    sys::cuGraphMemcpyNodeGetParams(source, p.as_mut_ptr())
                })?;
                // SAFETY: the call succeeded, so the driver wrote every field.
                let p = unsafe { p.assume_init() };
                let bytes = (p.WidthInBytes * p.Height.max(1) * p.Depth.max(1)) as u64;
                h.patches
                    .others
                    .push((node, p.srcDevice, p.srcDevice + bytes));
                h.patches
                    .others
                    .push((node, p.dstDevice, p.dstDevice + bytes));
            }
            MEMSET => {
                let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMSET_NODE_PARAMS>::uninit();
                // SAFETY: as above, for a memset node.
                check(OP, unsafe {
                    sys::cuGraphMemsetNodeGetParams(source, p.as_mut_ptr())
                })?;
                // SAFETY: the call succeeded, so the driver wrote every field.
                let p = unsafe { p.assume_init() };
                let row = p.width as u64 * u64::from(p.elementSize);
                let bytes = p.pitch as u64 * (p.height.max(1) as u64 - 1) + row;
                h.patches.others.push((node, p.dst, p.dst + bytes));
            }
            GRAPH | CONDITIONAL => h.patches.opaque = true,
            // Events, host nodes, allocations and frees read no device memory of graft's.
            _ => {}
        }
    }
    h.patches.kernels = Some(kernels);
    Ok(())
}

/// Whether `func` is one of NCCL's kernels, which find their buffers through work descriptors
/// of their own, not only through their parameters: a placeholder such a kernel reads cannot
/// be redirected by patching parameters. A function whose name cannot be read counts as one.
pub(crate) fn is_collective(func: sys::CUfunction) -> bool {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `func` is the live function of a captured kernel node; `name` is a valid
    // out-pointer, set to a NUL-terminated string the driver owns while the module is loaded.
    let r = unsafe { sys::cuFuncGetName(&mut name, func) };
    if r != sys::CUresult::CUDA_SUCCESS || name.is_null() {
        return true;
    }
    // SAFETY: the call succeeded, so `name` is a NUL-terminated string valid for this read.
    let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
    // Mangled or not (`_Z..ncclDevKernel_AllReduce..`), the name holds "nccl".
    name.windows(4).any(|w| w == b"nccl")
}

/// The packed parameter buffer an `extra` launch array names
/// (`CU_LAUNCH_PARAM_BUFFER_POINTER` with `CU_LAUNCH_PARAM_BUFFER_SIZE`, up to
/// `CU_LAUNCH_PARAM_END`), or `None` for any other form.
///
/// # Safety
/// `extra` must be a live, `CU_LAUNCH_PARAM_END`-terminated `extra` array whose buffer and
/// size pointers are valid for the returned slice's lifetime.
unsafe fn packed_buffer<'a>(extra: *mut *mut c_void) -> Option<&'a [u8]> {
    const END: usize = 0x00;
    const BUFFER_POINTER: usize = 0x01;
    const BUFFER_SIZE: usize = 0x02;
    let (mut buffer, mut size) = (None, None);
    // A launch array holds a few key/value pairs; a longer one is not the documented form.
    for pair in 0..8 {
        // SAFETY: the array is END-terminated (the caller's contract) and no END was met
        // before `2 * pair`, so both slots are inside it.
        let (key, value) = unsafe { (*extra.add(2 * pair) as usize, *extra.add(2 * pair + 1)) };
        match key {
            END => break,
            BUFFER_POINTER => buffer = Some(value.cast::<u8>().cast_const()),
            // SAFETY: this key's value points at the buffer's size (a size_t).
            BUFFER_SIZE => size = Some(unsafe { *value.cast::<usize>() }),
            _ => return None,
        }
    }
    let (buffer, size) = (buffer?, size?);
    // SAFETY: the driver's buffer holds `size` bytes (the caller's contract).
    (!buffer.is_null()).then(|| unsafe { std::slice::from_raw_parts(buffer, size) })
}

/// A kernel node's parameters and layout, or `None` when they cannot be read (an `extra`
/// array of another form, or a function whose layout the driver does not report).
pub(crate) fn read_kernel(
    node: sys::CUgraphNode,
    source: sys::CUgraphNode,
) -> Result<Option<KernelNode>, DeviceError> {
    let mut params = std::mem::MaybeUninit::<sys::CUDA_KERNEL_NODE_PARAMS>::zeroed();
    // SAFETY: `source` is a kernel node of a live graph (type checked by the caller) and
    // `params` a valid out-pointer of the type the driver writes.
    check(OP, unsafe {
        sys::cuGraphKernelNodeGetParams_v2(source, params.as_mut_ptr())
    })?;
    // SAFETY: the call succeeded, so the driver wrote every field.
    let params = unsafe { params.assume_init() };
    // A kernel launched from a library (`cuLibraryLoad*`, as cuBLAS's are) is captured with
    // its `CUkernel` and no function: its function in the current context has the layout.
    let func = if params.func.is_null() && !params.kern.is_null() {
        let mut func = std::ptr::null_mut();
        // SAFETY: `kern` is the live library kernel of a captured node; `func` is a valid
        // out-pointer. The context current on this thread is the graph's (the caller's).
        let r = unsafe { sys::cuKernelGetFunction(&mut func, params.kern) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::debug!(error = ?r, "a library kernel's function cannot be read: the graph is opaque to patching");
            return Ok(None);
        }
        func
    } else {
        params.func
    };
    if func.is_null() || is_collective(func) {
        tracing::debug!(
            no_function = func.is_null(),
            "a kernel's parameters cannot be read: the graph is opaque to patching"
        );
        return Ok(None);
    }
    let mut layout = Vec::new();
    loop {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: `func` is the live function of a captured kernel node; the out-pointers are
        // valid. An index past the last parameter answers CUDA_ERROR_INVALID_VALUE.
        let r = unsafe { sys::cuFuncGetParamInfo(func, layout.len(), &mut offset, &mut size) };
        match r {
            sys::CUresult::CUDA_SUCCESS => layout.push((offset, size)),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => break,
            _ => {
                tracing::debug!(error = ?r, "a kernel's parameter layout cannot be read: the graph is opaque to patching");
                return Ok(None);
            }
        }
    }
    let total = layout.iter().map(|&(o, s)| o + s).max().unwrap_or(0);
    let mut bytes = vec![0u8; total];
    if !params.extra.is_null() {
        // Launched with one packed buffer (cuBLAS's bf16 kernels are): the same layout.
        // SAFETY: `extra` is the captured node's `extra` array, which the driver keeps,
        // with its buffer, while the node lives.
        let Some(buffer) = (unsafe { packed_buffer(params.extra) }) else {
            tracing::debug!(
                "a kernel's packed parameters cannot be read: the graph is opaque to patching"
            );
            return Ok(None);
        };
        if buffer.len() < total {
            return Ok(None);
        }
        bytes.copy_from_slice(&buffer[..total]);
    } else if !layout.is_empty() && params.kernelParams.is_null() {
        return Ok(None);
    } else {
        for (i, &(offset, size)) in layout.iter().enumerate() {
            // SAFETY: the driver returned `kernelParams` with one pointer per parameter of
            // `func` (the layout lists them), each to `size` readable bytes, valid while the
            // node lives; the destination range lies inside `bytes` (`total` covers it).
            unsafe {
                let src = (*params.kernelParams.add(i)).cast::<u8>();
                std::ptr::copy_nonoverlapping(src, bytes[offset..].as_mut_ptr(), size);
            }
        }
    }
    Ok(Some(KernelNode {
        node,
        params,
        layout,
        current: bytes.clone(),
        bytes,
    }))
}
