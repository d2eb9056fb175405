//! The capture lifecycle on the runtime stream: begin, end (instantiate and upload, or update an executable in place), abort; then launching, re-pointing and patching graphs, and summarizing them.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;
use graft_core::backend::CopyEnds;
use graft_core::{CaptureMode, DeviceError, DeviceOp, DevicePtr, GraphSummary, UpdateRefusal};

use crate::conditional::Finished;
use crate::driver;
use crate::driver::stream::{CAPTURE_INVALIDATED, CAPTURE_NONE};
use crate::error::{INSPECT_OP, invalid_argument};
use crate::graph::{self, CudaGraph};
use crate::inner::Inner;

/// What a launch or update of another device's graph is refused with.
const FOREIGN_GRAPH: &str = "the graph was captured on another device";

impl Inner {
    /// `cuStreamBeginCapture_v2` on the runtime stream with the matching `CUstreamCaptureMode`.
    pub(crate) fn begin_capture(&self, mode: CaptureMode) -> Result<(), DeviceError> {
        let op = DeviceOp::BeginCapture;
        self.enter(op)?;
        if self.capture_status(op)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "a capture is already underway on the runtime stream",
            });
        }
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // The runtime stream is not capturing (checked above).
        driver::stream::begin_capture(op, self.stream, mode)?;
        self.conditionals.reset(mode);
        Ok(())
    }

    /// `cuStreamEndCapture`, `cuGraphInstantiateWithFlags` (flags 0) and `cuGraphUpload` on the
    /// runtime stream. If the end fails (an invalidated capture, unjoined work), the partial
    /// graph is destroyed and the error returned with `EndCapture`; the stream is left out of
    /// capture mode either way, so core must not call `abort_capture` after a failed
    /// `end_capture` (it would answer `CaptureState`).
    pub(crate) fn end_capture(self: &Arc<Self>) -> Result<CudaGraph, DeviceError> {
        let (graph, bodies) = self.end_stream_capture()?;
        self.instantiate(graph, bodies)
    }

    /// `cuStreamEndCapture` only: a graph to compare, with no executable until
    /// [`Inner::prepare_launch`].
    pub(crate) fn end_capture_to_compare(self: &Arc<Self>) -> Result<CudaGraph, DeviceError> {
        let (graph, bodies) = self.end_stream_capture()?;
        Ok(CudaGraph::new(
            Arc::clone(self),
            graph,
            ptr::null_mut(),
            bodies,
        ))
    }

    /// Instantiates (flags 0) and uploads the graph of a [`Inner::end_capture_to_compare`]
    /// capture; nothing for a graph that has its executable. On failure the graph keeps none.
    pub(crate) fn prepare_launch(
        self: &Arc<Self>,
        graph: &mut CudaGraph,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::Instantiate;
        self.enter_own(op, graph)?;
        let h = graph.handles_mut();
        if !h.exec.is_null() {
            return Ok(());
        }
        h.exec = self.executable(h.graph)?;
        Ok(())
    }

    /// Instantiates (flags 0) and uploads `graph` (the caller keeps it): its executable, or
    /// the error with nothing left behind.
    fn executable(&self, graph: sys::CUgraph) -> Result<sys::CUgraphExec, DeviceError> {
        let exec = driver::graph::instantiate(DeviceOp::Instantiate, graph)?;
        if let Err(err) = driver::graph::upload(DeviceOp::Upload, exec, self.stream) {
            self.sticky_on_error(driver::graph::destroy_exec(DeviceOp::GraphDestroy, exec));
            return Err(err);
        }
        Ok(exec)
    }

    /// Ends the capture, then `cuGraphExecUpdate`s `target`'s executable with it; when the
    /// driver refuses, instantiates the capture into `target` instead.
    pub(crate) fn end_capture_into(
        self: &Arc<Self>,
        target: &mut CudaGraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        let (graph, bodies) = self.end_stream_capture()?;
        if bodies.any || target.lock().bodies.any {
            // Conditional nodes (and the memory their bodies own) are not updated in place.
            *target = self.instantiate(graph, bodies)?;
            return Ok(Some(UpdateRefusal::NotSupported));
        }
        match target.update(graph) {
            Ok(None) => Ok(None),
            Ok(Some(refusal)) => {
                *target = self.instantiate(graph, bodies)?;
                Ok(Some(refusal))
            }
            Err(err) => {
                self.destroy_orphan(graph, ptr::null_mut());
                Err(err)
            }
        }
    }

    /// If the runtime stream is capturing (active or invalidated), ends the capture and destroys
    /// whatever graph comes back, ignoring the capture errors the end reports (that is what
    /// aborting a broken capture means), and returns whether the capture had been invalidated
    /// (`CU_STREAM_CAPTURE_STATUS_INVALIDATED`). Errors with `CaptureState` if no capture is
    /// underway.
    ///
    /// The driver API keeps no per-thread "last error" (that is the runtime API's
    /// `cudaGetLastError`), and capture violations are not sticky context errors, so once the
    /// capture has ended there is no error state left to clear: the stream is usable eagerly.
    pub(crate) fn abort_capture(&self) -> Result<bool, DeviceError> {
        let op = DeviceOp::EndCapture;
        self.enter(op)?;
        let open = !self.conditionals.lock().open_is_empty();
        if open && !self.stream_capturing(DeviceOp::Conditional) {
            // Failed between a body's capture and the next: nothing runs on the stream.
            self.conditionals.discard(&self.context);
            return Ok(false);
        }
        self.enter_capture(op)?;
        let invalidated = self.capture_status(op)? == CAPTURE_INVALIDATED;
        self.conditionals.discard(&self.context);
        self.end_and_discard(op)?;
        if self.capture_status(op)? != CAPTURE_NONE {
            return Err(DeviceError::CaptureState {
                op,
                state: "the capture could not be ended",
            });
        }
        Ok(invalidated)
    }

    /// `cuStreamEndCapture` on the runtime stream: the captured graph. If the end fails (an
    /// invalidated capture, unjoined work), the partial graph is destroyed and the error
    /// returned; the stream is out of capture mode either way.
    fn end_stream_capture(&self) -> Result<(sys::CUgraph, Finished), DeviceError> {
        let op = DeviceOp::EndCapture;
        self.enter_capture(op)?;
        if !self.conditionals.lock().open_is_empty() {
            return Err(DeviceError::CaptureState {
                op,
                state: "a conditional node is still open",
            });
        }
        let bodies = self.conditionals.lock().take_finished();
        // The runtime stream is capturing (checked above), begun by this thread.
        let (graph, ended) = driver::stream::end_capture(op, self.stream);
        if let Err(err) = ended {
            self.destroy_orphan(graph, ptr::null_mut());
            // CUDA ends the capture even when it reports an error; make sure of it.
            if self.stream_capturing(op) {
                let _ = self.end_and_discard(op);
            }
            self.free_scratch(bodies.scratch);
            return Err(err);
        }
        Ok((graph, bodies))
    }

    /// Instantiates (flags 0) and uploads `graph`, taking ownership of it: on failure it is
    /// destroyed.
    fn instantiate(
        self: &Arc<Self>,
        graph: sys::CUgraph,
        bodies: Finished,
    ) -> Result<CudaGraph, DeviceError> {
        match self.executable(graph) {
            Ok(exec) => Ok(CudaGraph::new(Arc::clone(self), graph, exec, bodies)),
            Err(err) => {
                self.destroy_orphan(graph, ptr::null_mut());
                self.free_scratch(bodies.scratch);
                Err(err)
            }
        }
    }

    /// Enters `op` and checks that `graph` was captured on this device.
    fn enter_own(self: &Arc<Self>, op: DeviceOp, graph: &CudaGraph) -> Result<(), DeviceError> {
        self.enter(op)?;
        if !Arc::ptr_eq(&graph.device, self) {
            return Err(invalid_argument(op, FOREIGN_GRAPH));
        }
        Ok(())
    }

    /// `cuGraphLaunch` on the runtime stream.
    pub(crate) fn launch(self: &Arc<Self>, graph: &CudaGraph) -> Result<(), DeviceError> {
        let op = DeviceOp::GraphLaunch;
        self.enter_own(op, graph)?;
        let handles = graph.lock();
        // `exec` is the live executable of `graph` (destroyed only when the graph is dropped,
        // impossible while borrowed; checked non-null), instantiated in this device's context,
        // and its use is serialized by the graph's lock.
        driver::graph::launch(op, handles.exec(op)?, self.stream)
    }

    /// `cuGraphExecMemcpyNodeSetParams` on the copy node writing `dst` (found once, cached).
    pub(crate) fn repoint_copy(
        self: &Arc<Self>,
        graph: &mut CudaGraph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        self.enter_own(DeviceOp::GraphUpdate, graph)?;
        graph.repoint_copy(self.ctx, recorded, now)
    }

    /// Patches the executable's kernel nodes (see the `patch` module).
    pub(crate) fn redirect(
        self: &Arc<Self>,
        graph: &mut CudaGraph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        self.enter_own(DeviceOp::GraphUpdate, graph)?;
        graph.redirect(from, len, copy, to)
    }

    /// `cuGraphGetNodes` and `cuGraphNodeGetType` over the captured graph.
    pub(crate) fn summarize(&self, graph: &CudaGraph) -> Result<GraphSummary, DeviceError> {
        self.enter(INSPECT_OP)?;
        let handles = graph.lock();
        let mut summary = graph::summarize(INSPECT_OP, handles.graph)?;
        summary.host_random += handles.bodies.host_random;
        Ok(summary)
    }
}
