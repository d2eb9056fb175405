//! Device loops of a candle body under graft: the flag tensor as an external buffer, the loop through graft-core's `Ctx::while_loop`, and the device's refusal kept for the engine.

use std::sync::Arc;

use candle_core::Tensor;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use graft_core::{BodyError, Buffer, Ctx, DeviceError, DeviceId, DevicePtr};

use graft_cuda::CudaDevice as GraftCuda;

use super::copy::checked_range;
use crate::looping::LoopCtx;

/// The loop context of one run of a body.
pub(crate) struct GraftLoops<'x, 'a> {
    pub(crate) ctx: &'x mut Ctx<'a, GraftCuda>,
    pub(crate) stream: &'x Arc<CudaStream>,
    pub(crate) device: DeviceId,
    pub(crate) step: &'x Arc<str>,
    /// The device error that ended a loop (a refusal the engine turns into a fallback).
    pub(crate) failed: &'x mut Option<DeviceError>,
}

impl LoopCtx for GraftLoops<'_, '_> {
    fn while_loop(
        &mut self,
        flag: &Tensor,
        body: &mut dyn FnMut() -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        let (addr, len) = checked_range(flag, self.stream, self.step, "loop flag", 0)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        // The caller holds the flag tensor for the whole call.
        let flag = Buffer::external(self.device, DevicePtr(addr), len, None);
        match self.ctx.while_loop(&flag, |_: &mut Ctx<'_, GraftCuda>| {
            body().map_err(BodyError::Framework)
        }) {
            Ok(()) => Ok(()),
            Err(BodyError::Framework(e)) => Err(e),
            Err(BodyError::Device(e)) => {
                let message = e.to_string();
                *self.failed = Some(e);
                Err(candle_core::Error::Msg(message))
            }
            Err(other) => Err(candle_core::Error::Msg(other.to_string())),
        }
    }
}
