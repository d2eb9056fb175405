//! Conditional nodes (CUDA 12.4+ WHILE, IF and SWITCH) inside a capture: opening one where the runtime stream's capture stands, capturing each body as a graph of its own, and resuming the capture after the node.
//!
//! Every conditional node gets a handle, set on the device by one tiny kernel
//! (`graft_set_conditional`, PTX written here: it reads the `u32` selector and calls the
//! device runtime's `cudaGraphSetConditional`) launched right before the node, and for a loop
//! again as the body's last work. The runtime stream stays the one stream of the capture
//! (frameworks such as candle launch on a stream they own): opening a node ends the stream's
//! capture (the graph so far is kept), adds the node after the work captured so far, and
//! begins a fresh capture for the body; closing it ends that capture, checks and cleans the
//! body ([`crate::relocate`]), puts it into the node's body graph as a child graph, and
//! resumes capturing into the outer graph after the node (`cuStreamBeginCaptureToGraph`).

use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::{MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys;
use graft_core::{Conditional, DeviceError, DeviceOp, DevicePtr};

use crate::context::{CAPTURE_NONE, Inner};
use crate::error::{check, invalid_argument};
use crate::graph::destroy_orphan;
use crate::relocate::{self, Body};

const OP: DeviceOp = DeviceOp::Conditional;

/// The driver version (`cuDriverGetVersion`) from which every kind is there: WHILE and IF
/// came with 12.4, IF with an else body and SWITCH with 12.8.
const MIN_DRIVER: c_int = 12080;

/// The kernel that sets a conditional handle from a `u32` in device memory.
const SET_CONDITIONAL_PTX: &CStr = c"
.version 7.8
.target sm_75
.address_size 64

.extern .func cudaGraphSetConditional
(
    .param .b64 cudaGraphSetConditional_param_0,
    .param .b32 cudaGraphSetConditional_param_1
)
;

.visible .entry graft_set_conditional(
    .param .u64 graft_set_conditional_param_0,
    .param .u64 graft_set_conditional_param_1
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<4>;

    ld.param.u64 %rd1, [graft_set_conditional_param_0];
    ld.param.u64 %rd2, [graft_set_conditional_param_1];
    cvta.to.global.u64 %rd3, %rd2;
    ld.global.u32 %r1, [%rd3];
    {
    .param .b64 param0;
    st.param.b64 [param0+0], %rd1;
    .param .b32 param1;
    st.param.b32 [param1+0], %r1;
    call.uni cudaGraphSetConditional, (param0, param1);
    }
    ret;
}
";

/// The loaded `graft_set_conditional` kernel of one device.
pub(crate) struct SetConditional {
    module: sys::CUmodule,
    function: sys::CUfunction,
}

// SAFETY: a module and its function are driver handles usable from any thread once their
// context is current (every use enters the device first); they are unloaded only in
// `Inner::drop`, with exclusive access.
unsafe impl Send for SetConditional {}
// SAFETY: as for `Send`: launching a function is thread-safe in the driver.
unsafe impl Sync for SetConditional {}

/// One open conditional node.
struct Open {
    /// The graph the node is in: the capture's top-level graph, or the graph of the body
    /// that was being captured when the node was opened. Owned here until resumed.
    outer: sys::CUgraph,
    /// The conditional node in `outer`.
    node: sys::CUgraphNode,
    /// Its body graphs (owned by the node).
    bodies: Vec<sys::CUgraph>,
    handle: sys::CUgraphConditionalHandle,
    kind: Conditional,
    selector: u64,
    /// The body being captured.
    branch: usize,
}

/// What a capture's finished conditional nodes leave to its graph.
#[derive(Default, Debug)]
pub(crate) struct Finished {
    /// Whether the capture holds a conditional node (its graph is never updated in place).
    pub(crate) any: bool,
    /// Device memory the bodies' stream-ordered allocations now live in (`cuMemAlloc`),
    /// owned by the graph from its instantiation on.
    pub(crate) scratch: Vec<u64>,
    /// Kernels of a host-side random generator inside the bodies.
    pub(crate) host_random: usize,
}

/// The conditional side of one capture: open nodes, and what the finished ones leave.
#[derive(Default)]
pub(crate) struct ConditionalState {
    /// The mode the capture began with, for each body's capture and each resume.
    mode: Option<sys::CUstreamCaptureMode>,
    open: Vec<Open>,
    finished: Finished,
}

// SAFETY: the graph and node handles are only used under the device's conditional lock,
// from the thread driving the capture (core drives one capture from one thread).
unsafe impl Send for ConditionalState {}

impl ConditionalState {
    /// Whether no conditional node is open.
    pub(crate) fn open_is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// What the finished nodes leave, taken for the graph being instantiated.
    pub(crate) fn take_finished(&mut self) -> Finished {
        std::mem::take(&mut self.finished)
    }
}

impl Inner {
    /// The conditional state, locked.
    pub(crate) fn conditionals(&self) -> MutexGuard<'_, ConditionalState> {
        self.conditional
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the driver has every kind of conditional node (CUDA 12.8 or later).
    pub(crate) fn supports_conditionals(&self) -> bool {
        static VERSION: OnceLock<c_int> = OnceLock::new();
        let version = *VERSION.get_or_init(|| {
            let mut v: c_int = 0;
            // SAFETY: `v` is a valid out-pointer; the driver is loaded (a device is open).
            let r = unsafe { sys::cuDriverGetVersion(&mut v) };
            if r == sys::CUresult::CUDA_SUCCESS {
                v
            } else {
                0
            }
        });
        version >= MIN_DRIVER
    }

    /// Starts a capture's conditional state (at `begin_capture`).
    pub(crate) fn reset_conditionals(&self, mode: sys::CUstreamCaptureMode) {
        *self.conditionals() = ConditionalState {
            mode: Some(mode),
            ..Default::default()
        };
    }

    /// Loads the set-conditional kernel once.
    fn set_conditional_kernel(&self) -> Result<sys::CUfunction, DeviceError> {
        if let Some(k) = self.set_conditional.get() {
            return Ok(k.function);
        }
        let op = DeviceOp::ModuleLoad;
        let loaded = self.with_relaxed(op, || {
            let mut module: sys::CUmodule = ptr::null_mut();
            // SAFETY: the context is current; the image is a NUL-terminated PTX string that
            // outlives the call; `module` is a valid out-pointer.
            check(op, unsafe {
                sys::cuModuleLoadData(&mut module, SET_CONDITIONAL_PTX.as_ptr().cast())
            })?;
            let mut function: sys::CUfunction = ptr::null_mut();
            // SAFETY: `module` was just loaded; the name is NUL-terminated; `function` is a
            // valid out-pointer.
            let got = check(op, unsafe {
                sys::cuModuleGetFunction(&mut function, module, c"graft_set_conditional".as_ptr())
            });
            if let Err(e) = got {
                // SAFETY: `module` was loaded above and is unloaded once, here.
                let _ = unsafe { sys::cuModuleUnload(module) };
                return Err(e);
            }
            Ok(SetConditional { module, function })
        })?;
        let function = loaded.function;
        if let Err(extra) = self.set_conditional.set(loaded) {
            // SAFETY: this module lost the race, was never shared, and is unloaded once.
            let _ = unsafe { sys::cuModuleUnload(extra.module) };
            return Ok(self.set_conditional.get().map_or(function, |k| k.function));
        }
        Ok(function)
    }

    /// Enqueues `graft_set_conditional(handle, selector)` on the runtime stream (captured).
    fn launch_set_conditional(
        &self,
        handle: sys::CUgraphConditionalHandle,
        selector: u64,
    ) -> Result<(), DeviceError> {
        let function = self.set_conditional_kernel()?;
        let (mut h, mut s) = (handle, selector);
        let mut args = [(&raw mut h).cast::<c_void>(), (&raw mut s).cast::<c_void>()];
        // SAFETY: `function` takes two 8-byte parameters (the PTX above); `args` points at one
        // pointer per parameter, each to a live 8-byte value, for the call's duration; one
        // thread of one block; the runtime stream is live.
        check(DeviceOp::KernelLaunch, unsafe {
            sys::cuLaunchKernel(
                function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                self.stream,
                args.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// The graph the runtime stream is capturing into and the capture's current dependencies
    /// (the nodes the next work would follow); an invalidated capture is an error.
    fn capture_info(&self) -> Result<(sys::CUgraph, Vec<sys::CUgraphNode>), DeviceError> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        let mut graph: sys::CUgraph = ptr::null_mut();
        let mut deps: *const sys::CUgraphNode = ptr::null();
        let mut count: usize = 0;
        // SAFETY: the runtime stream is live; every out-pointer is valid; edge data is not
        // asked for (null).
        check(OP, unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.stream,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                ptr::null_mut(),
                &mut count,
            )
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return Err(DeviceError::Capture {
                op: OP,
                violation: graft_core::CaptureViolation::Invalidated,
            });
        }
        let deps: Vec<sys::CUgraphNode> = if count == 0 || deps.is_null() {
            Vec::new()
        } else {
            // SAFETY: the driver returned `count` node handles at `deps`, valid until the
            // next call on the stream; they are copied out at once.
            unsafe { std::slice::from_raw_parts(deps, count) }.to_vec()
        };
        Ok((graph, deps))
    }

    /// Ends the runtime stream's capture and returns its graph, with the capture's current
    /// dependencies.
    fn suspend(&self) -> Result<(sys::CUgraph, Vec<sys::CUgraphNode>), DeviceError> {
        let (_, deps) = self.capture_info()?;
        let mut ended: sys::CUgraph = ptr::null_mut();
        // SAFETY: the stream is capturing (checked above), begun on this thread.
        check(OP, unsafe {
            sys::cuStreamEndCapture(self.stream, &mut ended)
        })?;
        Ok((ended, deps))
    }

    /// Begins capturing into `graph` after `deps` (none: a fresh graph of its own).
    fn capture_into(
        &self,
        graph: Option<sys::CUgraph>,
        deps: &[sys::CUgraphNode],
        mode: sys::CUstreamCaptureMode,
    ) -> Result<(), DeviceError> {
        match graph {
            // SAFETY: the stream is live and not capturing; `graph` is a live graph of this
            // context owned by the caller; `deps` are nodes of it (edge data null).
            Some(graph) => check(OP, unsafe {
                sys::cuStreamBeginCaptureToGraph(
                    self.stream,
                    graph,
                    if deps.is_empty() {
                        ptr::null()
                    } else {
                        deps.as_ptr()
                    },
                    ptr::null(),
                    deps.len(),
                    mode,
                )
            }),
            // SAFETY: the stream is live and not capturing.
            None => check(OP, unsafe {
                sys::cuStreamBeginCapture_v2(self.stream, mode)
            }),
        }
    }

    /// Opens a conditional node (see the module documentation).
    pub(crate) fn begin_conditional(
        &self,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        self.enter(OP)?;
        if !self.supports_conditionals() {
            return Err(DeviceError::Unavailable {
                op: OP,
                what: "the CUDA driver is older than 12.8, which has every kind of conditional graph node; update the driver, or loop on the host",
            });
        }
        if !selector.0.is_multiple_of(4) {
            return Err(invalid_argument(
                OP,
                "a conditional's selector must be 4-byte aligned",
            ));
        }
        let mut state = self.conditionals();
        let Some(mode) = state.mode else {
            return Err(no_capture());
        };
        if !state.open.is_empty() {
            // The enclosing body is being captured as a graph of its own, which is copied
            // node by node into its node's body (`relocate`): a conditional node cannot be.
            return Err(DeviceError::Conditional {
                op: OP,
                rule: graft_core::ConditionalRule::Nested,
            });
        }
        // The handle belongs to the graph being captured: read it while the capture is on.
        let (graph, _) = self.capture_info()?;
        let mut handle: sys::CUgraphConditionalHandle = 0;
        // SAFETY: `graph` is the live graph of the stream's capture, in this context (current);
        // default value 0, no flags; `handle` is a valid out-pointer.
        check(OP, unsafe {
            sys::cuGraphConditionalHandleCreate(&mut handle, graph, self.ctx, 0, 0)
        })?;
        self.launch_set_conditional(handle, selector.0)?;
        let (outer, deps) = self.suspend()?;
        let mut params: sys::CUgraphNodeParams = zeroed_params();
        params.type_ = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL;
        let cond_type = match kind {
            Conditional::While => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_WHILE,
            Conditional::If | Conditional::IfElse => {
                sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_IF
            }
            Conditional::Switch(_) => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_SWITCH,
        };
        let branches = kind.branches();
        params.__bindgen_anon_1.conditional = sys::CUDA_CONDITIONAL_NODE_PARAMS {
            handle,
            type_: cond_type,
            size: branches as u32,
            phGraph_out: ptr::null_mut(),
            ctx: self.ctx,
        };
        let mut node: sys::CUgraphNode = ptr::null_mut();
        // SAFETY: `outer` is the live graph just ended (ours now); `deps` are its nodes;
        // `params` is a zeroed conditional node block with the handle created in `outer`.
        let added = check(OP, unsafe {
            sys::cuGraphAddNode_v2(
                &mut node,
                outer,
                if deps.is_empty() {
                    ptr::null()
                } else {
                    deps.as_ptr()
                },
                ptr::null(),
                deps.len(),
                &mut params,
            )
        });
        let bodies = added.and_then(|()| {
            // SAFETY: the call succeeded, so the driver set `phGraph_out` to an array of
            // `size` body graphs, owned by the node.
            let out = unsafe { params.__bindgen_anon_1.conditional.phGraph_out };
            if out.is_null() {
                return Err(invalid_argument(OP, "the driver returned no body graphs"));
            }
            // SAFETY: as above: `branches` graph handles at `out`.
            Ok(unsafe { std::slice::from_raw_parts(out, branches) }.to_vec())
        });
        let bodies = match bodies {
            Ok(b) => b,
            Err(e) => {
                // Nothing owns `outer` yet but this frame: keep it for the abort to destroy.
                state.open.push(Open {
                    outer,
                    node: ptr::null_mut(),
                    bodies: Vec::new(),
                    handle,
                    kind,
                    selector: selector.0,
                    branch: 0,
                });
                return Err(e);
            }
        };
        state.finished.any = true;
        state.open.push(Open {
            outer,
            node,
            bodies,
            handle,
            kind,
            selector: selector.0,
            branch: 0,
        });
        self.capture_into(None, &[], mode)
    }

    /// Ends the body being captured and puts it into the open node's current body graph.
    fn close_body(&self, state: &mut ConditionalState) -> Result<(), DeviceError> {
        let Some(open) = state.open.last() else {
            return Err(DeviceError::CaptureState {
                op: OP,
                state: "no conditional node is open",
            });
        };
        let target = open.bodies[open.branch];
        let mut body: sys::CUgraph = ptr::null_mut();
        // SAFETY: the stream is capturing the body (begun by `begin_conditional` or
        // `next_branch` on this thread); `body` is a valid out-pointer.
        let ended = unsafe { sys::cuStreamEndCapture(self.stream, &mut body) };
        if ended != sys::CUresult::CUDA_SUCCESS {
            destroy_orphan(self, body, ptr::null_mut());
            return Err(crate::error::map(OP, ended, 0));
        }
        let done = relocate::finish(self, body, target);
        match &done {
            Ok(Body {
                scratch,
                host_random,
            }) => {
                state.finished.scratch.extend(*scratch);
                state.finished.host_random += host_random;
            }
            Err(e) => {
                tracing::debug!(error = %e, nodes = ?node_kinds(body), "a conditional body was refused");
            }
        }
        let done = done.map(|_| ());
        destroy_orphan(self, body, ptr::null_mut());
        done
    }

    /// Moves the capture to the open node's next body.
    pub(crate) fn next_branch(&self) -> Result<(), DeviceError> {
        self.enter(OP)?;
        let mut state = self.conditionals();
        let mode = state.mode.ok_or_else(no_capture)?;
        match state.open.last() {
            Some(o) if o.branch + 1 < o.bodies.len() => {}
            Some(_) => {
                return Err(invalid_argument(
                    OP,
                    "the conditional node has no further body",
                ));
            }
            None => {
                return Err(DeviceError::CaptureState {
                    op: OP,
                    state: "no conditional node is open",
                });
            }
        }
        self.close_body(&mut state)?;
        if let Some(o) = state.open.last_mut() {
            o.branch += 1;
        }
        self.capture_into(None, &[], mode)
    }

    /// Closes the open node (a loop's body first re-reads its selector) and resumes the
    /// capture after it.
    pub(crate) fn end_conditional(&self) -> Result<(), DeviceError> {
        self.enter(OP)?;
        let mut state = self.conditionals();
        let mode = state.mode.ok_or_else(no_capture)?;
        let Some(open) = state.open.last() else {
            return Err(DeviceError::CaptureState {
                op: OP,
                state: "no conditional node is open",
            });
        };
        if open.branch + 1 != open.bodies.len() {
            return Err(invalid_argument(
                OP,
                "the conditional node was closed before its last body",
            ));
        }
        if open.kind == Conditional::While {
            let (handle, selector) = (open.handle, open.selector);
            self.launch_set_conditional(handle, selector)?;
        }
        self.close_body(&mut state)?;
        let Some(open) = state.open.pop() else {
            return Err(invalid_argument(OP, "the conditional node vanished"));
        };
        if let Err(e) = self.capture_into(Some(open.outer), &[open.node], mode) {
            state.open.push(open);
            return Err(e);
        }
        Ok(())
    }

    /// Discards what open conditional nodes hold (an aborted capture): each one's outer
    /// graph (the capture's graph, or a body's), and the scratch memory of finished bodies.
    /// The stream's own capture is ended by the caller.
    pub(crate) fn discard_conditionals(&self) {
        let state = std::mem::take(&mut *self.conditionals());
        for open in state.open {
            destroy_orphan(self, open.outer, ptr::null_mut());
        }
        free_scratch(self, state.finished.scratch);
    }

    /// Whether the stream is capturing now (a body, or the graph around it).
    pub(crate) fn stream_capturing(&self) -> bool {
        matches!(self.capture_status(OP), Ok(s) if s != CAPTURE_NONE)
    }

    /// Unloads the set-conditional kernel (teardown).
    pub(crate) fn unload_set_conditional(&mut self) {
        if let Some(k) = self.set_conditional.take() {
            // SAFETY: the module was loaded once in this context (current) and is unloaded
            // once, here, with no graph left that launches it (every graph holds the device).
            let _ = unsafe { sys::cuModuleUnload(k.module) };
        }
    }
}

/// Frees scratch memory made by [`relocate::finish`]; failures go to the sticky slot.
pub(crate) fn free_scratch(device: &Inner, scratch: Vec<u64>) {
    for ptr in scratch {
        // SAFETY: `ptr` came from cuMemAlloc in `relocate::finish`, owned by one graph (or a
        // discarded capture) alone, and is freed once here; no launch that uses it is pending
        // (the graph that used it is destroyed, and the driver defers until launches end).
        if let Err(e) = check(DeviceOp::GraphDestroy, unsafe { sys::cuMemFree_v2(ptr) }) {
            device.record_sticky(e);
        }
    }
}

/// How many nodes of each type (`CUgraphNodeType`) `graph` has, for diagnostics.
fn node_kinds(graph: sys::CUgraph) -> Vec<(u32, usize)> {
    let mut kinds: Vec<(u32, usize)> = Vec::new();
    for node in crate::graph::nodes(OP, graph).unwrap_or_default() {
        let kind = crate::graph::node_type(OP, node).unwrap_or(u32::MAX);
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds
}

/// What a conditional call finds outside a capture.
fn no_capture() -> DeviceError {
    DeviceError::CaptureState {
        op: OP,
        state: "no capture is underway on the runtime stream",
    }
}

/// A zeroed node parameter block.
fn zeroed_params() -> sys::CUgraphNodeParams {
    // SAFETY: `CUgraphNodeParams` is a plain C struct of integers, pointers and a union of
    // such; all-zero bytes is a valid value of every field.
    unsafe { std::mem::zeroed() }
}
