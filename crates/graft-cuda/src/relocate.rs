//! A conditional body made fit for its node: what bodies cannot hold becomes a typed error, and the body is rebuilt in the node's body graph with its stream-ordered allocations (candle's tensors) moved into device memory the graph owns.
//!
//! CUDA refuses memory nodes in a conditional body, and every tensor a framework such as
//! candle makes during a capture is one (`cuMemAllocAsync` becomes an allocation node, the
//! drop a free node). Nor can the captured graph be cleaned in place (the driver deletes no
//! node of a graph that holds memory nodes) and then added as a child graph (a child graph
//! may not hold a conditional node). So `finish` copies the body into the node's body graph
//! node by node, in dependency order: kernels, copies, memsets and empty nodes, each with its
//! edges (a programmatic edge between two kernels stays programmatic); the memory nodes are left out, what came before each joined to what came after.
//! A body's allocations are its iteration's own: each is freed inside the body, so its bytes
//! can live at a fixed place for the graph's whole life. Each gets its own range of one
//! `cuMemAlloc`, and every use (kernel parameters, copy and memset ends) moves by the same
//! offset. A body that keeps an allocation past its end, frees memory it did not allocate,
//! uses an allocation where graft cannot see it (a kernel whose parameters cannot be read),
//! or holds a node of another kind (a child graph, an event) is refused.

use cudarc::driver::sys;
use graft_core::{ConditionalRule, DeviceError, DeviceOp};

use crate::context::Context;
use crate::driver::edge;
use crate::driver::graph::{self as dg, kernel_name, node_type, nodes};
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
    node: sys::CUgraphNode,
    at: u64,
    bytes: u64,
    offset: u64,
}

fn refuse(op: DeviceOp, rule: ConditionalRule) -> DeviceError {
    DeviceError::Conditional { op, rule }
}

/// Checks `body` (a graph just captured, owned by the caller) and copies it into `target`
/// (a body graph of an open conditional node), its allocations moved.
pub(crate) fn finish(
    device: &Context,
    body: sys::CUgraph,
    target: sys::CUgraph,
) -> Result<Body, DeviceError> {
    use sys::CUgraphNodeType as T;
    let all = nodes(OP, body)?;
    let mut kinds = Vec::with_capacity(all.len());
    let mut allocations: Vec<Allocation> = Vec::new();
    let mut frees: Vec<(sys::CUgraphNode, u64)> = Vec::new();
    let mut host_random = 0;
    let mut end = 0u64;
    for &node in &all {
        let kind = node_type(OP, node)?;
        match kind {
            k if k == T::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                let name = kernel_name(node).unwrap_or_default();
                if name.contains("nccl") {
                    return Err(refuse(DeviceOp::Collective, ConditionalRule::Collective));
                }
                if name.to_ascii_lowercase().contains("curand") {
                    host_random += 1;
                }
            }
            k if k == T::CU_GRAPH_NODE_TYPE_MEMCPY as u32
                || k == T::CU_GRAPH_NODE_TYPE_MEMSET as u32
                || k == T::CU_GRAPH_NODE_TYPE_EMPTY as u32 => {}
            k if k == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 => {
                let (at, bytes) = dg::mem_alloc_params(OP, node)?;
                let bytes = bytes as u64;
                allocations.push(Allocation {
                    node,
                    at,
                    bytes,
                    offset: end,
                });
                end += bytes.div_ceil(ALIGN) * ALIGN;
            }
            k if k == T::CU_GRAPH_NODE_TYPE_MEM_FREE as u32 => {
                frees.push((node, dg::mem_free_params(OP, node)?));
            }
            k if k == T::CU_GRAPH_NODE_TYPE_WAIT_EVENT as u32
                || k == T::CU_GRAPH_NODE_TYPE_EVENT_RECORD as u32 =>
            {
                return Err(refuse(DeviceOp::Event, ConditionalRule::Event));
            }
            k if k == T::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32 => {
                return Err(refuse(OP, ConditionalRule::Nested));
            }
            _ => return Err(refuse(OP, ConditionalRule::Node)),
        }
        kinds.push(kind);
    }
    // Every allocation must be freed inside the body, and every free be of one of them.
    if frees.len() != allocations.len()
        || frees
            .iter()
            .any(|(_, at)| !allocations.iter().any(|a| a.at == *at))
    {
        return Err(refuse(DeviceOp::RawAlloc, ConditionalRule::Allocation));
    }
    let scratch = if allocations.is_empty() {
        None
    } else {
        Some(device.alloc_relaxed(DeviceOp::RawAlloc, end as usize)?)
    };
    let place = Place {
        allocations: &allocations,
        frees: &frees,
        scratch: scratch.unwrap_or(0),
        ctx: device.ctx,
    };
    if let Err(e) = copy_nodes(&place, &all, &kinds, target) {
        device.free_scratch(scratch.into_iter().collect());
        return Err(e);
    }
    if scratch.is_some() {
        tracing::debug!(
            allocations = allocations.len(),
            bytes = end,
            "a conditional body's allocations moved into memory its graph owns"
        );
    }
    Ok(Body {
        scratch,
        host_random,
    })
}

/// Where a body's allocations move to, and its context.
struct Place<'a> {
    allocations: &'a [Allocation],
    /// The free nodes, with the address each frees.
    frees: &'a [(sys::CUgraphNode, u64)],
    scratch: u64,
    ctx: sys::CUcontext,
}

impl Place<'_> {
    /// Where `value` moves to, if it points into one of the `live` allocations (indices
    /// into `allocations`). Only the live ones: CUDA gives an allocation made after another's
    /// free the same addresses, so an address alone does not name an allocation.
    fn moved(&self, live: &[usize], value: u64) -> Option<u64> {
        live.iter()
            .map(|&i| &self.allocations[i])
            .find(|a| value >= a.at && value < a.at + a.bytes.max(1))
            .map(|a| self.scratch + a.offset + (value - a.at))
    }
}

/// Copies the nodes of a body (`all`, of types `kinds`) into `target` in dependency order,
/// leaving the memory nodes out: a node depends on the copies of its dependencies, and on
/// what a left-out dependency depended on.
fn copy_nodes(
    place: &Place<'_>,
    all: &[sys::CUgraphNode],
    kinds: &[u32],
    target: sys::CUgraph,
) -> Result<(), DeviceError> {
    use sys::CUgraphNodeType as T;
    let index = |n: sys::CUgraphNode| all.iter().position(|&m| m == n);
    let mut deps: Vec<Vec<(usize, sys::CUgraphEdgeData)>> = Vec::with_capacity(all.len());
    for &node in all {
        let mut d = Vec::new();
        for (dep, edge) in edge::dependencies(OP, node)? {
            let at = index(dep).ok_or_else(|| {
                crate::error::invalid_argument(OP, "a body node depends on a node of another graph")
            })?;
            d.push((at, edge));
        }
        deps.push(d);
    }
    // What each node stands for in `target`: its copy, or (a memory node) its dependencies'.
    let mut stands_for: Vec<Option<Vec<sys::CUgraphNode>>> = vec![None; all.len()];
    // The allocations made and not yet freed, in the order nodes are copied (one stream's
    // order: a body holds no events, so its nodes form one chain).
    let mut live: Vec<usize> = Vec::new();
    let mut left = all.len();
    while left > 0 {
        let before = left;
        for i in 0..all.len() {
            if stands_for[i].is_some() || deps[i].iter().any(|&(d, _)| stands_for[d].is_none()) {
                continue;
            }
            // Full edges after what the dependencies stand for; a programmatic edge from a
            // copied kernel stays programmatic (one through a left-out memory node is full).
            let mut after: Vec<sys::CUgraphNode> = Vec::new();
            let mut programmatic: Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)> = Vec::new();
            for &(d, edge) in &deps[i] {
                let copied = !is_memory(kinds[d]);
                for &n in stands_for[d].iter().flatten() {
                    if copied && edge::is_programmatic(&edge) {
                        programmatic.push((n, edge));
                    } else if !after.contains(&n) {
                        after.push(n);
                    }
                }
            }
            let kind = kinds[i];
            stands_for[i] = Some(if kind == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 {
                live.extend(place.allocations.iter().position(|a| a.node == all[i]));
                after.extend(programmatic.iter().map(|&(n, _)| n));
                after
            } else if kind == T::CU_GRAPH_NODE_TYPE_MEM_FREE as u32 {
                if let Some(&(_, at)) = place.frees.iter().find(|(n, _)| *n == all[i]) {
                    live.retain(|&a| place.allocations[a].at != at);
                }
                after.extend(programmatic.iter().map(|&(n, _)| n));
                after
            } else {
                let new = copy_node(place, &live, all[i], kind, target, &after)?;
                let (from, data): (Vec<_>, Vec<_>) = programmatic.into_iter().unzip();
                edge::add_dependencies(OP, target, &from, new, &data)?;
                vec![new]
            });
            left -= 1;
        }
        if left == before {
            return Err(crate::error::invalid_argument(
                OP,
                "a body's dependencies form a cycle",
            ));
        }
    }
    Ok(())
}

/// Whether a node of type `kind` is a memory node (left out of the copy).
fn is_memory(kind: u32) -> bool {
    use sys::CUgraphNodeType as T;
    kind == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 || kind == T::CU_GRAPH_NODE_TYPE_MEM_FREE as u32
}

/// Adds a copy of `node` (of type `kind`) to `target` after `after`, its uses of the body's
/// allocations moved.
fn copy_node(
    place: &Place<'_>,
    live: &[usize],
    node: sys::CUgraphNode,
    kind: u32,
    target: sys::CUgraph,
    after: &[sys::CUgraphNode],
) -> Result<sys::CUgraphNode, DeviceError> {
    use sys::CUgraphNodeType as T;
    if kind == T::CU_GRAPH_NODE_TYPE_KERNEL as u32 {
        let Some(k) = read_kernel(node, node)? else {
            if !place.allocations.is_empty() {
                // Its parameters cannot be read: a use of an allocation could hide there.
                return Err(refuse(DeviceOp::KernelLaunch, ConditionalRule::Allocation));
            }
            // `node`'s own block, whose parameter arrays the driver keeps while the body
            // (which outlives this call) lives.
            let p = dg::kernel_params(OP, node)?;
            let new = dg::add_kernel_node_as(OP, target, after, &p)?;
            return copy_attributes(new, node);
        };
        let mut bytes = k.bytes.clone();
        for (at, value) in words(&k.bytes, &k.layout) {
            if let Some(to) = place.moved(live, value) {
                bytes[at..at + 8].copy_from_slice(&to.to_le_bytes());
            }
        }
        let new = dg::add_kernel_node(OP, target, after, &k.params, &k.layout, &mut bytes)?;
        return copy_attributes(new, node);
    }
    if kind == T::CU_GRAPH_NODE_TYPE_MEMCPY as u32 {
        let mut p = dg::memcpy_params(OP, node)?;
        p.srcDevice = place.moved(live, p.srcDevice).unwrap_or(p.srcDevice);
        p.dstDevice = place.moved(live, p.dstDevice).unwrap_or(p.dstDevice);
        return dg::add_memcpy_node(OP, target, after, &p, place.ctx);
    }
    if kind == T::CU_GRAPH_NODE_TYPE_MEMSET as u32 {
        let mut p = dg::memset_params(OP, node)?;
        p.dst = place.moved(live, p.dst).unwrap_or(p.dst);
        return dg::add_memset_node(OP, target, after, &p, place.ctx);
    }
    // An empty node (the only other kind `finish` lets through).
    dg::add_empty_node(OP, target, after)
}

/// Gives the kernel node `new` the launch attributes of `node`; `new`.
fn copy_attributes(
    new: sys::CUgraphNode,
    node: sys::CUgraphNode,
) -> Result<sys::CUgraphNode, DeviceError> {
    dg::copy_kernel_attributes(OP, new, node)?;
    Ok(new)
}
