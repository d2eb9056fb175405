//! `SimGraph`: the executable graph a capture makes, which replays its recorded operations.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use graft_core::backend::CopyEnds;
use graft_core::{DeviceError, DeviceId, DeviceOp, DevicePtr, GraphSummary};

use crate::ops::{Op, walk_kernels};
use crate::state::Inner;

/// An instantiated graph of a [`crate::SimDevice`]: the operations recorded by one capture, replayed
/// in order at the recorded addresses by [`graft_core::Device::launch`].
///
/// Dropping it destroys it (see [`crate::SimDevice::fail_next_graph_destroy`] for the error path).
pub struct SimGraph {
    pub(crate) ops: Arc<[Op]>,
    /// Redirected ranges (`Device::redirect`): `(from, len, to)`, and the input copies they
    /// turned off (as `(dst, src)`).
    pub(crate) redirects: Vec<(u64, u64, u64)>,
    pub(crate) disabled: Vec<CopyEnds>,
    pub(crate) summary: GraphSummary,
    pub(crate) owner: Arc<Inner>,
    /// Whether it may launch, be patched or updated: false for a graph ended to be compared
    /// until `Device::prepare_launch` (CUDA has no executable for it before).
    pub(crate) launchable: bool,
}

impl SimGraph {
    /// Makes accesses of `[from, + len)` go to `to` and turns the copy `copy` off, if any;
    /// with `None`, undoes both.
    pub(crate) fn redirect(
        &mut self,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) {
        self.redirects.retain(|&(s, _, _)| s != from.0);
        if let Some(copy) = copy {
            self.disabled.retain(|c| c.dst != copy.dst);
        }
        if let Some(to) = to {
            self.redirects.push((from.0, len as u64, to.0));
            self.disabled.extend(copy);
        }
    }

    /// Whether every use of `[from, + len)` can be moved, as graft-cuda's patcher decides on
    /// CUDA: not in a graph holding a kernel launched without declared arguments (whose
    /// parameters CUDA would not show, as NCCL's), a child graph or a conditional node, nor
    /// where a copy other than the input's own (`copy`) touches the range.
    pub(crate) fn can_redirect(&self, from: DevicePtr, len: usize, copy: Option<CopyEnds>) -> bool {
        fn walk(ops: &[Op], range: (u64, u64), copy: Option<CopyEnds>) -> bool {
            let touches = |at: DevicePtr, n: usize| at.0 < range.1 && range.0 < at.0 + n as u64;
            ops.iter().all(|op| match op {
                Op::Kernel { args, .. } => args.is_some(),
                Op::Copy { dst, src, len } => {
                    let own = copy.is_some_and(|c| c.dst == *dst && c.src == *src);
                    own || !(touches(*dst, *len) || touches(*src, *len))
                }
                Op::Fork { side, main } => walk(side, range, copy) && walk(main, range, copy),
                Op::Child(_) | Op::Conditional { .. } => false,
            })
        }
        walk(&self.ops, (from.0, from.0 + len as u64), copy)
    }

    /// Re-points the top-level copy with ends `recorded` to the ends `now` (see
    /// `Device::repoint_copy`).
    pub(crate) fn repoint_copy(
        &mut self,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        let Some(index) = self.ops.iter().position(
            |op| matches!(op, Op::Copy { dst, src, .. } if *dst == recorded.dst && *src == recorded.src),
        ) else {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: "the graph has no copy with the recorded ends",
            });
        };
        let mut ops: Vec<Op> = self.ops.to_vec();
        if let Op::Copy { dst, src, .. } = &mut ops[index] {
            *dst = now.dst;
            *src = now.src;
        }
        self.ops = ops.into();
        Ok(())
    }

    /// The device that recorded this graph.
    pub fn device(&self) -> DeviceId {
        self.owner.id
    }

    /// The names of the kernels it launches, in launch order (child graphs and conditional
    /// bodies flattened, each body once).
    pub fn kernel_names(&self) -> Vec<&'static str> {
        walk_kernels(&self.ops)
    }
}

impl fmt::Debug for SimGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimGraph")
            .field("device", &self.owner.id)
            .field("ops", &self.ops)
            .finish()
    }
}

impl Drop for SimGraph {
    fn drop(&mut self) {
        self.owner
            .counters
            .live_graphs
            .fetch_sub(1, Ordering::Relaxed);
        if self
            .owner
            .faults
            .fail_next_graph_destroy
            .swap(false, Ordering::Relaxed)
        {
            self.owner.sticky.record(DeviceError::Injected {
                op: DeviceOp::GraphDestroy,
            });
        }
    }
}
