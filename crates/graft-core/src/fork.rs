//! Work on two streams in a body: `Ctx::fork` runs a side closure on the device's side stream and a main closure on the runtime stream, and always joins them back; frees inside the fork are held until the join.

use std::sync::{Mutex, PoisonError};

use crate::ctx::{Ctx, Scope};
use crate::device::{CORE, Device, DeviceError, DeviceOp, ForkRule};
use crate::error::BodyError;
use crate::pool::Pool;

impl<'a, D: Device> Ctx<'a, D> {
    /// Runs `side` on the device's side stream and `main` on the runtime stream, concurrently
    /// on the device, and joins them: work the body enqueues after `fork` returns runs after
    /// both. `side` gets the side stream's queue and only enqueues work there; `main` gets the
    /// context as usual (its queue is the runtime stream's, and it may allocate). Both closures
    /// run once, `side` first, on the calling thread; each sees everything enqueued on the
    /// runtime stream before the fork.
    ///
    /// Eager runs, warmups and recordings take the same path; recorded, the fork and its join
    /// are part of the node's one graph, which replays with one launch, and the node's
    /// footprint is everything the graph writes from both streams.
    ///
    /// Memory freed between the fork and the join (a buffer dropped in either closure) is not
    /// reused by any allocation until the join: the other stream may still be using it, and
    /// stream order no longer protects it. Do not let the two streams touch the same bytes
    /// when one of them writes: that is a race (the simulator reports it,
    /// `DeviceError::StreamRace`).
    ///
    /// The join happens whatever the closures return. `side` failing skips `main`.
    ///
    /// # Errors
    /// The first closure error; else the join's error (if both fail, the closure's error is
    /// returned and the join's goes to the device's sticky error slot, reported by the next
    /// call). A fork inside a fork (`ForkRule::Nested`) or inside a conditional body
    /// (`ForkRule::InConditional`) is refused with `DeviceError::Fork`, in every kind of run;
    /// a device without a side stream with `DeviceError::Unavailable` (graft does not run the
    /// closures one after the other on the runtime stream instead: a body must mean the same
    /// on every backend, and a serial fallback would hide the races the simulator reports).
    pub fn fork<A, B, E>(
        &mut self,
        side: impl FnOnce(&'a D::Queue) -> Result<A, BodyError<E>>,
        main: impl FnOnce(&mut Ctx<'a, D>) -> Result<B, BodyError<E>>,
    ) -> Result<(A, B), BodyError<E>> {
        let rule = match self.scope {
            Scope::Top => None,
            Scope::Forked => Some(ForkRule::Nested),
            Scope::Conditional => Some(ForkRule::InConditional),
        };
        if let Some(rule) = rule {
            return Err(DeviceError::Fork {
                op: DeviceOp::Fork,
                rule,
            }
            .into());
        }
        let device = self.device;
        let Some(side_queue) = device.side_queue() else {
            return Err(DeviceError::Unavailable {
                op: DeviceOp::Fork,
                what: "this device has no side stream; enqueue the work on the runtime stream (ctx.queue())",
            }
            .into());
        };
        let span = tracing::debug_span!("fork", kind_of_run = ?self.kind);
        let _span = span.enter();
        let mut open = Open::start(device, [&**self.pool, self.sibling])?;
        self.scope = Scope::Forked;
        let ran = side(side_queue).and_then(|a| main(self).map(|b| (a, b)));
        self.scope = Scope::Top;
        let joined = open.join();
        match (ran, joined) {
            (Ok(both), Ok(())) => Ok(both),
            (Ok(_), Err(e)) => Err(e.into()),
            (Err(e), Ok(())) => Err(e),
            (Err(e), Err(lost)) => {
                tracing::debug!(error = %lost, "join after a failed fork closure failed too; kept in the sticky error slot");
                device.record_sticky_error(CORE, lost);
                Err(e)
            }
        }
    }
}

/// An open fork: the device forked and both pools holding their frees. Joined by
/// [`Open::join`], or when dropped unjoined (a closure panicked), with the join's error in the
/// sticky slot.
struct Open<'a, D: Device> {
    device: &'a D,
    pools: [&'a Mutex<Pool>; 2],
    joined: bool,
}

impl<'a, D: Device> Open<'a, D> {
    /// Makes both pools hold their frees, then forks the device. If the fork fails, the pools
    /// stop holding again.
    fn start(device: &'a D, pools: [&'a Mutex<Pool>; 2]) -> Result<Self, DeviceError> {
        for pool in pools {
            pool.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .hold_frees();
        }
        let mut open = Open {
            device,
            pools,
            joined: false,
        };
        if let Err(e) = device.fork(CORE) {
            open.joined = true;
            open.release();
            return Err(e);
        }
        Ok(open)
    }

    /// Joins the device (the fork is closed whether it succeeds or fails), then releases what
    /// the pools held: after the join, all later work on the runtime stream follows the side
    /// stream's.
    fn join(&mut self) -> Result<(), DeviceError> {
        self.joined = true;
        let joined = self.device.join(CORE);
        self.release();
        joined
    }

    /// Frees the held blocks of both pools. A held id a restore made stale meanwhile is
    /// simply gone, as for a dropped buffer (`Buffer`'s `Drop`), so errors are only logged.
    fn release(&self) {
        for pool in self.pools {
            let mut pool = pool.lock().unwrap_or_else(PoisonError::into_inner);
            if let Err(error) = pool.release_held() {
                tracing::debug!(%error, "a block held during a fork was already gone at the join");
            }
        }
    }
}

impl<D: Device> Drop for Open<'_, D> {
    fn drop(&mut self) {
        if !self.joined
            && let Err(error) = self.join()
        {
            self.device.record_sticky_error(CORE, error);
        }
    }
}
