//! Race detection between the two streams of a fork: while a fork is open, the byte ranges each stream's operations read and write are logged, and at the join a write by one stream to bytes the other touched is a `DeviceError::StreamRace`.

use std::cell::RefCell;

use graft_core::{DeviceError, DeviceOp, DevicePtr};

use super::SimMemory;

/// The stream an operation runs on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Lane {
    /// The runtime stream.
    Main,
    /// The side stream.
    Side,
}

/// One logged access: `[start, end)`, and whether it wrote.
type Access = (u64, u64, bool);

/// The accesses of an open fork window, per stream, and the stream running now (`None`: host
/// work, or no fork open, which is not logged).
#[derive(Default)]
pub(crate) struct Tracker {
    /// Whether a fork window is open (accesses are logged).
    open: bool,
    lane: Option<Lane>,
    main: Vec<Access>,
    side: Vec<Access>,
}

/// The tracker behind `SimMemory`'s shared reads (a `RefCell`: the memory sits behind the
/// device lock, so there is one user at a time).
pub(crate) type Tracked = RefCell<Tracker>;

impl SimMemory {
    /// Opens a fork window: from now on accesses made on a lane are logged.
    pub(crate) fn open_window(&mut self) {
        let t = self.tracker.get_mut();
        *t = Tracker {
            open: true,
            ..Tracker::default()
        };
    }

    /// Sets the lane the next accesses are made on (`None`: stop attributing them).
    pub(crate) fn set_lane(&mut self, lane: Option<Lane>) {
        self.tracker.get_mut().lane = lane;
    }

    /// Closes the fork window and reports the first race in it: bytes one stream wrote that
    /// the other read or wrote.
    pub(crate) fn close_window(&mut self, op: DeviceOp) -> Result<(), DeviceError> {
        let t = std::mem::take(self.tracker.get_mut());
        for &(a0, a1, aw) in &t.main {
            for &(b0, b1, bw) in &t.side {
                let (lo, hi) = (a0.max(b0), a1.min(b1));
                if lo < hi && (aw || bw) {
                    return Err(DeviceError::StreamRace {
                        op,
                        addr: DevicePtr(lo),
                        len: (hi - lo) as usize,
                    });
                }
            }
        }
        Ok(())
    }

    /// Logs an access of `len` bytes at `addr` on the current lane, in an open window.
    #[inline]
    pub(super) fn note_access(&self, addr: u64, len: usize, write: bool) {
        let mut t = self.tracker.borrow_mut();
        if !t.open || len == 0 {
            return;
        }
        let access = (addr, addr.saturating_add(len as u64), write);
        match t.lane {
            Some(Lane::Main) => t.main.push(access),
            Some(Lane::Side) => t.side.push(access),
            None => {}
        }
    }
}
