//! A conditional body made fit for its node: what bodies cannot hold becomes a typed error, and the body's stream-ordered allocations (candle's tensors) move into device memory the graph owns.
//!
//! CUDA refuses memory nodes in a conditional body, and every tensor a framework such as
//! candle makes during a capture is one (`cuMemAllocAsync` becomes an allocation node, the
//! drop a free node). A body's allocations are its iteration's own: each is freed inside
//! the body, so its bytes can live at a fixed place for the graph's whole life. `finish`
//! gives each its own range of one `cuMemAlloc`, moves every use (kernel parameters, copy
//! and memset ends) by the same offset, and removes the memory nodes, joining what came
//! before each to what came after. A body that keeps an allocation past its end, frees memory
//! it did not allocate, or uses an allocation where graft cannot see it (a kernel whose
//! parameters cannot be read) is refused.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;
use graft_core::{ConditionalRule, DeviceError, DeviceOp};

use crate::context::Inner;
use crate::error::check;
use crate::graph::{kernel_name, node_type, nodes};
use crate::patch::{read_kernel, words};

const OP: DeviceOp = DeviceOp::Conditional;

/// Alignment of each moved allocation (CUDA's allocations are at least 256-byte aligned).
const ALIGN: u64 = 256;

/// What a finished body leaves to its graph.
pub(crate) struct Body {
    /// The memory its allocations moved to, if it had any.
    pub(crate) scratch: Option<u64>,
    /// Kernels of a host-side random generator in it.
    pub(crate) host_random: usize,
}

/// One allocation of the body: where CUDA put it, its size, its place in the scratch.
struct Allocation {
    at: u64,
    bytes: u64,
    offset: u64,
}

fn refuse(op: DeviceOp, rule: ConditionalRule) -> DeviceError {
    DeviceError::Conditional { op, rule }
}

/// Checks `body` (a graph just captured, owned by the caller) and moves its allocations.
pub(crate) fn finish(device: &Inner, body: sys::CUgraph) -> Result<Body, DeviceError> {
    use sys::CUgraphNodeType as T;
    let mut allocations: Vec<Allocation> = Vec::new();
    let mut frees: Vec<(sys::CUgraphNode, u64)> = Vec::new();
    let mut memory_nodes = Vec::new();
    let mut kernels = Vec::new();
    let mut copies = Vec::new();
    let mut memsets = Vec::new();
    let mut host_random = 0;
    let mut end = 0u64;
    for node in nodes(OP, body)? {
        match node_type(OP, node)? {
            k if k == T::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                let name = kernel_name(node).unwrap_or_default();
                if name.contains("nccl") {
                    return Err(refuse(DeviceOp::Collective, ConditionalRule::Collective));
                }
                if name.to_ascii_lowercase().contains("curand") {
                    host_random += 1;
                }
                kernels.push(node);
            }
            k if k == T::CU_GRAPH_NODE_TYPE_MEMCPY as u32 => copies.push(node),
            k if k == T::CU_GRAPH_NODE_TYPE_MEMSET as u32 => memsets.push(node),
            k if k == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 => {
                let mut p = std::mem::MaybeUninit::<sys::CUDA_MEM_ALLOC_NODE_PARAMS>::zeroed();
                // SAFETY: `node` is an allocation node of the live graph `body`; `p` is a
                // valid out-pointer of the type the driver writes.
                check(OP, unsafe {
                    sys::cuGraphMemAllocNodeGetParams(node, p.as_mut_ptr())
                })?;
                // SAFETY: the call succeeded, so the driver wrote the block.
                let p = unsafe { p.assume_init() };
                let bytes = p.bytesize as u64;
                allocations.push(Allocation {
                    at: p.dptr,
                    bytes,
                    offset: end,
                });
                end += bytes.div_ceil(ALIGN) * ALIGN;
                memory_nodes.push(node);
            }
            k if k == T::CU_GRAPH_NODE_TYPE_MEM_FREE as u32 => {
                let mut at: sys::CUdeviceptr = 0;
                // SAFETY: `node` is a free node of the live graph; `at` a valid out-pointer.
                check(OP, unsafe {
                    sys::cuGraphMemFreeNodeGetParams(node, &mut at)
                })?;
                frees.push((node, at));
                memory_nodes.push(node);
            }
            k if k == T::CU_GRAPH_NODE_TYPE_GRAPH as u32
                || k == T::CU_GRAPH_NODE_TYPE_EMPTY as u32
                || k == T::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32 => {}
            k if k == T::CU_GRAPH_NODE_TYPE_WAIT_EVENT as u32
                || k == T::CU_GRAPH_NODE_TYPE_EVENT_RECORD as u32 =>
            {
                return Err(refuse(DeviceOp::Event, ConditionalRule::Event));
            }
            _ => return Err(refuse(OP, ConditionalRule::Node)),
        }
    }
    // Every allocation must be freed inside the body, and every free be of one of them.
    if frees.len() != allocations.len()
        || frees
            .iter()
            .any(|(_, at)| !allocations.iter().any(|a| a.at == *at))
    {
        return Err(refuse(DeviceOp::RawAlloc, ConditionalRule::Allocation));
    }
    if allocations.is_empty() {
        return Ok(Body {
            scratch: None,
            host_random,
        });
    }
    let scratch = device.alloc_relaxed(DeviceOp::RawAlloc, end as usize)?;
    let moved = move_uses(&allocations, scratch, &kernels, &copies, &memsets)
        .and_then(|()| remove_memory_nodes(body, &memory_nodes));
    if let Err(e) = moved {
        crate::conditional::free_scratch(device, vec![scratch]);
        return Err(e);
    }
    tracing::debug!(
        allocations = allocations.len(),
        bytes = end,
        "a conditional body's allocations moved into memory its graph owns"
    );
    Ok(Body {
        scratch: Some(scratch),
        host_random,
    })
}

/// Where `value` moves to, if it points into one of `allocations`.
fn moved(allocations: &[Allocation], scratch: u64, value: u64) -> Option<u64> {
    allocations
        .iter()
        .find(|a| value >= a.at && value < a.at + a.bytes.max(1))
        .map(|a| scratch + a.offset + (value - a.at))
}

/// Rewrites every use of the allocations: kernel parameters, copy ends, memset targets.
fn move_uses(
    allocations: &[Allocation],
    scratch: u64,
    kernels: &[sys::CUgraphNode],
    copies: &[sys::CUgraphNode],
    memsets: &[sys::CUgraphNode],
) -> Result<(), DeviceError> {
    for &node in kernels {
        let Some(k) = read_kernel(node, node)? else {
            // Its parameters cannot be read: a use of an allocation could hide there.
            return Err(refuse(DeviceOp::KernelLaunch, ConditionalRule::Allocation));
        };
        let mut bytes = k.bytes.clone();
        let mut changed = false;
        for (at, value) in words(&k.bytes, &k.layout) {
            if let Some(to) = moved(allocations, scratch, value) {
                bytes[at..at + 8].copy_from_slice(&to.to_le_bytes());
                changed = true;
            }
        }
        if !changed {
            continue;
        }
        let mut pointers: Vec<*mut c_void> = k
            .layout
            .iter()
            .map(|&(offset, _)| bytes[offset..].as_mut_ptr().cast::<c_void>())
            .collect();
        let mut params = k.params;
        params.kernelParams = pointers.as_mut_ptr();
        params.extra = ptr::null_mut();
        // SAFETY: `node` is a kernel node of the live body graph; `params` is its own block
        // with `kernelParams` pointing at one pointer per parameter into `bytes`, laid out as
        // `cuFuncGetParamInfo` reported; both outlive the call, which copies them.
        check(OP, unsafe {
            sys::cuGraphKernelNodeSetParams_v2(node, &params)
        })?;
    }
    for &node in copies {
        let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
        // SAFETY: `node` is a memcpy node of the live graph; `p` a valid out-pointer.
        check(OP, unsafe {
            sys::cuGraphMemcpyNodeGetParams(node, p.as_mut_ptr())
        })?;
        // SAFETY: the call succeeded, so the driver wrote every field.
        let mut p = unsafe { p.assume_init() };
        let (src, dst) = (
            moved(allocations, scratch, p.srcDevice),
            moved(allocations, scratch, p.dstDevice),
        );
        if src.is_none() && dst.is_none() {
            continue;
        }
        p.srcDevice = src.unwrap_or(p.srcDevice);
        p.dstDevice = dst.unwrap_or(p.dstDevice);
        // SAFETY: `p` is the node's own block with device addresses moved within memory of
        // the same size.
        check(OP, unsafe { sys::cuGraphMemcpyNodeSetParams(node, &p) })?;
    }
    for &node in memsets {
        let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMSET_NODE_PARAMS>::zeroed();
        // SAFETY: `node` is a memset node of the live graph; `p` a valid out-pointer.
        check(OP, unsafe {
            sys::cuGraphMemsetNodeGetParams(node, p.as_mut_ptr())
        })?;
        // SAFETY: the call succeeded, so the driver wrote every field.
        let mut p = unsafe { p.assume_init() };
        if let Some(to) = moved(allocations, scratch, p.dst) {
            p.dst = to;
            // SAFETY: as for copies.
            check(OP, unsafe { sys::cuGraphMemsetNodeSetParams(node, &p) })?;
        }
    }
    Ok(())
}

/// Removes each memory node, making what it followed precede what followed it.
fn remove_memory_nodes(body: sys::CUgraph, memory: &[sys::CUgraphNode]) -> Result<(), DeviceError> {
    for &node in memory {
        let before = edges(node, true)?;
        let after = edges(node, false)?;
        // SAFETY: `node` is a node of the live graph `body`, removed once with its edges.
        check(OP, unsafe { sys::cuGraphDestroyNode(node) })?;
        for &from in &before {
            for &to in &after {
                // SAFETY: both are live nodes of `body` (memory nodes are removed one at a time,
                // so neither is one already destroyed); edge data null (a plain dependency).
                check(OP, unsafe {
                    sys::cuGraphAddDependencies_v2(body, &from, &to, ptr::null(), 1)
                })?;
            }
        }
    }
    Ok(())
}

/// A node's dependencies (`before`) or dependents.
fn edges(node: sys::CUgraphNode, before: bool) -> Result<Vec<sys::CUgraphNode>, DeviceError> {
    let get = |out: *mut sys::CUgraphNode, n: &mut usize| {
        // SAFETY: `node` is a live node; `out` is null (count only) or has room for `n`
        // handles; edge data is not asked for.
        unsafe {
            if before {
                sys::cuGraphNodeGetDependencies_v2(node, out, ptr::null_mut(), n)
            } else {
                sys::cuGraphNodeGetDependentNodes_v2(node, out, ptr::null_mut(), n)
            }
        }
    };
    let mut count = 0usize;
    check(OP, get(ptr::null_mut(), &mut count))?;
    let mut out = vec![ptr::null_mut(); count];
    if count > 0 {
        let mut filled = count;
        check(OP, get(out.as_mut_ptr(), &mut filled))?;
        out.truncate(filled.min(count));
    }
    Ok(out)
}
