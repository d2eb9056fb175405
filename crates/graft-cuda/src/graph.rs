//! [`CudaGraph`]: a captured graph and its instantiated, uploaded executable.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys;
use graft_core::backend::CopyEnds;
use graft_core::{DeviceError, DeviceOp, DevicePtr, UpdateRefusal};

use crate::conditional::Finished;
use crate::driver::graph::{self as dg, kernel_name, node_type, nodes};
use crate::inner::Inner;
use crate::patch::{Graphs, Patches};

/// The raw graph handles. Only touched under [`CudaGraph`]'s mutex, or through `&mut` in drop.
pub(crate) struct GraphHandles {
    /// The captured graph, kept for `cuGraphGetNodes` (summaries).
    pub(crate) graph: sys::CUgraph,
    /// Its instantiated executable.
    pub(crate) exec: sys::CUgraphExec,
    /// The capture the executable was last updated with (`cuGraphExecUpdate`), or null when
    /// it runs `graph` as instantiated. Node handles stay `graph`'s (the driver names an
    /// executable's nodes by the graph it was instantiated from); their current parameters
    /// are this graph's nodes', paired in creation order.
    updated_from: sys::CUgraph,
    /// Copy-free inputs patched into the executable.
    pub(crate) patches: Patches,
    /// Copy nodes re-pointed so far, with their current parameters (the executable's, which
    /// the captured graph's nodes no longer show). Found on first use by scanning the graph,
    /// then updated in place.
    copies: Vec<(sys::CUgraphNode, sys::CUDA_MEMCPY3D)>,
    /// What its conditional bodies left: the memory their allocations moved to (freed with
    /// the graph) and their host-side random kernels (see `crate::relocate`).
    pub(crate) bodies: Finished,
}

// SAFETY: CUDA graph handles are plain driver handles, usable from any thread while their
// context is current (every user makes it current first). CUDA requires calls on one graph to
// be serialized; `CudaGraph` only reaches the handles through its `Mutex` (or `&mut self` in
// `Drop`), so moving them between threads is sound.
unsafe impl Send for GraphHandles {}

/// An instantiated, uploaded CUDA graph: the `Device::Graph` of [`crate::CudaDevice`] (one
/// ended to be compared has no executable until `Device::prepare_launch`).
///
/// It keeps both the `CUgraph` (for [`graft_core::Device::summarize`]) and the `CUgraphExec`
/// (for launches), and an `Arc` to its device so that the context, stream and sticky error slot
/// outlive it. Dropping it destroys both handles; a failure there goes to the device's sticky
/// error slot. Dropping while a launch is in flight is fine: CUDA frees an executing graph when
/// it completes.
pub struct CudaGraph {
    handles: Mutex<GraphHandles>,
    pub(crate) device: Arc<Inner>,
}

impl CudaGraph {
    /// Takes ownership of `graph` and `exec`, both created in `device`'s context.
    pub(crate) fn new(
        device: Arc<Inner>,
        graph: sys::CUgraph,
        exec: sys::CUgraphExec,
        bodies: Finished,
    ) -> Self {
        CudaGraph {
            handles: Mutex::new(GraphHandles {
                graph,
                exec,
                updated_from: std::ptr::null_mut(),
                patches: Default::default(),
                copies: Vec::new(),
                bodies,
            }),
            device,
        }
    }

    /// The handles, serialized as CUDA's graph thread-safety rules require.
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, GraphHandles> {
        self.handles.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The handles, through `&mut self` (no other user).
    pub(crate) fn handles_mut(&mut self) -> &mut GraphHandles {
        self.handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl GraphHandles {
    /// The executable, or an error for a graph ended to be compared and never prepared to
    /// launch (`graft_core::Device::prepare_launch`).
    #[inline]
    pub(crate) fn exec(&self, op: DeviceOp) -> Result<sys::CUgraphExec, DeviceError> {
        if self.exec.is_null() {
            return Err(DeviceError::InvalidArgument {
                op,
                what: "the graph was ended to be compared and never prepared to launch (Device::prepare_launch)",
            });
        }
        Ok(self.exec)
    }
}

impl CudaGraph {
    /// Updates the executable in place to run `captured` (`cuGraphExecUpdate`), taking
    /// ownership of `captured` on success. Returns the driver's refusal (then `captured` is
    /// still the caller's and the executable unchanged).
    pub(crate) fn update(
        &mut self,
        captured: sys::CUgraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        let op = DeviceOp::GraphUpdate;
        let h = self
            .handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        // `exec` is this graph's live executable (destroyed only in Drop, impossible while
        // `&mut self` is held) and `captured` a live graph of the same context, just returned
        // by cuStreamEndCapture on this thread, whose context is current.
        match dg::update_exec(op, h.exec(op)?, captured)? {
            None => {
                let previous = std::mem::replace(&mut h.updated_from, captured);
                destroy_graph(&self.device, previous);
                // The copies' parameters are now the new capture's, and its kernels read
                // what it captured: no input is patched, every copy runs.
                h.copies.clear();
                for copy in h.patches.take_active() {
                    // A memcpy node of the graph `exec` was instantiated from, turned off by a
                    // redirect.
                    dg::set_node_enabled(op, h.exec, copy, true)?;
                }
                Ok(None)
            }
            Some(code) => Ok(Some(refusal(code))),
        }
    }

    /// Re-points the copy node with ends `recorded` to the ends `now` in the executable (see
    /// `graft_core::Device::repoint_copy`). `ctx` is the device's context, current.
    pub(crate) fn repoint_copy(
        &mut self,
        ctx: sys::CUcontext,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::GraphUpdate;
        let h = self
            .handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let index = h.copy_index(recorded)?;
        let (node, kept) = h.copies[index];
        let mut params = kept;
        params.dstDevice = now.dst.0;
        params.srcDevice = now.src.0;
        // `exec` is the live executable instantiated from `graph` (both destroyed only in
        // Drop, impossible while `&mut self` is held); `node` is a memcpy node of `graph`,
        // found by `find_copy`; `params` is the node's own 1-D device-to-device parameter
        // block read from the driver, with only the two addresses changed; `ctx` is the
        // context both were created in, current on this thread.
        dg::set_exec_memcpy_params(op, h.exec(op)?, node, &params, ctx)?;
        // Only a copy the driver re-pointed changes what the table says it writes: a refused
        // one keeps writing its old ends (graft copies after the launch instead), and a
        // guard's comparison reads them here.
        h.copies[index].1 = params;
        Ok(())
    }
}

impl CudaGraph {
    /// Copy-free and in-place inputs (see `graft_core::Device::redirect` and
    /// [`crate::patch`]).
    pub(crate) fn redirect(
        &mut self,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        let h = self
            .handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let copy_node = match copy {
            Some(ends) => {
                let index = h.copy_index(ends)?;
                Some(h.copies[index].0)
            }
            None => None,
        };
        let graphs = Graphs {
            exec: h.exec(DeviceOp::GraphUpdate)?,
            graph: h.graph,
            current: h.current_graph(),
        };
        crate::patch::redirect(&mut h.patches, graphs, from, len, copy_node, to)
    }
}

impl GraphHandles {
    /// The index in `copies` of the copy node with these ends (current ones), found in the
    /// graph on first use.
    fn copy_index(&mut self, ends: CopyEnds) -> Result<usize, DeviceError> {
        if let Some(i) = self.copies.iter().position(|(_, p)| has_ends(p, ends)) {
            return Ok(i);
        }
        let found = find_copy(
            DeviceOp::GraphUpdate,
            self.graph,
            self.current_graph(),
            ends,
            &self.copies,
        )?;
        self.copies.push(found);
        Ok(self.copies.len() - 1)
    }

    /// The current parameters of copy node `node` (of `graph`), when it was re-pointed (the
    /// captured node no longer shows them).
    pub(crate) fn copy_params(&self, node: sys::CUgraphNode) -> Option<sys::CUDA_MEMCPY3D> {
        self.copies
            .iter()
            .find(|(n, _)| *n == node)
            .map(|(_, p)| *p)
    }

    /// The graph whose nodes hold the executable's current parameters.
    pub(crate) fn current_graph(&self) -> sys::CUgraph {
        if self.updated_from.is_null() {
            self.graph
        } else {
            self.updated_from
        }
    }
}

/// Whether a copy's parameters have these ends.
fn has_ends(params: &sys::CUDA_MEMCPY3D, ends: CopyEnds) -> bool {
    params.dstDevice == ends.dst.0 && params.srcDevice == ends.src.0
}

/// Finds the memcpy node of `graph` with these ends as captured in `current` (the graph whose
/// nodes hold the executable's parameters: `graph`, or the capture it was last updated
/// with), with its parameters, skipping nodes already re-pointed (`known`: their captured
/// ends are stale).
fn find_copy(
    op: DeviceOp,
    graph: sys::CUgraph,
    current: sys::CUgraph,
    ends: CopyEnds,
    known: &[(sys::CUgraphNode, sys::CUDA_MEMCPY3D)],
) -> Result<(sys::CUgraphNode, sys::CUDA_MEMCPY3D), DeviceError> {
    // An update requires the same nodes in the same creation order, which is the order
    // cuGraphGetNodes lists them in: the lists pair up.
    for (node, source) in nodes(op, graph)?.into_iter().zip(nodes(op, current)?) {
        if known.iter().any(|(n, _)| *n == node)
            || node_type(op, source)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32
        {
            continue;
        }
        // A memcpy node of a live graph (type checked above).
        let params = dg::memcpy_params(op, source)?;
        if has_ends(&params, ends) {
            return Ok((node, params));
        }
    }
    Err(DeviceError::InvalidArgument {
        op,
        what: "the graph has no copy with the recorded ends",
    })
}

impl fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = self.lock();
        f.debug_struct("CudaGraph")
            .field("device", &self.device.id)
            .field("graph", &h.graph)
            .field("exec", &h.exec)
            .finish()
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let h = self
            .handles
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let device = &self.device;
        device.sticky_on_error(device.make_current(DeviceOp::GraphDestroy));
        // `exec` came from cuGraphInstantiateWithFlags in end_capture, is owned by this graph
        // alone, and is destroyed exactly once (swapped out). CUDA defers the release of an
        // executable still running until it completes.
        let exec = std::mem::replace(&mut h.exec, std::ptr::null_mut());
        device.sticky_on_error(dg::destroy_exec(DeviceOp::GraphDestroy, exec));
        // The executable is gone (the driver defers it past running launches, and cuMemFree
        // waits for the device): its bodies' memory can go.
        device.free_scratch(std::mem::take(&mut h.bodies.scratch));
        destroy_graph(
            device,
            std::mem::replace(&mut h.updated_from, std::ptr::null_mut()),
        );
        // `graph` came from cuStreamEndCapture in end_capture, is owned by this graph alone,
        // and is destroyed exactly once (swapped out); its executable no longer depends on it.
        destroy_graph(
            device,
            std::mem::replace(&mut h.graph, std::ptr::null_mut()),
        );
    }
}

/// Destroys a captured graph owned by the caller alone (null: nothing); a failure goes to the
/// sticky slot.
fn destroy_graph(device: &Inner, graph: sys::CUgraph) {
    device.sticky_on_error(dg::destroy(DeviceOp::GraphDestroy, graph));
}

/// The refusal for a `CUgraphExecUpdateResult` code.
fn refusal(code: u32) -> UpdateRefusal {
    use sys::CUgraphExecUpdateResult as R;
    match code {
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED as u32 => {
            UpdateRefusal::TopologyChanged
        }
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED as u32 => {
            UpdateRefusal::NodeTypeChanged
        }
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED as u32
            || c == R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE as u32 =>
        {
            UpdateRefusal::FunctionChanged
        }
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED as u32 => {
            UpdateRefusal::ParametersChanged
        }
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED as u32 => UpdateRefusal::NotSupported,
        c if c == R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED as u32 => {
            UpdateRefusal::AttributesChanged
        }
        _ => UpdateRefusal::Other,
    }
}

/// Counting helper for `summarize`, kept here with the other graph-handle code. Kernels of
/// cuRAND's host-API generators (their names hold their state types, `curandState...`) are
/// counted as host-side random kernels, at the top level and inside child graphs.
pub(crate) fn summarize(
    op: DeviceOp,
    graph: sys::CUgraph,
) -> Result<graft_core::GraphSummary, DeviceError> {
    let mut summary = graft_core::GraphSummary::default();
    for node in nodes(op, graph)? {
        match node_type(op, node)? {
            k if k == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                summary.kernels += 1;
                if kernel_name(node).is_some_and(|n| n.to_ascii_lowercase().contains("curand")) {
                    summary.host_random += 1;
                }
            }
            k if k == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL as u32 => {
                summary.conditionals += 1
            }
            k if k == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_GRAPH as u32 => {
                summary.other += 1;
                let child = dg::child_graph(op, node)?;
                summary.host_random += summarize(op, child)?.host_random;
            }
            k if k == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32 => summary.copies += 1,
            k if k == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET as u32 => {
                summary.memsets += 1
            }
            _ => summary.other += 1,
        }
    }
    if crate::programmatic::supported() {
        summary.programmatic_edges = crate::driver::edge::programmatic_edges(op, graph)?;
    }
    Ok(summary)
}
