//! Graphs, executables and nodes: instantiating, uploading, launching, updating and destroying; listing nodes and reading their parameters; adding nodes (kernels, copies, memsets, empty and conditional nodes) and setting an executable's node parameters.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, invalid_argument, map};

/// Instantiates `graph` (`cuGraphInstantiateWithFlags`, flags 0: a plain instantiation); the
/// caller owns the executable and destroys it once with [`destroy_exec`].
pub(crate) fn instantiate(
    op: DeviceOp,
    graph: sys::CUgraph,
) -> Result<sys::CUgraphExec, DeviceError> {
    let mut exec: sys::CUgraphExec = ptr::null_mut();
    // SAFETY: `graph` is a live graph of the current context, owned by the caller; `exec` is a
    // valid out-pointer; flags 0 requests a plain instantiation.
    check(op, unsafe {
        sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
    })?;
    Ok(exec)
}

/// Uploads `exec` on `stream` (`cuGraphUpload`).
pub(crate) fn upload(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: `exec` was instantiated in the current context; the stream is live.
    check(op, unsafe { sys::cuGraphUpload(exec, stream) })
}

/// Launches `exec` on `stream` (`cuGraphLaunch`).
pub(crate) fn launch(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: `exec` is a live executable of the current context whose use the caller
    // serializes (a graph's lock); the stream is live.
    check(op, unsafe { sys::cuGraphLaunch(exec, stream) })
}

/// Destroys an executable from [`instantiate`] (`cuGraphExecDestroy`); null: nothing. The
/// driver defers the release of an executable still running until it completes.
pub(crate) fn destroy_exec(op: DeviceOp, exec: sys::CUgraphExec) -> Result<(), DeviceError> {
    if exec.is_null() {
        return Ok(());
    }
    // SAFETY: `exec` is owned by the caller alone and destroyed exactly once (the caller swaps
    // it out of wherever it was kept).
    check(op, unsafe { sys::cuGraphExecDestroy(exec) })
}

/// Destroys a graph (`cuGraphDestroy`) the caller owns alone; null: nothing.
pub(crate) fn destroy(op: DeviceOp, graph: sys::CUgraph) -> Result<(), DeviceError> {
    if graph.is_null() {
        return Ok(());
    }
    // SAFETY: `graph` (from cuStreamEndCapture) is owned by the caller alone and destroyed
    // exactly once; no executable depends on it (an executable does not need its graph).
    check(op, unsafe { sys::cuGraphDestroy(graph) })
}

/// Updates `exec` in place to run `graph` (`cuGraphExecUpdate`): `None` on success, or the
/// driver's refusal code (`CUgraphExecUpdateResult` as a plain number) when it will not.
pub(crate) fn update_exec(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
) -> Result<Option<u32>, DeviceError> {
    let mut info = std::mem::MaybeUninit::<sys::CUgraphExecUpdateResultInfo>::zeroed();
    // SAFETY: `exec` is a live executable and `graph` a live graph of the same context, which
    // is current; the caller has exclusive use of both; `info` is a valid out-pointer for the
    // result record.
    let result = unsafe { sys::cuGraphExecUpdate_v2(exec, graph, info.as_mut_ptr()) };
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(None),
        sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => {
            // The result code is read as a plain number: a newer driver may report one
            // cudarc's enum lacks (see `node_type`).
            // SAFETY: the record was zeroed, and the driver fills it on this error; its first
            // field is the 4-byte result code at offset 0 of a repr(C) struct.
            Ok(Some(unsafe { info.as_ptr().cast::<u32>().read() }))
        }
        other => Err(map(op, other, 0)),
    }
}

/// Turns node `node` of `exec` on or off (`cuGraphNodeSetEnabled`).
pub(crate) fn set_node_enabled(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    node: sys::CUgraphNode,
    enabled: bool,
) -> Result<(), DeviceError> {
    // SAFETY: `exec` is a live executable and `node` a node of the graph it was instantiated
    // from; the caller has exclusive use of both.
    check(op, unsafe {
        sys::cuGraphNodeSetEnabled(exec, node, u32::from(enabled))
    })
}

/// The nodes of a live graph (`cuGraphGetNodes`), in creation order.
pub(crate) fn nodes(
    op: DeviceOp,
    graph: sys::CUgraph,
) -> Result<Vec<sys::CUgraphNode>, DeviceError> {
    let mut count: usize = 0;
    // SAFETY: `graph` is a live graph the caller has exclusive use of; a null node array asks
    // only for the count, written into a valid out-pointer.
    check(op, unsafe {
        sys::cuGraphGetNodes(graph, ptr::null_mut(), &mut count)
    })?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![ptr::null_mut(); count];
    let mut filled = count;
    if count > 0 {
        // SAFETY: `nodes` has room for `filled` handles, and the driver writes at most that many.
        check(op, unsafe {
            sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut filled)
        })?;
    }
    nodes.truncate(filled.min(count));
    Ok(nodes)
}

/// A node's type (`cuGraphNodeGetType`) as a plain number: a newer driver may report a node
/// type that cudarc's enum (CUDA 12.8's list) lacks, and an unknown discriminant in a Rust
/// enum is UB.
pub(crate) fn node_type(op: DeviceOp, node: sys::CUgraphNode) -> Result<u32, DeviceError> {
    let mut kind: u32 = u32::MAX;
    // SAFETY: `node` is a node of a live graph; `kind` is a valid, 4-byte-aligned out-pointer
    // for the 4-byte `CUgraphNodeType` (repr(u32)).
    check(op, unsafe {
        sys::cuGraphNodeGetType(node, (&raw mut kind).cast::<sys::CUgraphNodeType>())
    })?;
    Ok(kind)
}

/// The raw `cuGraphKernelNodeGetParams`.
fn kernel_params_raw(
    node: sys::CUgraphNode,
) -> Result<sys::CUDA_KERNEL_NODE_PARAMS, sys::CUresult> {
    let mut params = std::mem::MaybeUninit::<sys::CUDA_KERNEL_NODE_PARAMS>::zeroed();
    // SAFETY: `node` is a kernel node of a live graph (callers check the type) and `params` a
    // valid out-pointer of the type the driver writes.
    let r = unsafe { sys::cuGraphKernelNodeGetParams_v2(node, params.as_mut_ptr()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    // SAFETY: the call succeeded, so the driver wrote every field; the arrays it points at
    // (`kernelParams`, `extra`) are the driver's, alive while the node is.
    Ok(unsafe { params.assume_init() })
}

/// A kernel node's launch parameters (`cuGraphKernelNodeGetParams`). Their `kernelParams` and
/// `extra` arrays are the driver's, alive while the node is.
pub(crate) fn kernel_params(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<sys::CUDA_KERNEL_NODE_PARAMS, DeviceError> {
    kernel_params_raw(node).map_err(|r| map(op, r, 0))
}

/// The name of a kernel node's function (mangled as compiled), if the driver tells it.
pub(crate) fn kernel_name(node: sys::CUgraphNode) -> Option<String> {
    let params = kernel_params_raw(node).ok()?;
    let func = if params.func.is_null() && !params.kern.is_null() {
        super::function::kernel_function(DeviceOp::Instantiate, params.kern).ok()?
    } else {
        params.func
    };
    if func.is_null() {
        return None;
    }
    let name = super::function::name(func)?;
    Some(String::from_utf8_lossy(&name).into_owned())
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

/// The parameter values of a kernel node, flattened: as many bytes as `layout` spans, each
/// parameter of `layout` (`(offset, size)`, its function's layout read with
/// [`super::function::param_info`]) at its offset, read from `params` (the node's own,
/// from [`kernel_params`], its node still alive). `None` when they cannot be read: an `extra`
/// array of another form than one packed buffer, or too short a buffer, or no parameter
/// array for a function that has parameters.
pub(crate) fn kernel_param_bytes(
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
    layout: &[(usize, usize)],
) -> Option<Vec<u8>> {
    let total = layout.iter().map(|&(o, s)| o + s).max().unwrap_or(0);
    let mut bytes = vec![0u8; total];
    if !params.extra.is_null() {
        // Launched with one packed buffer (cuBLAS's bf16 kernels are): the same layout.
        // SAFETY: `extra` is the captured node's `extra` array, which the driver keeps, with
        // its buffer, while the node lives.
        let Some(buffer) = (unsafe { packed_buffer(params.extra) }) else {
            tracing::debug!(
                "a kernel's packed parameters cannot be read: the graph is opaque to patching"
            );
            return None;
        };
        if buffer.len() < total {
            return None;
        }
        bytes.copy_from_slice(&buffer[..total]);
    } else if !layout.is_empty() && params.kernelParams.is_null() {
        return None;
    } else {
        for (i, &(offset, size)) in layout.iter().enumerate() {
            // SAFETY: the driver returned `kernelParams` with one pointer per parameter of the
            // node's function (the layout lists them), each to `size` readable bytes, valid
            // while the node lives; the destination range lies inside `bytes` (`total`
            // covers it).
            unsafe {
                let src = (*params.kernelParams.add(i)).cast::<u8>();
                ptr::copy_nonoverlapping(src, bytes[offset..].as_mut_ptr(), size);
            }
        }
    }
    Some(bytes)
}

/// Fills `pointers` with one pointer per parameter of `layout` into `bytes` (refilled), and
/// returns `params` pointing at them (no `extra`). Fails when `bytes` is too short for the
/// layout.
fn point_into(
    op: DeviceOp,
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
    layout: &[(usize, usize)],
    bytes: &mut [u8],
    pointers: &mut Vec<*mut c_void>,
) -> Result<sys::CUDA_KERNEL_NODE_PARAMS, DeviceError> {
    if layout.iter().any(|&(o, s)| o + s > bytes.len()) {
        return Err(invalid_argument(
            op,
            "a kernel's parameter bytes are shorter than its layout",
        ));
    }
    pointers.clear();
    for &(offset, _) in layout {
        pointers.push(bytes[offset..].as_mut_ptr().cast::<c_void>());
    }
    let mut params = *params;
    params.kernelParams = pointers.as_mut_ptr();
    params.extra = ptr::null_mut();
    Ok(params)
}

/// Sets kernel node `node`'s parameters in `exec` (`cuGraphExecKernelNodeSetParams`) to
/// `params` (the node's captured block) with the values `bytes`, laid out as `layout` (the
/// function's own layout), passed through `pointers` (scratch, refilled).
pub(crate) fn set_exec_kernel_params(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    node: sys::CUgraphNode,
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
    layout: &[(usize, usize)],
    bytes: &mut [u8],
    pointers: &mut Vec<*mut c_void>,
) -> Result<(), DeviceError> {
    let params = point_into(op, params, layout, bytes, pointers)?;
    // SAFETY: `exec` is a live executable and `node` a kernel node of the graph it was
    // instantiated from, used exclusively by the caller; `params` is the node's own captured
    // block with `kernelParams` pointing at one pointer per parameter, each into `bytes`,
    // which holds every parameter at its offset with its size (the function's layout, bounds
    // checked by `point_into`); both outlive the call, which copies them.
    check(op, unsafe {
        sys::cuGraphExecKernelNodeSetParams_v2(exec, node, &params)
    })
}

/// The raw `cuGraphAddKernelNode` of `params` after `deps`.
///
/// # Safety
/// `params` must be a valid kernel node block: its function's, with parameter pointers that
/// cover the function's parameters and stay valid for the call.
unsafe fn add_kernel_node_raw(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
) -> Result<sys::CUgraphNode, DeviceError> {
    let mut node: sys::CUgraphNode = ptr::null_mut();
    // SAFETY: `graph` is a live graph of the current context and `deps` nodes of it (null
    // when empty); the caller guarantees `params`; the call copies the block.
    check(op, unsafe {
        sys::cuGraphAddKernelNode_v2(&mut node, graph, deps_ptr(deps), deps.len(), params)
    })?;
    Ok(node)
}

/// Adds a kernel node to `graph` after `deps` with `params` (a kernel node's own block, from
/// [`kernel_params`], whose node is still alive) unchanged.
pub(crate) fn add_kernel_node_as(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
) -> Result<sys::CUgraphNode, DeviceError> {
    // SAFETY: `params` is a live node's own block, read from the driver, whose parameter
    // arrays the driver keeps while that node lives (the caller keeps it).
    unsafe { add_kernel_node_raw(op, graph, deps, params) }
}

/// Adds a kernel node to `graph` after `deps`: `params` (a captured node's block) with the
/// parameter values `bytes`, laid out as `layout` (the function's own layout).
pub(crate) fn add_kernel_node(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    params: &sys::CUDA_KERNEL_NODE_PARAMS,
    layout: &[(usize, usize)],
    bytes: &mut [u8],
) -> Result<sys::CUgraphNode, DeviceError> {
    let mut pointers = Vec::with_capacity(layout.len());
    let params = point_into(op, params, layout, bytes, &mut pointers)?;
    // SAFETY: `params.kernelParams` points at one pointer per parameter into `bytes`, laid out
    // as the function's layout reports (bounds checked by `point_into`); both outlive the call.
    unsafe { add_kernel_node_raw(op, graph, deps, &params) }
}

/// Gives kernel node `new` the launch attributes of kernel node `node`
/// (`cuGraphKernelNodeCopyAttributes`).
pub(crate) fn copy_kernel_attributes(
    op: DeviceOp,
    new: sys::CUgraphNode,
    node: sys::CUgraphNode,
) -> Result<(), DeviceError> {
    // SAFETY: both are live kernel nodes of graphs of the same context.
    check(op, unsafe {
        sys::cuGraphKernelNodeCopyAttributes(new, node)
    })
}

/// A memcpy node's parameters (`cuGraphMemcpyNodeGetParams`).
pub(crate) fn memcpy_params(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<sys::CUDA_MEMCPY3D, DeviceError> {
    let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
    // SAFETY: `node` is a memcpy node of a live graph (callers check the type) and `p` a
    // valid, aligned out-pointer of the type the driver writes.
    check(op, unsafe {
        sys::cuGraphMemcpyNodeGetParams(node, p.as_mut_ptr())
    })?;
    // SAFETY: the call succeeded, so the driver wrote every field (its memory types are the
    // driver's own valid values).
    Ok(unsafe { p.assume_init() })
}

/// Sets memcpy node `node`'s parameters in `exec` (`cuGraphExecMemcpyNodeSetParams`).
pub(crate) fn set_exec_memcpy_params(
    op: DeviceOp,
    exec: sys::CUgraphExec,
    node: sys::CUgraphNode,
    params: &sys::CUDA_MEMCPY3D,
    ctx: sys::CUcontext,
) -> Result<(), DeviceError> {
    // SAFETY: `exec` is a live executable instantiated from the graph `node` (a memcpy node)
    // belongs to, used exclusively by the caller; `params` is the node's own parameter block
    // read from the driver with only device addresses changed; `ctx` is the context both were
    // created in, current on this thread.
    check(op, unsafe {
        sys::cuGraphExecMemcpyNodeSetParams(exec, node, params, ctx)
    })
}

/// Adds a memcpy node of `params` to `graph` after `deps` (`cuGraphAddMemcpyNode`).
pub(crate) fn add_memcpy_node(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    params: &sys::CUDA_MEMCPY3D,
    ctx: sys::CUcontext,
) -> Result<sys::CUgraphNode, DeviceError> {
    let mut node: sys::CUgraphNode = ptr::null_mut();
    // SAFETY: `graph` is a live graph of `ctx` (current) and `deps` nodes of it; `params` is a
    // memcpy node's own block with device addresses moved within memory of the same size.
    check(op, unsafe {
        sys::cuGraphAddMemcpyNode(&mut node, graph, deps_ptr(deps), deps.len(), params, ctx)
    })?;
    Ok(node)
}

/// A memset node's parameters (`cuGraphMemsetNodeGetParams`).
pub(crate) fn memset_params(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<sys::CUDA_MEMSET_NODE_PARAMS, DeviceError> {
    let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMSET_NODE_PARAMS>::zeroed();
    // SAFETY: `node` is a memset node of a live graph (callers check the type) and `p` a
    // valid out-pointer of the type the driver writes.
    check(op, unsafe {
        sys::cuGraphMemsetNodeGetParams(node, p.as_mut_ptr())
    })?;
    // SAFETY: the call succeeded, so the driver wrote every field.
    Ok(unsafe { p.assume_init() })
}

/// Adds a memset node of `params` to `graph` after `deps` (`cuGraphAddMemsetNode`).
pub(crate) fn add_memset_node(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    params: &sys::CUDA_MEMSET_NODE_PARAMS,
    ctx: sys::CUcontext,
) -> Result<sys::CUgraphNode, DeviceError> {
    let mut node: sys::CUgraphNode = ptr::null_mut();
    // SAFETY: as for `add_memcpy_node`, with a memset node's own block.
    check(op, unsafe {
        sys::cuGraphAddMemsetNode(&mut node, graph, deps_ptr(deps), deps.len(), params, ctx)
    })?;
    Ok(node)
}

/// Adds an empty node to `graph` after `deps` (`cuGraphAddEmptyNode`).
pub(crate) fn add_empty_node(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
) -> Result<sys::CUgraphNode, DeviceError> {
    let mut node: sys::CUgraphNode = ptr::null_mut();
    // SAFETY: `graph` is a live graph and `deps` nodes of it.
    check(op, unsafe {
        sys::cuGraphAddEmptyNode(&mut node, graph, deps_ptr(deps), deps.len())
    })?;
    Ok(node)
}

/// An allocation node's address and size (`cuGraphMemAllocNodeGetParams`).
pub(crate) fn mem_alloc_params(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<(u64, usize), DeviceError> {
    let mut p = std::mem::MaybeUninit::<sys::CUDA_MEM_ALLOC_NODE_PARAMS>::zeroed();
    // SAFETY: `node` is an allocation node of a live graph (callers check the type); `p` is a
    // valid out-pointer of the type the driver writes.
    check(op, unsafe {
        sys::cuGraphMemAllocNodeGetParams(node, p.as_mut_ptr())
    })?;
    // SAFETY: the call succeeded, so the driver wrote the block.
    let p = unsafe { p.assume_init() };
    Ok((p.dptr, p.bytesize))
}

/// The address a free node frees (`cuGraphMemFreeNodeGetParams`).
pub(crate) fn mem_free_params(op: DeviceOp, node: sys::CUgraphNode) -> Result<u64, DeviceError> {
    let mut at: sys::CUdeviceptr = 0;
    // SAFETY: `node` is a free node of a live graph (callers check the type); `at` a valid
    // out-pointer.
    check(op, unsafe {
        sys::cuGraphMemFreeNodeGetParams(node, &mut at)
    })?;
    Ok(at)
}

/// The graph a child graph node owns (`cuGraphChildGraphNodeGetGraph`; not the caller's to
/// destroy).
pub(crate) fn child_graph(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<sys::CUgraph, DeviceError> {
    let mut child: sys::CUgraph = ptr::null_mut();
    // SAFETY: `node` is a child graph node of a live graph (callers check the type); `child`
    // a valid out-pointer.
    check(op, unsafe {
        sys::cuGraphChildGraphNodeGetGraph(node, &mut child)
    })?;
    Ok(child)
}

/// A conditional handle for `graph` (`cuGraphConditionalHandleCreate`, default value 0, no
/// flags).
pub(crate) fn conditional_handle(
    op: DeviceOp,
    graph: sys::CUgraph,
    ctx: sys::CUcontext,
) -> Result<sys::CUgraphConditionalHandle, DeviceError> {
    let mut handle: sys::CUgraphConditionalHandle = 0;
    // SAFETY: `graph` is a live graph of `ctx`, which is current; default value 0, no flags;
    // `handle` is a valid out-pointer.
    check(op, unsafe {
        sys::cuGraphConditionalHandleCreate(&mut handle, graph, ctx, 0, 0)
    })?;
    Ok(handle)
}

/// Adds a conditional node of type `kind` with `size` bodies and handle `handle` to `graph`
/// after `deps` (`cuGraphAddNode`): the node and its body graphs (owned by the node).
pub(crate) fn add_conditional_node(
    op: DeviceOp,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    handle: sys::CUgraphConditionalHandle,
    kind: sys::CUgraphConditionalNodeType,
    size: usize,
    ctx: sys::CUcontext,
) -> Result<(sys::CUgraphNode, Vec<sys::CUgraph>), DeviceError> {
    // SAFETY: `CUgraphNodeParams` is a plain C struct of integers, pointers and a union of
    // such; all-zero bytes is a valid value of every field.
    let mut params: sys::CUgraphNodeParams = unsafe { std::mem::zeroed() };
    params.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL;
    params.__bindgen_anon_1.conditional = sys::CUDA_CONDITIONAL_NODE_PARAMS {
        handle,
        type_: kind,
        size: size as u32,
        phGraph_out: ptr::null_mut(),
        ctx,
    };
    let mut node: sys::CUgraphNode = ptr::null_mut();
    // SAFETY: `graph` is a live graph of `ctx` owned by the caller; `deps` are its nodes;
    // `params` is a zeroed conditional node block with a handle created for `graph`.
    check(op, unsafe {
        sys::cuGraphAddNode_v2(
            &mut node,
            graph,
            deps_ptr(deps),
            ptr::null(),
            deps.len(),
            &mut params,
        )
    })?;
    // SAFETY: the call succeeded, so the driver set `phGraph_out` to an array of `size` body
    // graphs, owned by the node.
    let out = unsafe { params.__bindgen_anon_1.conditional.phGraph_out };
    if out.is_null() {
        return Err(invalid_argument(op, "the driver returned no body graphs"));
    }
    // SAFETY: as above: `size` graph handles at `out`.
    let bodies = unsafe { std::slice::from_raw_parts(out, size) }.to_vec();
    Ok((node, bodies))
}

/// `deps` as the driver's dependency array: null when empty.
fn deps_ptr(deps: &[sys::CUgraphNode]) -> *const sys::CUgraphNode {
    if deps.is_empty() {
        ptr::null()
    } else {
        deps.as_ptr()
    }
}
