//! Comparing a recording with a new capture node by node (`Device::compare`), over the
//! driver's node listing and parameter reads: kernel functions, launch configurations, every
//! parameter's bytes (laid out by `cuFuncGetParamInfo`), copy and memset parameters. The
//! recording is compared as it runs now: its re-pointed copies with their current ends.

use cudarc::driver::sys;
use graft_core::backend::CopyEnds;
use graft_core::{DeviceError, DevicePtr, GraphDifference};

use crate::driver::graph::{self as dg, kernel_name, node_type, nodes};
use crate::error::INSPECT_OP;
use crate::graph::CudaGraph;
use crate::inner::Inner;
use crate::patch::read_kernel;

use sys::CUgraphNodeType as T;

impl Inner {
    /// See `graft_core::Device::compare`. `None` when a node cannot be compared: a kernel
    /// whose parameters the driver does not show (see `crate::patch`), a child graph or a
    /// conditional node.
    pub(crate) fn compare(
        &self,
        recorded: &CudaGraph,
        now: &CudaGraph,
    ) -> Result<Option<Vec<GraphDifference>>, DeviceError> {
        let op = INSPECT_OP;
        self.enter(op)?;
        let (old, new) = (recorded.lock(), now.lock());
        // Node handles are the instantiated graph's; the parameters are the graph the
        // executable was last updated with (paired in creation order).
        let old_nodes: Vec<_> = nodes(op, old.graph)?
            .into_iter()
            .zip(nodes(op, old.current_graph())?)
            .collect();
        let new_nodes = nodes(op, new.current_graph())?;
        let mut kinds = Vec::with_capacity(old_nodes.len());
        for (&(_, a), &b) in old_nodes.iter().zip(&new_nodes) {
            kinds.push((node_type(op, a)?, node_type(op, b)?));
        }
        if old_nodes.len() != new_nodes.len() || kinds.iter().any(|(a, b)| a != b) {
            return Ok(Some(vec![GraphDifference::Shape {
                recorded: old_nodes.len(),
                now: new_nodes.len(),
            }]));
        }
        let mut out = Vec::new();
        for (node, ((&(handle, a), &b), &(kind, _))) in
            old_nodes.iter().zip(&new_nodes).zip(&kinds).enumerate()
        {
            match kind {
                k if k == T::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                    let readable = compare_kernel(node, (handle, a), b, &mut out)?;
                    if !readable {
                        return Ok(None);
                    }
                }
                k if k == T::CU_GRAPH_NODE_TYPE_MEMCPY as u32 => {
                    let p = match old.copy_params(handle) {
                        Some(p) => p,
                        None => dg::memcpy_params(op, a)?,
                    };
                    let q = dg::memcpy_params(op, b)?;
                    let ends = |p: &sys::CUDA_MEMCPY3D| {
                        let e = CopyEnds {
                            dst: DevicePtr(p.dstDevice),
                            src: DevicePtr(p.srcDevice),
                        };
                        (e, p.WidthInBytes * p.Height.max(1) * p.Depth.max(1))
                    };
                    if ends(&p) != ends(&q) {
                        out.push(GraphDifference::Copy {
                            node,
                            recorded: ends(&p),
                            now: ends(&q),
                        });
                    }
                }
                k if k == T::CU_GRAPH_NODE_TYPE_MEMSET as u32 => {
                    let (p, q) = (dg::memset_params(op, a)?, dg::memset_params(op, b)?);
                    let shape = |p: &sys::CUDA_MEMSET_NODE_PARAMS| {
                        (p.value, p.elementSize, p.width, p.height, p.pitch)
                    };
                    if p.dst != q.dst || shape(&p) != shape(&q) {
                        out.push(GraphDifference::Memset {
                            node,
                            recorded: DevicePtr(p.dst),
                            now: DevicePtr(q.dst),
                        });
                    }
                }
                k if k == T::CU_GRAPH_NODE_TYPE_GRAPH as u32
                    || k == T::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32 =>
                {
                    return Ok(None);
                }
                // Empty, event, allocation and free nodes: their kinds matched.
                _ => {}
            }
        }
        Ok(Some(out))
    }
}

/// Compares kernel node `a` (the recording's, `handle` its instantiated node) with `b`;
/// `false` when their parameters cannot be read.
fn compare_kernel(
    node: usize,
    (handle, a): (sys::CUgraphNode, sys::CUgraphNode),
    b: sys::CUgraphNode,
    out: &mut Vec<GraphDifference>,
) -> Result<bool, DeviceError> {
    let name = kernel_name(a).unwrap_or_else(|| format!("kernel node {node}"));
    let other = kernel_name(b).unwrap_or_else(|| format!("kernel node {node}"));
    if name != other {
        out.push(GraphDifference::Function {
            node,
            recorded: name,
            now: other,
        });
        return Ok(true);
    }
    let (Some(p), Some(q)) = (read_kernel(handle, a)?, read_kernel(b, b)?) else {
        return Ok(false);
    };
    let launch = |k: &sys::CUDA_KERNEL_NODE_PARAMS| {
        (
            [k.gridDimX, k.gridDimY, k.gridDimZ],
            [k.blockDimX, k.blockDimY, k.blockDimZ],
            k.sharedMemBytes,
        )
    };
    if launch(&p.params) != launch(&q.params) || p.layout != q.layout {
        out.push(GraphDifference::Launch { node, kernel: name });
        return Ok(true);
    }
    for (index, &(offset, size)) in p.layout.iter().enumerate() {
        let (x, y) = (
            &p.bytes[offset..offset + size],
            &q.bytes[offset..offset + size],
        );
        if x != y {
            out.push(GraphDifference::Argument {
                node,
                kernel: name.clone(),
                index,
                recorded: x.into(),
                now: y.into(),
            });
        }
    }
    Ok(true)
}
