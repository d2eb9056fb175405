//! [`SideStream`]: the device's second stream and two events to fork it from the runtime stream and join it back (`Device::fork`, `Device::join`, `Device::side_queue`).

use std::ptr;

use cudarc::driver::sys;
use graft_core::{DeviceError, DeviceOp};

use crate::context::Context;
use crate::driver;

/// A second stream of the device and two events to fork it from the runtime stream and join
/// it back. Null until [`SideStream::create`]; released by [`SideStream::release`].
pub(crate) struct SideStream {
    stream: sys::CUstream,
    fork: sys::CUevent,
    join: sys::CUevent,
}

// SAFETY: the stream and the events are driver handles, usable from any thread once the
// device's context is current (every use makes it current first); the driver synchronizes
// streams and events internally. They are created once (`create`, while the device is being
// opened) and destroyed only in `release`, with exclusive access.
unsafe impl Send for SideStream {}
// SAFETY: as for `Send`: shared use only passes the handles to driver calls.
unsafe impl Sync for SideStream {}

impl Default for SideStream {
    fn default() -> Self {
        SideStream {
            stream: ptr::null_mut(),
            fork: ptr::null_mut(),
            join: ptr::null_mut(),
        }
    }
}

impl SideStream {
    /// Creates the stream and the events in the current context (the device's, being opened).
    /// On failure what was created stays set, and [`SideStream::release`] destroys it.
    pub(crate) fn create(&mut self) -> Result<(), DeviceError> {
        let op = DeviceOp::Init;
        self.stream = driver::stream::create(op)?;
        for slot in [&mut self.fork, &mut self.join] {
            *slot = driver::stream::create_event(op)?;
        }
        Ok(())
    }

    /// Waits for the side stream, then destroys the events and the stream (each once). Errors
    /// are ignored: this only runs when the device is dropped, with its context current.
    pub(crate) fn release(&mut self) {
        if !self.stream.is_null() {
            let _ = self.sync(DeviceOp::GraphDestroy);
        }
        for slot in [&mut self.fork, &mut self.join] {
            let _ = driver::stream::destroy_event(DeviceOp::GraphDestroy, slot);
        }
        let _ = driver::stream::destroy(DeviceOp::GraphDestroy, &mut self.stream);
    }

    /// The side stream's handle (null before [`SideStream::create`]).
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Synchronizes the side stream, mapping a failure to `op`.
    pub(crate) fn sync(&self, op: DeviceOp) -> Result<(), DeviceError> {
        driver::stream::synchronize(op, self.stream)
    }

    /// Makes the side stream wait for the runtime stream's work so far (an event recorded on
    /// the runtime stream, waited on by the side stream) and returns it. During a capture this
    /// pulls the side stream into the capture. The context must be current.
    pub(crate) fn fork(&self, cx: &Context) -> Result<sys::CUstream, DeviceError> {
        driver::stream::record_event(DeviceOp::Fork, self.fork, cx.stream)?;
        driver::stream::wait_event(DeviceOp::Fork, self.stream, self.fork)?;
        Ok(self.stream)
    }

    /// Joins the side stream back: the runtime stream waits for the side stream's work so far
    /// (an event recorded on the side stream, waited on by the runtime stream). The context
    /// must be current.
    pub(crate) fn join(&self, cx: &Context) -> Result<(), DeviceError> {
        driver::stream::record_event(DeviceOp::Fork, self.join, self.stream)?;
        driver::stream::wait_event(DeviceOp::Fork, cx.stream, self.join)
    }
}
