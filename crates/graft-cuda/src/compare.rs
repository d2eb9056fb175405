//! Comparing a recording with a new capture node by node (`Device::compare`), over the
//! driver's node listing and parameter reads: kernel functions, launch configurations, every
//! parameter's bytes (laid out by `cuFuncGetParamInfo`), copy and memset parameters. The
//! recording is compared as it runs now: its re-pointed copies with their current ends.
//! Addresses inside the graphs' own allocations (allocation nodes, as candle's stream-ordered
//! tensors are captured) are placed by the driver anew in each capture: a pointer into the
//! recording's i-th allocation at some offset matches one into the capture's i-th at the same
//! offset. Pointers into the comparing thread's stack (host frames a library passes beside
//! values) match each other. A difference is reported with the words this device paired
//! set to the recording's, so that core judges only the addresses it placed and the values.

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
        let mut owned = Owned(Vec::new());
        for (&(_, a), &b) in old_nodes.iter().zip(&new_nodes) {
            if node_type(op, a)? == T::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32 {
                let ((from, len), (to, now_len)) =
                    (dg::mem_alloc_params(op, a)?, dg::mem_alloc_params(op, b)?);
                if len == now_len {
                    owned.0.push((from, len as u64, to));
                }
            }
        }
        let mut out = Vec::new();
        for (node, ((&(handle, a), &b), &(kind, _))) in
            old_nodes.iter().zip(&new_nodes).zip(&kinds).enumerate()
        {
            match kind {
                k if k == T::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                    let readable = compare_kernel(node, (handle, a), b, &owned, &mut out)?;
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
                    let ((e, n), (f, m)) = (ends(&p), ends(&q));
                    // An end this device pairs itself is reported as unmoved, so that core
                    // judges only the ends its own bookkeeping places (a delivered output's
                    // copy reads a graph allocation and writes the caller's memory).
                    let paired = |old: DevicePtr, now: DevicePtr| {
                        if owned.same(old.0, now.0) { old } else { now }
                    };
                    let f = CopyEnds {
                        dst: paired(e.dst, f.dst),
                        src: paired(e.src, f.src),
                    };
                    if n != m || f.dst != e.dst || f.src != e.src {
                        out.push(GraphDifference::Copy {
                            node,
                            recorded: (e, n),
                            now: (f, m),
                        });
                    }
                }
                k if k == T::CU_GRAPH_NODE_TYPE_MEMSET as u32 => {
                    let (p, q) = (dg::memset_params(op, a)?, dg::memset_params(op, b)?);
                    let shape = |p: &sys::CUDA_MEMSET_NODE_PARAMS| {
                        (p.value, p.elementSize, p.width, p.height, p.pitch)
                    };
                    if !owned.same(p.dst, q.dst) || shape(&p) != shape(&q) {
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

/// The graphs' own allocations paired in order: `(recording's start, length, capture's
/// start)`.
struct Owned(Vec<(u64, u64, u64)>);

impl Owned {
    /// Whether address `old` of the recording and `now` of the capture are the same place:
    /// equal, at one offset into paired allocations, or both in this thread's stack.
    fn same(&self, old: u64, now: u64) -> bool {
        old == now
            || on_this_stack(now)
            || self
                .0
                .iter()
                .any(|&(from, len, to)| old >= from && old - from < len && now == to + (old - from))
    }

    /// The capture's bytes `y` of a parameter with each 8-byte word this device pairs with
    /// the recording's `x` (see [`Owned::same`]) replaced by the recording's, so that core
    /// judges only the other words.
    fn unpaired(&self, x: &[u8], y: &[u8]) -> Box<[u8]> {
        let word = |c: &[u8]| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        if x.len() != y.len() || !x.len().is_multiple_of(8) {
            return y.into();
        }
        x.chunks_exact(8)
            .zip(y.chunks_exact(8))
            .flat_map(|(p, q)| if self.same(word(p), word(q)) { p } else { q })
            .copied()
            .collect()
    }

    /// Whether two parameters' bytes are the same up to the words this device pairs (see
    /// [`Owned::unpaired`]).
    fn same_bytes(&self, x: &[u8], y: &[u8]) -> bool {
        x == y || *self.unpaired(x, y) == *x
    }
}

/// Whether a word of the new capture points into this thread's stack, near the frame
/// comparing it (the capture ran on this thread a moment ago): a host frame a library
/// described the launch from (cuBLAS's small-matrix kernels carry the addresses of their host
/// scalars beside the scalars' values). Such a word differs between any two captures, on any
/// thread, and no replay may read through it (the frame is gone), so it is no value; no value
/// a body passes to a kernel looks like one.
fn on_this_stack(word: u64) -> bool {
    /// Further than any two frames of one call are apart, nearer than any other mapping.
    const SPAN: u64 = 8 << 20;
    let here = std::ptr::addr_of!(word) as u64;
    word.abs_diff(here) < SPAN
}

/// Compares kernel node `a` (the recording's, `handle` its instantiated node) with `b`;
/// `false` when their parameters cannot be read.
fn compare_kernel(
    node: usize,
    (handle, a): (sys::CUgraphNode, sys::CUgraphNode),
    b: sys::CUgraphNode,
    owned: &Owned,
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
        if !owned.same_bytes(x, y) {
            out.push(GraphDifference::Argument {
                node,
                kernel: name.clone(),
                index,
                recorded: x.into(),
                now: owned.unpaired(x, y),
            });
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[u64]) -> Vec<u8> {
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn a_pointer_into_this_stack_is_no_value_and_a_scalar_is() {
        let local = 0u64;
        assert!(on_this_stack(std::ptr::addr_of!(local) as u64));
        assert!(!on_this_stack(u64::from(1.5f32.to_bits())));
        assert!(!on_this_stack(7));
        assert!(!on_this_stack(0x3_0206_1c00), "a device address");
    }

    #[test]
    fn paired_words_are_reported_as_the_recordings() {
        let owned = Owned(vec![(0x1000, 0x100, 0x5000)]);
        let local = 0u64;
        let frame = std::ptr::addr_of!(local) as u64;
        // A cuBLAS-like struct: a host frame, a graph allocation that moved, a scalar.
        let x = words(&[0x7f00_0000_0000, 0x1010, 3]);
        let y = words(&[frame, 0x5010, 4]);
        assert!(!owned.same_bytes(&x, &y));
        assert_eq!(
            &*owned.unpaired(&x, &y),
            &words(&[0x7f00_0000_0000, 0x1010, 4])[..]
        );
        let z = words(&[frame, 0x5010, 3]);
        assert!(owned.same_bytes(&x, &z));
    }
}
