//! The side stream's fork and join on a `SimDevice`: eagerly, a window of the race tracker; during a capture, the side stream's operations recorded apart and folded into one `Op::Fork` at the join.

use std::sync::Arc;

use graft_core::{DeviceError, DeviceOp, ForkRule};

use crate::device::SimDevice;
use crate::ops::Op;
use crate::state::{Capture, Fork, State, invalidated};

/// Refuses `rule` at `op`, invalidating a capture underway (as CUDA invalidates a capture
/// on an illegal stream operation).
fn refuse(st: &mut State, op: DeviceOp, rule: ForkRule) -> DeviceError {
    if let Capture::Recording { mode, .. } = st.capture {
        st.capture = Capture::Invalidated { mode };
    }
    DeviceError::Fork { op, rule }
}

impl SimDevice {
    /// `Device::fork`: opens a fork, eagerly (a race-tracker window) or in the capture (the
    /// work so far set aside, the side stream's recorded apart).
    pub(crate) fn fork_side(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Fork;
        let mut guard = self.lock(op)?;
        let st = &mut *guard;
        if st.fork.is_some() {
            return Err(refuse(st, op, ForkRule::Nested));
        }
        let recorded = match &mut st.capture {
            Capture::Idle => {
                st.mem.open_window();
                None
            }
            Capture::Invalidated { .. } => return Err(invalidated(op)),
            Capture::Recording { open, .. } if !open.is_empty() => {
                return Err(refuse(st, op, ForkRule::InConditional));
            }
            Capture::Recording { ops, .. } => Some((std::mem::take(ops), Vec::new())),
        };
        st.fork = Some(Fork { recorded });
        Ok(())
    }

    /// `Device::join`: closes the open fork (whatever the result). Eagerly it reports a race
    /// between the two streams' accesses since the fork; in a capture it folds the fork's
    /// work into one `Op::Fork` after the work before it.
    pub(crate) fn join_side(&self) -> Result<(), DeviceError> {
        let op = DeviceOp::Fork;
        let mut guard = self.lock(op)?;
        let st = &mut *guard;
        let Some(fork) = st.fork.take() else {
            return Err(refuse(st, op, ForkRule::NotForked));
        };
        match (fork.recorded, &mut st.capture) {
            (None, _) => st.mem.close_window(op),
            (Some((before, side)), Capture::Recording { ops, .. }) => {
                let main = std::mem::replace(ops, before);
                ops.push(Op::Fork {
                    side: Arc::from(side),
                    main: Arc::from(main),
                });
                Ok(())
            }
            (Some(_), _) => Err(invalidated(op)),
        }
    }
}
