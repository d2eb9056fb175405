//! Race detection: between the two streams of a fork (while a fork is open, the byte ranges each stream's operations read and write are logged, and at the join a write by one stream to bytes the other touched is a `DeviceError::StreamRace`), and along a chain of programmatic dependent launches (what a dependent touches before its wait, against what the kernels that may still run touch: a `DeviceError::ProgrammaticRace`).

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
    /// Per stream (runtime, side), the chain: the kernels that may still run when the
    /// stream's next dependent starts (the last plain kernel and the dependents launched
    /// after it, the one running now last), each with where its accesses start in `log`.
    /// Cleared, never shrunk: a steady state of replays allocates nothing.
    chain: [Vec<(&'static str, usize)>; 2],
    /// Per stream, what the chain's kernels touched, in order.
    log: [Vec<Access>; 2],
    /// Whether a kernel is running (its accesses are logged).
    running: bool,
}

/// The tracker behind `SimMemory`'s shared reads (a `RefCell`: the memory sits behind the
/// device lock, so there is one user at a time).
pub(crate) type Tracked = RefCell<Tracker>;

impl SimMemory {
    /// Opens a fork window: from now on accesses made on a lane are logged.
    pub(crate) fn open_window(&mut self) {
        let t = self.tracker.get_mut();
        t.open = true;
        t.lane = None;
        t.main.clear();
        t.side.clear();
    }

    /// Sets the lane the next accesses are made on (`None`: stop attributing them).
    pub(crate) fn set_lane(&mut self, lane: Option<Lane>) {
        self.tracker.get_mut().lane = lane;
    }

    /// Closes the fork window and reports the first race in it: bytes one stream wrote that
    /// the other read or wrote.
    pub(crate) fn close_window(&mut self, op: DeviceOp) -> Result<(), DeviceError> {
        let t = self.tracker.get_mut();
        t.open = false;
        t.lane = None;
        let (main, side) = (std::mem::take(&mut t.main), std::mem::take(&mut t.side));
        for &(a0, a1, aw) in &main {
            for &b in &side {
                if let Some((addr, len)) = conflict((a0, a1, aw), b) {
                    return Err(DeviceError::StreamRace { op, addr, len });
                }
            }
        }
        Ok(())
    }

    /// Ends the programmatic chain: what runs next starts after everything before it ended
    /// (a copy, a host access, a graph launch's start and end).
    pub(crate) fn break_chain(&mut self) {
        let t = self.tracker.get_mut();
        t.chain.iter_mut().for_each(Vec::clear);
        t.log.iter_mut().for_each(Vec::clear);
    }

    /// Kernel `name` starts, a programmatic dependent or plain (which starts a new chain:
    /// nothing before it can still run); its accesses are logged from now on.
    pub(crate) fn begin_kernel(&mut self, name: &'static str, dependent: bool) {
        let t = self.tracker.get_mut();
        let stream = t.stream();
        if !dependent {
            t.chain[stream].clear();
            t.log[stream].clear();
        }
        let start = t.log[stream].len();
        t.chain[stream].push((name, start));
        t.running = true;
    }

    /// The dependent running now reaches its wait: what it touched so far, against what the
    /// kernels before it in the chain (which may still run) touched; the first conflict (one
    /// side writes) is a `ProgrammaticRace` naming both.
    pub(crate) fn check_wait(&mut self, op: DeviceOp) -> Result<(), DeviceError> {
        let t = self.tracker.get_mut();
        let stream = t.stream();
        let (chain, log) = (&t.chain[stream], &t.log[stream]);
        let Some((&(dependent, own), before)) = chain.split_last() else {
            return Ok(());
        };
        for &a in &log[own..] {
            for (i, &(predecessor, start)) in before.iter().enumerate() {
                let end = before.get(i + 1).map_or(own, |&(_, next)| next);
                for &b in &log[start..end] {
                    if let Some((addr, len)) = conflict(a, b) {
                        return Err(DeviceError::ProgrammaticRace {
                            op,
                            dependent,
                            predecessor,
                            addr,
                            len,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The kernel running now ended.
    pub(crate) fn end_kernel(&mut self) {
        self.tracker.get_mut().running = false;
    }

    /// Logs an access of `len` bytes at `addr` on the current lane, in an open window.
    #[inline]
    pub(super) fn note_access(&self, addr: u64, len: usize, write: bool) {
        let mut t = self.tracker.borrow_mut();
        if len == 0 {
            return;
        }
        let access = (addr, addr.saturating_add(len as u64), write);
        let stream = t.stream();
        if t.running {
            // Consecutive accesses of one kind merge (a kernel's loop over a tensor), within
            // the running kernel's own.
            let own = t.chain[stream].last().map_or(0, |&(_, start)| start);
            let log = &mut t.log[stream];
            let mergeable = log.len() > own;
            match log.last_mut() {
                Some(last) if mergeable && last.1 == access.0 && last.2 == write => {
                    last.1 = access.1
                }
                _ => log.push(access),
            }
        } else {
            // A copy or a host access: what follows on the stream starts after it.
            t.chain[stream].clear();
            t.log[stream].clear();
        }
        if !t.open {
            return;
        }
        match t.lane {
            Some(Lane::Main) => t.main.push(access),
            Some(Lane::Side) => t.side.push(access),
            None => {}
        }
    }
}

impl Tracker {
    /// The index of the stream running now in `chain` (host work counts as the runtime
    /// stream's).
    fn stream(&self) -> usize {
        usize::from(self.lane == Some(Lane::Side))
    }
}

/// The bytes two accesses share, when at least one of them writes.
fn conflict(a: Access, b: Access) -> Option<(DevicePtr, usize)> {
    let (lo, hi) = (a.0.max(b.0), a.1.min(b.1));
    (lo < hi && (a.2 || b.2)).then(|| (DevicePtr(lo), (hi - lo) as usize))
}
