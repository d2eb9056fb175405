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

use crate::driver::function as df;
use crate::driver::graph::{self as dg, node_type, nodes};

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

/// The graphs of one executable: the executable, the graph it was instantiated from (whose
/// node handles name the executable's nodes), and the graph whose nodes hold its current
/// parameters (the same graph, or the capture it was last updated with).
#[derive(Clone, Copy)]
pub(crate) struct Graphs {
    pub(crate) exec: sys::CUgraphExec,
    pub(crate) graph: sys::CUgraph,
    pub(crate) current: sys::CUgraph,
}

/// `Device::redirect` on one executable: the kernels with a pointer into `[from, + len)` (as
/// captured) point the same offsets into `to`; `copy_node`, the input's copy (found by the
/// caller, see `CudaGraph::repoint_copy`), is turned off while the redirect is in force.
/// Returns false, changing nothing, when the graph uses the range in a way the patcher
/// cannot follow (another copy or a memset touches it, a child graph, a kernel whose
/// parameters cannot be read).
pub(crate) fn redirect(
    patches: &mut Patches,
    graphs: Graphs,
    from: DevicePtr,
    len: usize,
    copy_node: Option<sys::CUgraphNode>,
    to: Option<DevicePtr>,
) -> Result<bool, DeviceError> {
    let (start, end) = (from.0, from.0 + len as u64);
    if patches.kernels.is_none() {
        read_graph(patches, graphs)?;
    }
    let touched_elsewhere = patches
        .others
        .iter()
        .any(|&(n, s, e)| Some(n) != copy_node && s < end && start < e);
    if to.is_some() && (patches.opaque || touched_elsewhere) {
        return Ok(false);
    }
    let exec = graphs.exec;
    let Patches {
        kernels,
        active,
        pointers,
        ..
    } = patches;
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
        // `copy_node` is a memcpy node of the graph `exec` was instantiated from (found by
        // the caller); both are used under the graph's lock.
        dg::set_node_enabled(OP, exec, copy_node, to.is_none())?;
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
    // `exec` is the live executable and `k.node` a kernel node of the graph it was
    // instantiated from; `k.layout` is its function's own layout.
    dg::set_exec_kernel_params(
        OP,
        exec,
        k.node,
        &k.params,
        &k.layout,
        &mut k.current,
        pointers,
    )
}

/// Reads every node of the graph: kernels with their parameters, and the ranges copies and
/// memsets touch.
fn read_graph(patches: &mut Patches, graphs: Graphs) -> Result<(), DeviceError> {
    let mut kernels = Vec::new();
    for (node, source) in nodes(OP, graphs.graph)?
        .into_iter()
        .zip(nodes(OP, graphs.current)?)
    {
        match node_type(OP, source)? {
            KERNEL => match read_kernel(node, source)? {
                Some(k) => kernels.push(k),
                None => patches.opaque = true,
            },
            MEMCPY => {
                let p = dg::memcpy_params(OP, source)?;
                let bytes = (p.WidthInBytes * p.Height.max(1) * p.Depth.max(1)) as u64;
                patches
                    .others
                    .push((node, p.srcDevice, p.srcDevice + bytes));
                patches
                    .others
                    .push((node, p.dstDevice, p.dstDevice + bytes));
            }
            MEMSET => {
                let p = dg::memset_params(OP, source)?;
                let row = p.width as u64 * u64::from(p.elementSize);
                let bytes = p.pitch as u64 * (p.height.max(1) as u64 - 1) + row;
                patches.others.push((node, p.dst, p.dst + bytes));
            }
            GRAPH | CONDITIONAL => patches.opaque = true,
            // Events, host nodes, allocations and frees read no device memory of graft's.
            _ => {}
        }
    }
    patches.kernels = Some(kernels);
    Ok(())
}

/// Whether `func` is one of NCCL's kernels, which find their buffers through work descriptors
/// of their own, not only through their parameters: a placeholder such a kernel reads cannot
/// be redirected by patching parameters. A function whose name cannot be read counts as one.
pub(crate) fn is_collective(func: sys::CUfunction) -> bool {
    // Mangled or not (`_Z..ncclDevKernel_AllReduce..`), the name holds "nccl".
    df::name(func).is_none_or(|name| name.windows(4).any(|w| w == b"nccl"))
}

/// A kernel node's parameters and layout, or `None` when they cannot be read (an `extra`
/// array of another form, or a function whose layout the driver does not report).
pub(crate) fn read_kernel(
    node: sys::CUgraphNode,
    source: sys::CUgraphNode,
) -> Result<Option<KernelNode>, DeviceError> {
    let params = dg::kernel_params(OP, source)?;
    // A kernel launched from a library (`cuLibraryLoad*`, as cuBLAS's are) is captured with
    // its `CUkernel` and no function: its function in the current context has the layout.
    let func = if params.func.is_null() && !params.kern.is_null() {
        // The context current on this thread is the graph's (the caller's).
        match df::kernel_function(OP, params.kern) {
            Ok(func) => func,
            Err(error) => {
                tracing::debug!(%error, "a library kernel's function cannot be read: the graph is opaque to patching");
                return Ok(None);
            }
        }
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
        match df::param_info(OP, func, layout.len()) {
            Ok(Some(param)) => layout.push(param),
            Ok(None) => break,
            Err(error) => {
                tracing::debug!(%error, "a kernel's parameter layout cannot be read: the graph is opaque to patching");
                return Ok(None);
            }
        }
    }
    let Some(bytes) = dg::kernel_param_bytes(&params, &layout) else {
        return Ok(None);
    };
    Ok(Some(KernelNode {
        node,
        params,
        layout,
        current: bytes.clone(),
        bytes,
    }))
}
