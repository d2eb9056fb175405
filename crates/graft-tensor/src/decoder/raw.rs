//! The raw-graph baseline: one decoder step captured as a plain graph with the device's sealed
//! capture calls (no tree, no liveness checks) and launched raw, what graft's benchmarks
//! compare replay against. Every call takes graft-core's token ([`CoreOnly`]), which only
//! graft's tests and benchmarks hold (`CoreOnly::for_tests_and_benches`, graft-core's
//! `test-support` feature).

use std::fmt;

use graft_core::backend::CoreOnly;
use graft_core::{Buffer, CaptureMode, Device};

use super::model::Decoder;
use super::state::KvState;
use crate::backend::Backend;
use crate::error::{Result, TensorError};
use crate::tensor::{Alloc, Keep, Tensor};

/// A decoder step captured once as a plain graph on the device, without graft's tree: the
/// raw-graph baseline. The graph reads the tokens from [`RawGraph::tokens`] and writes the
/// next tokens back there, so launching it repeatedly decodes. Holds every buffer the step
/// allocated (none may be reused while the graph lives).
pub struct RawGraph<D: Device> {
    device: D,
    graph: D::Graph,
    tokens: Tensor,
    bucket: usize,
    _kept: Vec<Buffer>,
}

impl<D: Device> fmt::Debug for RawGraph<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawGraph")
            .field("bucket", &self.bucket)
            .field("buffers", &self._kept.len())
            .finish_non_exhaustive()
    }
}

impl<D: Device> RawGraph<D> {
    /// The token buffer the graph reads and overwrites (`[bucket]` i32).
    pub fn tokens(&self) -> &Tensor {
        &self.tokens
    }

    /// Launches one step on `state` (the state it was captured with), with the token of the
    /// device's sealed launch.
    pub fn step(&self, core: &CoreOnly, state: &mut KvState) -> Result<()> {
        if state.bucket != self.bucket {
            return Err(TensorError::BucketMismatch {
                tokens: self.bucket,
                state: state.bucket,
            });
        }
        state.check_room()?;
        self.device.launch(core, &self.graph)?;
        state.steps += 1;
        Ok(())
    }
}

impl<D: Backend> Decoder<D> {
    /// Captures one step on `state` as a plain graph with the device's own capture calls (no
    /// tree, no liveness checks): the raw-graph baseline. Memory comes from `alloc` and is
    /// held by the returned graph. `tokens` (`[bucket]` i32) becomes the graph's token buffer:
    /// each launch reads it and writes the next tokens back into it. The capture runs
    /// nothing: the state's position is unchanged.
    pub fn capture_raw<A: Alloc<D> + ?Sized>(
        &self,
        core: &CoreOnly,
        alloc: &mut A,
        state: &KvState,
        tokens: &Tensor,
    ) -> Result<RawGraph<D>> {
        let kept = self.capture_open(core, alloc, state, tokens)?;
        let device = self.device.clone();
        let graph = device.end_capture(core)?;
        Ok(RawGraph {
            device,
            graph,
            tokens: tokens.clone(),
            bucket: state.bucket,
            _kept: kept,
        })
    }

    /// Begins a capture and records one step into it (the next tokens copied over `tokens`),
    /// leaving the capture open for the caller to end ([`Device::end_capture`], or
    /// [`Device::end_capture_into`] to update an executable in place); returns the buffers
    /// the step uses, which must outlive the graph. Aborts the capture on error.
    pub fn capture_open<A: Alloc<D> + ?Sized>(
        &self,
        core: &CoreOnly,
        alloc: &mut A,
        state: &KvState,
        tokens: &Tensor,
    ) -> Result<Vec<Buffer>> {
        self.check_tokens(state, tokens)?;
        let device = &self.device;
        device.begin_capture(core, CaptureMode::ThreadLocal)?;
        let mut keep = Keep::new(alloc);
        let body = (|| -> Result<()> {
            let next = self.forward(&mut keep, tokens, &state.pos, &self.weights, &state.kv)?;
            device.copy(core, tokens.ptr()?, next.ptr()?, tokens.bytes())?;
            Ok(())
        })();
        let kept = keep.into_kept();
        if let Err(e) = body {
            // The body's error is the one to report; the abort only cleans up.
            let _ = device.abort_capture(core);
            return Err(e);
        }
        Ok(kept)
    }
}
