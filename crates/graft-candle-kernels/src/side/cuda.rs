//! The side stream on CUDA: a non-blocking stream of the device's context and two events, the
//! fork (recorded on the device stream, waited on by the side) and the join (the reverse).
//! A lock keeps each record-and-wait pair whole when threads share the side stream, and
//! remembers whether the side stream has been forked since its last join: joining a side
//! stream that was never forked would make a capturing device stream wait on an event from
//! outside the capture, which CUDA refuses (a shared expert of more rows than the
//! matrix-vector kernel takes launches nothing there).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::Result;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::cuda_backend::{CudaDevice, WrapErr};

#[derive(Debug)]
pub(super) struct Side {
    /// The device's stream (candle's).
    main: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
    /// Whether work was forked onto the side stream since the last join.
    forked: Mutex<bool>,
}

impl Side {
    pub(super) fn new(device: &CudaDevice) -> Result<Side> {
        let main = device.cuda_stream();
        let context = main.context();
        Ok(Side {
            stream: context.new_stream().w()?,
            fork: context.new_event(None).w()?,
            join: context.new_event(None).w()?,
            main,
            forked: Mutex::new(false),
        })
    }

    /// Orders the side stream after the device stream's work so far; returns the side stream.
    pub(super) fn after_main(&self) -> Result<Arc<CudaStream>> {
        let mut forked = self.forked.lock().unwrap_or_else(PoisonError::into_inner);
        self.fork.record(&self.main).w()?;
        self.stream.wait(&self.fork).w()?;
        *forked = true;
        Ok(self.stream.clone())
    }

    /// Orders the device stream after the side stream's work so far (nothing to do when
    /// nothing was forked onto it since the last join).
    pub(super) fn join(&self) -> Result<()> {
        let mut forked = self.forked.lock().unwrap_or_else(PoisonError::into_inner);
        if *forked {
            self.join.record(&self.stream).w()?;
            self.main.wait(&self.join).w()?;
            *forked = false;
        }
        Ok(())
    }
}
