//! `SimDevice`'s implementation of [`graft_core::Device`]: memory mapping, capture (with
//! conditional nodes), graph instantiation, update and launch, and the sticky error slot.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use graft_core::backend::{CopyEnds, CoreOnly};
use graft_core::{
    CaptureMode, CaptureViolation, Conditional, ConditionalRule, Device, DeviceError, DeviceId,
    DeviceOp, DevicePtr, GraphDifference, GraphSummary, UpdateRefusal,
};

use crate::device::SimDevice;
use crate::graph::SimGraph;
use crate::memory::GRANULARITY;
use crate::ops::{self, Op, Tally};
use crate::queue::SimQueue;
use crate::state::{
    CAPTURE_INVALIDATED, CAPTURE_UNDERWAY, Capture, FOREIGN_GRAPH, NO_CAPTURE, NO_CONDITIONAL,
    NOT_PREPARED, OpenConditional, StreamGuard, invalidated,
};

impl Device for SimDevice {
    type Graph = SimGraph;
    type Queue = SimQueue;

    fn queue(&self) -> &SimQueue {
        &self.queue
    }

    fn side_queue(&self) -> Option<&SimQueue> {
        Some(&self.side)
    }

    fn fork(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        self.fork_side()
    }

    fn join(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        self.join_side()
    }

    fn id(&self) -> DeviceId {
        self.queue.inner.id
    }

    fn describe(&self) -> String {
        "host simulator".to_owned()
    }

    fn granularity(&self) -> usize {
        GRANULARITY
    }

    /// Legal in every capture state, like the CUDA backend's relaxed-mode reservation.
    fn reserve(&self, _: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let mut st = self.lock(DeviceOp::Reserve)?;
        let ptr = st.mem.reserve(DeviceOp::Reserve, bytes)?;
        self.queue
            .inner
            .counters
            .reservations
            .fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    fn release_reservation(
        &self,
        _: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::ReleaseReservation;
        let mut st = self.lock(op)?;
        st.forbid_in_capture(op)?;
        st.mem.release_reservation(op, addr, bytes)?;
        self.queue
            .inner
            .counters
            .reservations
            .fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }

    /// Legal in every capture state: CUDA backends switch to relaxed mode around it.
    fn map(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Map;
        let mut st = self.lock(op)?;
        if self.map_fault_fires() {
            return Err(DeviceError::Injected { op });
        }
        st.mem.map(op, addr, bytes)?;
        let c = &self.queue.inner.counters;
        c.maps.fetch_add(1, Ordering::Relaxed);
        c.mapped_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn unmap(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Unmap;
        let mut st = self.lock(op)?;
        st.forbid_in_capture(op)?;
        st.mem.unmap(op, addr, bytes)?;
        self.queue
            .inner
            .counters
            .mapped_bytes
            .fetch_sub(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn copy(
        &self,
        _: &CoreOnly,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.queue.copy_raw(dst, src, bytes)
    }

    fn write(&self, _: &CoreOnly, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.queue.write_raw(dst, src)
    }

    fn read(&self, _: &CoreOnly, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.queue.read_raw(src, dst)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.queue.synchronize()
    }

    fn begin_capture(&self, _: &CoreOnly, mode: CaptureMode) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::BeginCapture)?;
        let state = match st.capture {
            Capture::Idle if st.fork.is_some() => "a fork of the side stream is open",
            Capture::Idle => {
                st.capture = Capture::Recording {
                    mode,
                    ops: Vec::new(),
                    unjoined: false,
                    open: Vec::new(),
                };
                return Ok(());
            }
            Capture::Recording { .. } => CAPTURE_UNDERWAY,
            Capture::Invalidated { .. } => CAPTURE_INVALIDATED,
        };
        Err(DeviceError::CaptureState {
            op: DeviceOp::BeginCapture,
            state,
        })
    }

    fn end_capture(&self, core: &CoreOnly) -> Result<SimGraph, DeviceError> {
        let mut graph = self.end_capture_to_compare(core)?;
        self.prepare_launch(core, &mut graph)?;
        Ok(graph)
    }

    fn end_capture_to_compare(&self, _: &CoreOnly) -> Result<SimGraph, DeviceError> {
        let mut st = self.lock(DeviceOp::EndCapture)?;
        // Like cudaStreamEndCapture, ending leaves the stream idle whether or not it succeeds.
        let forked = !matches!(st.capture, Capture::Idle) && st.fork.take().is_some();
        let ops = match std::mem::replace(&mut st.capture, Capture::Idle) {
            Capture::Idle => {
                return Err(DeviceError::CaptureState {
                    op: DeviceOp::EndCapture,
                    state: NO_CAPTURE,
                });
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::EndCapture)),
            Capture::Recording { .. } if forked => {
                return Err(DeviceError::Capture {
                    op: DeviceOp::EndCapture,
                    violation: CaptureViolation::Unjoined,
                });
            }
            Capture::Recording { unjoined: true, .. } => {
                return Err(DeviceError::Capture {
                    op: DeviceOp::EndCapture,
                    violation: CaptureViolation::Unjoined,
                });
            }
            Capture::Recording { open, .. } if !open.is_empty() => {
                return Err(DeviceError::CaptureState {
                    op: DeviceOp::EndCapture,
                    state: "a conditional node is still open",
                });
            }
            Capture::Recording { ops, .. } => ops,
        };
        drop(st);
        let ops: Arc<[Op]> = ops.into();
        let summary = ops::summarize(&ops);
        self.queue
            .inner
            .counters
            .live_graphs
            .fetch_add(1, Ordering::Relaxed);
        Ok(SimGraph {
            ops,
            redirects: Vec::new(),
            disabled: Vec::new(),
            summary,
            owner: Arc::clone(&self.queue.inner),
            launchable: false,
        })
    }

    fn prepare_launch(&self, _: &CoreOnly, graph: &mut SimGraph) -> Result<(), DeviceError> {
        if graph.launchable {
            return Ok(());
        }
        if self
            .queue
            .inner
            .faults
            .instantiate
            .swap(false, Ordering::Relaxed)
        {
            return Err(DeviceError::Injected {
                op: DeviceOp::Instantiate,
            });
        }
        graph.launchable = true;
        self.queue
            .inner
            .counters
            .instantiations
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Updates in place when the capture has `graph`'s topology (`ops::update_refusal`:
    /// the same operations in the same order, kernels by name, copies by length), as CUDA's
    /// `cuGraphExecUpdate` does; else instantiates.
    fn end_capture_into(
        &self,
        core: &CoreOnly,
        graph: &mut SimGraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        let new = self.end_capture(core)?;
        match ops::update_refusal(&graph.ops, &new.ops) {
            None => {
                graph.ops = Arc::clone(&new.ops);
                graph.redirects.clear();
                graph.disabled.clear();
                Ok(None)
            }
            Some(refusal) => {
                *graph = new;
                Ok(Some(refusal))
            }
        }
    }

    fn supports_conditionals(&self) -> bool {
        !self
            .queue
            .inner
            .faults
            .no_conditionals
            .load(Ordering::Relaxed)
    }

    fn begin_conditional(
        &self,
        _: &CoreOnly,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        if !self.supports_conditionals() {
            return Err(DeviceError::Unavailable {
                op,
                what: "this simulated driver has no conditional graph nodes (as before CUDA 12.4); loop on the host instead",
            });
        }
        // CUDA's rule as graft-cuda meets it: a body is captured as a graph of its own and
        // copied into its node, which a conditional node cannot be.
        self.refuse_in_conditional(op, ConditionalRule::Nested)?;
        let mut st = self.lock(op)?;
        if st.fork.is_some() {
            if let Capture::Recording { mode, .. } = st.capture {
                st.capture = Capture::Invalidated { mode };
            }
            return Err(DeviceError::Fork {
                op,
                rule: graft_core::ForkRule::InConditional,
            });
        }
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                open.push(OpenConditional {
                    kind,
                    selector,
                    done: Vec::new(),
                    before: std::mem::take(ops),
                });
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn next_branch(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        let mut st = self.lock(op)?;
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                let Some(node) = open.last_mut() else {
                    return Err(DeviceError::CaptureState {
                        op,
                        state: NO_CONDITIONAL,
                    });
                };
                if node.done.len() + 1 >= node.kind.branches() {
                    return Err(DeviceError::InvalidArgument {
                        op,
                        what: "the conditional node has no further body",
                    });
                }
                node.done.push(std::mem::take(ops).into());
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn end_conditional(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        let mut st = self.lock(op)?;
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                let Some(mut node) = open.pop() else {
                    return Err(DeviceError::CaptureState {
                        op,
                        state: NO_CONDITIONAL,
                    });
                };
                node.done.push(std::mem::take(ops).into());
                if node.done.len() != node.kind.branches() {
                    open.push(node);
                    return Err(DeviceError::InvalidArgument {
                        op,
                        what: "the conditional node was closed before its last body",
                    });
                }
                *ops = node.before;
                ops.push(Op::Conditional {
                    kind: node.kind,
                    selector: node.selector,
                    bodies: node.done.into(),
                });
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn abort_capture(&self, _: &CoreOnly) -> Result<bool, DeviceError> {
        let mut st = self.lock(DeviceOp::EndCapture)?;
        if matches!(
            st.capture,
            Capture::Recording { .. } | Capture::Invalidated { .. }
        ) {
            st.fork = None;
        }
        match std::mem::replace(&mut st.capture, Capture::Idle) {
            Capture::Idle => Err(DeviceError::CaptureState {
                op: DeviceOp::EndCapture,
                state: NO_CAPTURE,
            }),
            Capture::Recording { .. } => Ok(false),
            Capture::Invalidated { .. } => Ok(true),
        }
    }

    fn launch(&self, _: &CoreOnly, graph: &SimGraph) -> Result<(), DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphLaunch,
                what: FOREIGN_GRAPH,
            });
        }
        if !graph.launchable {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphLaunch,
                what: NOT_PREPARED,
            });
        }
        let mut guard = self.lock(DeviceOp::GraphLaunch)?;
        if self
            .queue
            .inner
            .faults
            .launch
            .swap(false, Ordering::Relaxed)
        {
            return Err(DeviceError::Injected {
                op: DeviceOp::GraphLaunch,
            });
        }
        let st = &mut *guard;
        match &mut st.capture {
            Capture::Idle => {}
            Capture::Recording { ops, .. } => {
                ops.push(Op::Child(Arc::clone(&graph.ops)));
                return Ok(());
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::GraphLaunch)),
        }
        let mut tally = Tally::default();
        let result = {
            let _on_stream = StreamGuard::enter();
            st.mem.set_redirects(&graph.redirects);
            // A graph's first kernel starts after the work before the launch; the work after
            // it after its last.
            st.mem.break_chain();
            let ran = ops::run_ops(&mut st.mem, &graph.ops, &graph.disabled, &mut tally);
            st.mem.break_chain();
            st.mem.set_redirects(&[]);
            ran
        };
        let c = &self.queue.inner.counters;
        c.kernels_run.fetch_add(tally.kernels, Ordering::Relaxed);
        c.copies_run.fetch_add(tally.copies, Ordering::Relaxed);
        if result.is_ok() {
            c.graph_launches.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Compares the recorded operations: kernel names, the arguments declared with
    /// [`SimQueue::launch_kernel_with_args`], copies, conditional selectors.
    fn compare(
        &self,
        recorded: &SimGraph,
        now: &SimGraph,
    ) -> Result<Option<Vec<GraphDifference>>, DeviceError> {
        Ok(crate::compare::comparable(&recorded.ops, &now.ops)
            .then(|| crate::compare::compare(&recorded.ops, &now.ops)))
    }

    fn summarize(&self, graph: &SimGraph) -> Result<GraphSummary, DeviceError> {
        Ok(graph.summary)
    }

    /// Redirects exactly (every access inside the range, by kernels and copies, goes to `to`)
    /// where graft-cuda's patcher could on CUDA (`SimGraph::can_redirect`), and refuses where
    /// it could not: the simulator sees every access, but its graphs follow CUDA's rules.
    fn redirect(
        &self,
        _: &CoreOnly,
        graph: &mut SimGraph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: FOREIGN_GRAPH,
            });
        }
        if !graph.launchable {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: NOT_PREPARED,
            });
        }
        if to.is_some() && !graph.can_redirect(from, len, copy) {
            return Ok(false);
        }
        graph.redirect(from, len, copy, to);
        Ok(true)
    }

    fn repoint_copy(
        &self,
        _: &CoreOnly,
        graph: &mut SimGraph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: FOREIGN_GRAPH,
            });
        }
        if !graph.launchable {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: NOT_PREPARED,
            });
        }
        let st = self.lock(DeviceOp::GraphUpdate)?;
        let moves_kind = |a: DevicePtr, b: DevicePtr| st.mem.is_raw(a) != st.mem.is_raw(b);
        if moves_kind(recorded.dst, now.dst) || moves_kind(recorded.src, now.src) {
            // CUDA's `cuGraphExecMemcpyNodeSetParams` refuses operands whose mapping changed.
            return Err(DeviceError::Driver {
                op: DeviceOp::GraphUpdate,
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE",
            });
        }
        drop(st);
        graph.repoint_copy(recorded, now)
    }

    fn take_sticky_error(&self, _: &CoreOnly) -> Option<DeviceError> {
        self.queue.inner.sticky.take()
    }

    fn record_sticky_error(&self, _: &CoreOnly, error: DeviceError) {
        self.queue.inner.sticky.record(error);
    }
}
