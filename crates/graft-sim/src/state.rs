//! What sits behind a `SimDevice`'s lock (memory and the capture state machine) and beside it
//! (counters, armed faults, the sticky error slot), shared by the device, its queue and its
//! graphs.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use graft_core::backend::StickyError;
use graft_core::{
    CaptureMode, CaptureViolation, Conditional, DeviceError, DeviceId, DeviceOp, DevicePtr,
};

use crate::memory::SimMemory;
use crate::ops::Op;

thread_local! {
    /// Set while this thread runs stream work (a kernel body), during which the device is locked.
    pub(crate) static ON_STREAM: Cell<bool> = const { Cell::new(false) };
}

/// Marks the current thread as running stream work until dropped (also on panic).
pub(crate) struct StreamGuard;

impl StreamGuard {
    pub(crate) fn enter() -> StreamGuard {
        ON_STREAM.with(|c| c.set(true));
        StreamGuard
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        ON_STREAM.with(|c| c.set(false));
    }
}

/// What a launch or update of another device's graph is refused with.
pub(crate) const FOREIGN_GRAPH: &str = "the graph was captured on another device";
pub(crate) const NOT_PREPARED: &str =
    "the graph was ended to be compared and never prepared to launch (Device::prepare_launch)";
pub(crate) const NO_CAPTURE: &str = "no capture is underway";
pub(crate) const CAPTURE_UNDERWAY: &str = "a capture is already underway";
pub(crate) const CAPTURE_INVALIDATED: &str = "an invalidated capture is underway";

pub(crate) enum Capture {
    Idle,
    Recording {
        mode: CaptureMode,
        /// Where work is recorded now: the graph's top level, or the body of the innermost
        /// open conditional.
        ops: Vec<Op>,
        /// Work was forked onto the side stream and never joined back.
        unjoined: bool,
        /// Open conditional nodes, innermost last.
        open: Vec<OpenConditional>,
    },
    Invalidated {
        mode: CaptureMode,
    },
}

/// A conditional node being recorded: the work before it, and its bodies so far.
pub(crate) struct OpenConditional {
    pub(crate) kind: Conditional,
    pub(crate) selector: DevicePtr,
    /// The bodies already ended.
    pub(crate) done: Vec<Arc<[Op]>>,
    /// What was recorded before the node, at the level it belongs to.
    pub(crate) before: Vec<Op>,
}

/// What a conditional call finds when no capture, or no conditional, is open.
pub(crate) const NO_CONDITIONAL: &str = "no conditional node is open";

/// An open fork of the side stream (`Device::fork`, closed by `Device::join`).
pub(crate) struct Fork {
    /// Forked during a capture: what the capture recorded before the fork (the runtime
    /// stream's work since goes on into the capture's `ops`), and the side stream's work.
    /// `None` for an eager fork, whose accesses the memory's race tracker logs instead.
    pub(crate) recorded: Option<(Vec<Op>, Vec<Op>)>,
}

/// Everything behind the device lock.
pub(crate) struct State {
    pub(crate) mem: SimMemory,
    pub(crate) capture: Capture,
    /// The open fork, if any.
    pub(crate) fork: Option<Fork>,
}

/// Counters readable without the lock.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) mapped_bytes: AtomicUsize,
    pub(crate) reservations: AtomicUsize,
    pub(crate) live_raw_allocs: AtomicUsize,
    pub(crate) live_graphs: AtomicUsize,
    pub(crate) instantiations: AtomicU64,
    pub(crate) kernels_run: AtomicU64,
    pub(crate) copies_run: AtomicU64,
    pub(crate) graph_launches: AtomicU64,
    pub(crate) maps: AtomicU64,
}

/// Armed fault injection points; each fires once.
#[derive(Default)]
pub(crate) struct Faults {
    /// 0: off; k > 0: the k-th map from when it was armed fails.
    pub(crate) map_countdown: AtomicU64,
    pub(crate) instantiate: AtomicBool,
    pub(crate) launch: AtomicBool,
    /// Conditional nodes are refused, as by a driver older than CUDA 12.4.
    pub(crate) no_conditionals: AtomicBool,
    pub(crate) fail_next_graph_destroy: AtomicBool,
}

pub(crate) struct Inner {
    pub(crate) id: DeviceId,
    pub(crate) state: Mutex<State>,
    pub(crate) sticky: StickyError,
    pub(crate) counters: Counters,
    pub(crate) faults: Faults,
}

pub(crate) fn invalidated(op: DeviceOp) -> DeviceError {
    DeviceError::Capture {
        op,
        violation: CaptureViolation::Invalidated,
    }
}

impl State {
    /// For operations CUDA refuses during a capture: fails and invalidates the capture, or
    /// passes when the stream is idle.
    pub(crate) fn forbid_in_capture(&mut self, op: DeviceOp) -> Result<(), DeviceError> {
        match self.capture {
            Capture::Idle => Ok(()),
            Capture::Recording { mode, .. } => {
                self.capture = Capture::Invalidated { mode };
                Err(DeviceError::Capture {
                    op,
                    violation: CaptureViolation::Unsupported,
                })
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
        }
    }
}
