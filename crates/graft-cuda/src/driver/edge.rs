//! A graph's edges and their data: a node's dependencies with each edge's type, adding edges with theirs, and counting a graph's programmatic edges (a kernel launched as a programmatic dependent of the kernel before it).

use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::error::{check, invalid_argument};

/// A node's dependencies with each edge's data (`cuGraphNodeGetDependencies_v2`): a
/// programmatic edge (from a kernel to a kernel launched with programmatic dependent launch)
/// has type `CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`, every other edge default (zero) data.
pub(crate) fn dependencies(
    op: DeviceOp,
    node: sys::CUgraphNode,
) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>, DeviceError> {
    let get = |out: *mut sys::CUgraphNode, data: *mut sys::CUgraphEdgeData, n: &mut usize| {
        // SAFETY: `node` is a live node; `out` and `data` are both null (count only) or both
        // have room for `n` entries.
        unsafe { sys::cuGraphNodeGetDependencies_v2(node, out, data, n) }
    };
    let mut count = 0usize;
    check(op, get(ptr::null_mut(), ptr::null_mut(), &mut count))?;
    let mut out = vec![ptr::null_mut(); count];
    let mut data = vec![DEFAULT_EDGE; count];
    if count > 0 {
        let mut filled = count;
        check(op, get(out.as_mut_ptr(), data.as_mut_ptr(), &mut filled))?;
        out.truncate(filled.min(count));
    }
    Ok(out.into_iter().zip(data).collect())
}

/// A full edge's data: the dependent starts after its dependency ends.
pub(crate) const DEFAULT_EDGE: sys::CUgraphEdgeData = sys::CUgraphEdgeData {
    from_port: 0,
    to_port: 0,
    type_: 0,
    reserved: [0; 5],
};

/// Whether an edge's data makes it programmatic (its dependent may start before it ends).
pub(crate) fn is_programmatic(edge: &sys::CUgraphEdgeData) -> bool {
    edge.type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8
}

/// Adds the edges `from[i] -> to` of `graph` with data `data[i]` (`cuGraphAddDependencies_v2`).
pub(crate) fn add_dependencies(
    op: DeviceOp,
    graph: sys::CUgraph,
    from: &[sys::CUgraphNode],
    to: sys::CUgraphNode,
    data: &[sys::CUgraphEdgeData],
) -> Result<(), DeviceError> {
    if from.len() != data.len() {
        return Err(invalid_argument(op, "one edge datum per dependency"));
    }
    if from.is_empty() {
        return Ok(());
    }
    let to = vec![to; from.len()];
    // SAFETY: `graph` is live and owns `to` and every node of `from`; the three arrays hold
    // `from.len()` entries each and live for the call.
    check(op, unsafe {
        sys::cuGraphAddDependencies_v2(graph, from.as_ptr(), to.as_ptr(), data.as_ptr(), from.len())
    })
}

/// The number of programmatic edges of `graph` (`cuGraphGetEdges_v2`, its top level).
pub(crate) fn programmatic_edges(op: DeviceOp, graph: sys::CUgraph) -> Result<usize, DeviceError> {
    let get = |from: *mut sys::CUgraphNode,
               to: *mut sys::CUgraphNode,
               data: *mut sys::CUgraphEdgeData,
               n: &mut usize| {
        // SAFETY: `graph` is live; the three arrays are all null (count only) or all have
        // room for `n` entries.
        unsafe { sys::cuGraphGetEdges_v2(graph, from, to, data, n) }
    };
    let mut count = 0usize;
    check(
        op,
        get(
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
            &mut count,
        ),
    )?;
    if count == 0 {
        return Ok(0);
    }
    let mut from = vec![ptr::null_mut(); count];
    let mut to = vec![ptr::null_mut(); count];
    let mut data = vec![DEFAULT_EDGE; count];
    let mut filled = count;
    check(
        op,
        get(
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut filled,
        ),
    )?;
    Ok(data[..filled.min(count)]
        .iter()
        .filter(|e| is_programmatic(e))
        .count())
}
