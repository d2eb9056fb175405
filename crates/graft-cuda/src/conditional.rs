//! Conditional nodes (CUDA 12.4+ WHILE, IF and SWITCH) inside a capture: opening one where the runtime stream's capture stands, capturing each body as a graph of its own, and resuming the capture after the node.
//!
//! Every conditional node gets a handle, set on the device by one tiny kernel
//! (`graft_set_conditional`, PTX written here: it reads the `u32` selector and calls the
//! device runtime's `cudaGraphSetConditional`) launched right before the node, and for a loop
//! again as the body's last work. The runtime stream stays the one stream of the capture
//! (frameworks such as candle launch on a stream they own): opening a node ends the stream's
//! capture (the graph so far is kept), adds the node after the work captured so far, and
//! begins a fresh capture for the body; closing it ends that capture, checks the body and
//! copies it node by node into the node's body graph, leaving its memory nodes out and moving
//! its stream-ordered allocations into memory the graph owns ([`crate::relocate`]; it is not
//! added as a child graph: the H100's driver refused child graphs in a conditional node's
//! body, and deleting the memory nodes of a captured graph in place), and resumes capturing
//! into the outer graph after the node (`cuStreamBeginCaptureToGraph`). [`Conditionals`] holds
//! one device's conditional state and its loaded set-conditional kernel.

use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys;
use graft_core::{Conditional, DeviceError, DeviceOp, DevicePtr};

use crate::context::Context;
use crate::driver;
use crate::error::invalid_argument;
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
struct SetConditional {
    module: sys::CUmodule,
    function: sys::CUfunction,
}

// SAFETY: a module and its function are driver handles usable from any thread once their
// context is current (every use enters the device first); they are unloaded only in
// `Conditionals::unload` (the device's teardown), with exclusive access.
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

/// One device's conditional nodes: the state of the capture underway, and the kernel that sets
/// a conditional node's handle, loaded on first use.
#[derive(Default)]
pub(crate) struct Conditionals {
    state: Mutex<ConditionalState>,
    set_conditional: OnceLock<SetConditional>,
}

impl Conditionals {
    /// The conditional state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ConditionalState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the driver has every kind of conditional node (CUDA 12.8 or later) and every
    /// function they need (`driver::CONDITIONAL_SYMBOLS`).
    pub(crate) fn supported() -> bool {
        static SUPPORTED: OnceLock<bool> = OnceLock::new();
        *SUPPORTED.get_or_init(|| {
            let version: c_int = driver::device::driver_version().unwrap_or(0);
            version >= MIN_DRIVER && driver::has_symbols(driver::CONDITIONAL_SYMBOLS)
        })
    }

    /// Starts a capture's conditional state (at `begin_capture`).
    pub(crate) fn reset(&self, mode: sys::CUstreamCaptureMode) {
        *self.lock() = ConditionalState {
            mode: Some(mode),
            ..Default::default()
        };
    }

    /// Loads the set-conditional kernel once.
    fn set_conditional_kernel(&self, cx: &Context) -> Result<sys::CUfunction, DeviceError> {
        if let Some(k) = self.set_conditional.get() {
            return Ok(k.function);
        }
        let op = DeviceOp::ModuleLoad;
        let loaded = cx.with_relaxed(op, || {
            let module = driver::function::load(op, SET_CONDITIONAL_PTX.to_bytes_with_nul())?;
            match driver::function::get(op, module, c"graft_set_conditional") {
                Ok(function) => Ok(SetConditional { module, function }),
                Err(e) => {
                    // Loaded above and unloaded once, here.
                    let _ = driver::function::unload(op, module);
                    Err(e)
                }
            }
        })?;
        let function = loaded.function;
        if let Err(extra) = self.set_conditional.set(loaded) {
            // This module lost the race, was never shared, and is unloaded once.
            let _ = driver::function::unload(op, extra.module);
            return Ok(self.set_conditional.get().map_or(function, |k| k.function));
        }
        Ok(function)
    }

    /// Enqueues `graft_set_conditional(handle, selector)` on the runtime stream (captured).
    fn launch_set_conditional(
        &self,
        cx: &Context,
        handle: sys::CUgraphConditionalHandle,
        selector: u64,
    ) -> Result<(), DeviceError> {
        let function = self.set_conditional_kernel(cx)?;
        let (mut h, mut s) = (handle, selector);
        let mut args = [(&raw mut h).cast::<c_void>(), (&raw mut s).cast::<c_void>()];
        // SAFETY: `function` (of the module loaded in this context, current) takes two 8-byte
        // parameters (the PTX above); `args` points at one pointer per parameter, each to a
        // live 8-byte value, for the call's duration; one thread of one block; the runtime
        // stream is live.
        unsafe {
            driver::function::launch(
                DeviceOp::KernelLaunch,
                function,
                (1, 1, 1),
                (1, 1, 1),
                0,
                cx.stream,
                &mut args,
            )
        }
    }

    /// Ends the runtime stream's capture and returns its graph, with the capture's current
    /// dependencies.
    fn suspend(&self, cx: &Context) -> Result<(sys::CUgraph, Vec<sys::CUgraphNode>), DeviceError> {
        let (_, deps) = driver::stream::capture_info(OP, cx.stream)?;
        let (ended, result) = driver::stream::end_capture(OP, cx.stream);
        result?;
        Ok((ended, deps))
    }

    /// Begins capturing into `graph` after `deps` (none: a fresh graph of its own).
    fn capture_into(
        &self,
        cx: &Context,
        graph: Option<sys::CUgraph>,
        deps: &[sys::CUgraphNode],
        mode: sys::CUstreamCaptureMode,
    ) -> Result<(), DeviceError> {
        match graph {
            Some(graph) => driver::stream::begin_capture_to_graph(OP, cx.stream, graph, deps, mode),
            None => driver::stream::begin_capture(OP, cx.stream, mode),
        }
    }

    /// Opens a conditional node (see the module documentation).
    pub(crate) fn begin(
        &self,
        cx: &Context,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        cx.enter(OP)?;
        if !Conditionals::supported() {
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
        let mut state = self.lock();
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
        let (graph, _) = driver::stream::capture_info(OP, cx.stream)?;
        let handle = driver::graph::conditional_handle(OP, graph, cx.ctx)?;
        self.launch_set_conditional(cx, handle, selector.0)?;
        let (outer, deps) = self.suspend(cx)?;
        let cond_type = match kind {
            Conditional::While => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_WHILE,
            Conditional::If | Conditional::IfElse => {
                sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_IF
            }
            Conditional::Switch(_) => sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_SWITCH,
        };
        let added = driver::graph::add_conditional_node(
            OP,
            outer,
            &deps,
            handle,
            cond_type,
            kind.branches(),
            cx.ctx,
        );
        let (node, bodies) = match added {
            Ok(added) => added,
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
        self.capture_into(cx, None, &[], mode)
    }

    /// Ends the body being captured and copies it into the open node's current body graph.
    fn close_body(&self, cx: &Context, state: &mut ConditionalState) -> Result<(), DeviceError> {
        let Some(open) = state.open.last() else {
            return Err(DeviceError::CaptureState {
                op: OP,
                state: "no conditional node is open",
            });
        };
        let target = open.bodies[open.branch];
        // The stream is capturing the body (begun by `begin` or `next_branch` on this thread).
        let (body, ended) = driver::stream::end_capture(OP, cx.stream);
        if let Err(e) = ended {
            cx.destroy_orphan(body, ptr::null_mut());
            return Err(e);
        }
        let done = relocate::finish(cx, body, target);
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
        cx.destroy_orphan(body, ptr::null_mut());
        done
    }

    /// Moves the capture to the open node's next body.
    pub(crate) fn next_branch(&self, cx: &Context) -> Result<(), DeviceError> {
        cx.enter(OP)?;
        let mut state = self.lock();
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
        self.close_body(cx, &mut state)?;
        if let Some(o) = state.open.last_mut() {
            o.branch += 1;
        }
        self.capture_into(cx, None, &[], mode)
    }

    /// Closes the open node (a loop's body first re-reads its selector) and resumes the
    /// capture after it.
    pub(crate) fn end(&self, cx: &Context) -> Result<(), DeviceError> {
        cx.enter(OP)?;
        let mut state = self.lock();
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
            self.launch_set_conditional(cx, handle, selector)?;
        }
        self.close_body(cx, &mut state)?;
        let Some(open) = state.open.pop() else {
            return Err(invalid_argument(OP, "the conditional node vanished"));
        };
        if let Err(e) = self.capture_into(cx, Some(open.outer), &[open.node], mode) {
            state.open.push(open);
            return Err(e);
        }
        Ok(())
    }

    /// Discards what open conditional nodes hold (an aborted capture): each one's outer
    /// graph (the capture's graph, or a body's), and the scratch memory of finished bodies.
    /// The stream's own capture is ended by the caller.
    pub(crate) fn discard(&self, cx: &Context) {
        let state = std::mem::take(&mut *self.lock());
        for open in state.open {
            cx.destroy_orphan(open.outer, ptr::null_mut());
        }
        cx.free_scratch(state.finished.scratch);
    }

    /// Unloads the set-conditional kernel (teardown, the context current).
    pub(crate) fn unload(&mut self) {
        if let Some(k) = self.set_conditional.take() {
            // Loaded once in this context and unloaded once, here, with no graph left that
            // launches it (every graph holds the device).
            let _ = driver::function::unload(DeviceOp::ModuleLoad, k.module);
        }
    }
}

/// How many nodes of each type (`CUgraphNodeType`) `graph` has, for diagnostics.
fn node_kinds(graph: sys::CUgraph) -> Vec<(u32, usize)> {
    let mut kinds: Vec<(u32, usize)> = Vec::new();
    for node in driver::graph::nodes(OP, graph).unwrap_or_default() {
        let kind = driver::graph::node_type(OP, node).unwrap_or(u32::MAX);
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
