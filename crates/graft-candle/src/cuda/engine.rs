//! The engine behind a [`CandleGraft`](crate::CandleGraft) on a CUDA device: graft over
//! candle's own stream, with every recorded graph self-contained.
//!
//! A call: (1) the dynamic inputs are copied into input slots, candle tensors kept per
//! signature and allocated outside any capture, so a recorded graph reads them at fixed
//! addresses; (2) graft runs, records or replays the wrapped body, which hands the user's body
//! handles to the slots, copies each output into a buffer from `ctx.alloc` and drops every
//! candle tensor it made before returning, so all of candle's allocations inside a capture
//! are freed inside it; (3) each output buffer is copied into a fresh candle tensor the caller
//! owns, and dropped.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::CudaDevice as CandleCuda;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, sys};
use candle_core::{DType, Shape, Tensor};
use graft_core::{
    BodyError, CallError, CaptureViolation, Config, Ctx, Decision, DeviceError, DeviceOp,
    FunctionId, FunctionSpec, Graft, Outcome, Output, RunKind,
};
use graft_cuda::CudaDevice as GraftCuda;

use super::copy::{checked_range, copy, uninit_tensor};
use crate::error::Error;
use crate::refusal::{EagerCause, Uncapturable, classify};
use crate::runtime::{Step, StepInfo, StepOutcome, push_shape_keys};

/// What graft keeps per output of a recorded step: enough to make the candle tensor again on
/// a replay, without running the body.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OutputMeta {
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape.
    pub shape: Shape,
}

/// graft over one candle CUDA device.
pub(crate) struct CudaEngine {
    graft: Graft<GraftCuda, OutputMeta>,
    candle: CandleCuda,
    stream: Arc<CudaStream>,
    /// Per signature (step index first, then the keys), the input slots: one candle tensor per
    /// input, made on the signature's first call and kept for good, so the signature alone
    /// fixes their addresses. A few per step (one per bucket): searched linearly, the last one
    /// used first.
    slots: Vec<(Vec<u64>, Vec<Tensor>)>,
    /// The index in `slots` of the last signature called.
    last_slots: usize,
    /// Per signature, the operation that made it eager.
    refusals: HashMap<Vec<u64>, Uncapturable>,
    /// Scratch: the signature of the call in progress.
    signature: Vec<u64>,
    /// Scratch: graft's outputs.
    outs: Vec<Output<OutputMeta>>,
    /// Declared last, so dropped after `graft` (and with it every graph): gives the graph
    /// memory those graphs held back to the device.
    _trim: TrimOnDrop,
}

/// Trims the device's graph memory when dropped (`cuDeviceGraphMemTrim`): memory no graph
/// that is executing or scheduled uses goes back to the OS.
struct TrimOnDrop(Arc<CudaStream>);

impl Drop for TrimOnDrop {
    fn drop(&mut self) {
        let cu_device = self.0.context().cu_device();
        // SAFETY: `cu_device` is the device of the context `self.0` keeps alive; trimming
        // only releases graph memory no graph uses.
        let trimmed = unsafe { sys::cuDeviceGraphMemTrim(cu_device) }.result();
        if let Err(error) = trimmed {
            tracing::debug!(%error, "trimming graph memory after dropping the runtime failed");
        }
    }
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("graft", &self.graft)
            .field("signatures", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl CudaEngine {
    pub(crate) fn new(candle: &CandleCuda, config: Config) -> Result<CudaEngine, Error> {
        if candle.is_event_tracking() {
            // A device not made by crate::device: its tensors would record events into
            // captures. Turning tracking off now covers the tensors made from here on.
            super::prepare(candle);
        }
        let stream = candle.cuda_stream();
        let device = GraftCuda::from_stream(stream.clone()).map_err(|source| Error::Device {
            what: "opening graft's CUDA device on candle's stream",
            source,
        })?;
        Ok(CudaEngine {
            graft: Graft::new(device, config),
            candle: candle.clone(),
            stream: stream.clone(),
            slots: Vec::new(),
            last_slots: 0,
            refusals: HashMap::new(),
            signature: Vec::new(),
            outs: Vec::new(),
            _trim: TrimOnDrop(stream),
        })
    }

    pub(crate) fn register(&mut self, name: &str, spec: FunctionSpec) -> FunctionId {
        self.graft.register(name, spec)
    }

    pub(crate) fn graft(&self) -> &Graft<GraftCuda, OutputMeta> {
        &self.graft
    }

    pub(crate) fn graft_mut(&mut self) -> &mut Graft<GraftCuda, OutputMeta> {
        &mut self.graft
    }

    pub(crate) fn call<F>(
        &mut self,
        step: usize,
        info: &StepInfo,
        inputs: &[&Tensor],
        statics: &[&Tensor],
        keys: &[u64],
        mut body: F,
    ) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    {
        let name = &info.name;
        let function = info.function.ok_or(Error::UnknownStep { id: step })?;
        let candle_error = |what: &'static str| {
            let step = name.clone();
            move |source| Error::Candle {
                step: step.clone(),
                what,
                source,
            }
        };
        // Inputs contiguous (an eager copy only for those that are not).
        let mut contiguous = Vec::with_capacity(inputs.len());
        for t in inputs {
            contiguous.push(
                t.contiguous()
                    .map_err(candle_error("making an input contiguous"))?,
            );
        }
        let signature = &mut self.signature;
        signature.clear();
        signature.push(step as u64);
        signature.extend_from_slice(keys);
        for t in &contiguous {
            push_shape_keys(signature, t);
        }
        for (position, t) in statics.iter().enumerate() {
            let (addr, _) = checked_range(t, &self.stream, name, "static", position)?;
            signature.push(addr);
        }
        let hit = match self.slots.get(self.last_slots) {
            Some((known, _)) if known.as_slice() == signature.as_slice() => Some(self.last_slots),
            _ => self
                .slots
                .iter()
                .position(|(known, _)| known.as_slice() == signature.as_slice()),
        };
        self.last_slots = match hit {
            Some(index) => index,
            None => {
                let mut slots = Vec::with_capacity(contiguous.len());
                for t in &contiguous {
                    slots.push(
                        uninit_tensor(&self.candle, t.dtype(), t.shape())
                            .map_err(candle_error("allocating an input slot"))?,
                    );
                }
                self.slots.push((signature.clone(), slots));
                self.slots.len() - 1
            }
        };
        let slots = &self.slots[self.last_slots].1;
        for (position, (t, slot)) in contiguous.iter().zip(slots).enumerate() {
            let (src, bytes) = checked_range(t, &self.stream, name, "input", position)?;
            let (dst, _) = checked_range(slot, &self.stream, name, "input", position)?;
            copy(dst, src, bytes, &self.stream).map_err(|source| Error::Driver {
                what: "copying an input into its slot",
                source,
            })?;
        }

        let (candle, stream) = (&self.candle, &self.stream);
        let mut refusal: Option<Uncapturable> = None;
        let mut body_error: Option<candle_core::Error> = None;
        let mut clear_pending = false;
        // candle serves its small constant uploads (kernel layout arrays) from a cache inside
        // captures while this guard lives; it also makes candle refuse host copies then.
        let cache = candle.enable_cuda_graph_htod_cache();
        let result = self.graft.call_into(
            function,
            &[],
            &signature[1..],
            |ctx: &mut Ctx<'_, GraftCuda>| {
                if std::mem::take(&mut clear_pending) {
                    clear_cudarc_error(stream);
                }
                let recording = ctx.kind() == RunKind::Recording;
                let handles: Vec<Tensor> = slots.to_vec();
                let produced = match body(&handles) {
                    Ok(produced) => produced,
                    Err(error) => {
                        drop(handles);
                        if recording && let Some(op) = classify(&error) {
                            let op_kind = op.device_op();
                            refusal = Some(op);
                            clear_pending = true;
                            return Err(BodyError::Device(DeviceError::Capture {
                                op: op_kind,
                                violation: CaptureViolation::Unsupported,
                            }));
                        }
                        body_error = Some(error);
                        return Err(BodyError::Framework("the step's body failed".into()));
                    }
                };
                drop(handles);
                if recording && let Some(op) = silent_capture_failure(stream) {
                    // A call inside the body broke the capture without returning an error.
                    drop(produced);
                    let op_kind = op.device_op();
                    refusal = Some(op);
                    clear_pending = true;
                    return Err(BodyError::Device(DeviceError::Capture {
                        op: op_kind,
                        violation: CaptureViolation::Invalidated,
                    }));
                }
                stage_out(ctx, stream, produced)
            },
            &mut self.outs,
        );
        drop(cache);
        if clear_pending {
            clear_cudarc_error(stream);
        }
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(CallError::Body { source, .. }) => {
                self.outs.clear();
                return Err(match (body_error, source) {
                    (Some(source), _) => Error::Body {
                        step: name.clone(),
                        source,
                    },
                    (None, BodyError::Framework(inner)) => match inner.downcast::<Error>() {
                        Ok(ours) => *ours,
                        Err(other) => Error::Body {
                            step: name.clone(),
                            source: candle_core::Error::Msg(other.to_string()),
                        },
                    },
                    (None, source) => Error::Call(CallError::Body {
                        function: name.clone(),
                        source,
                    }),
                });
            }
            Err(CallError::Device { source, .. }) if source.op() == DeviceOp::GraphLaunch => {
                self.outs.clear();
                return Err(Error::Launch {
                    step: name.clone(),
                    source,
                });
            }
            Err(e) => {
                self.outs.clear();
                return Err(e.into());
            }
        };
        if let Some(op) = refusal {
            self.refusals.insert(self.signature.clone(), op);
        }
        let outcome = match outcome {
            Outcome::Replayed(node) => StepOutcome::Replayed(node),
            Outcome::Recorded(node) => StepOutcome::Recorded(node),
            Outcome::Warmup => StepOutcome::Warmup,
            Outcome::Eager => StepOutcome::Eager(self.eager_cause(name)),
        };
        let mut outputs = Vec::with_capacity(self.outs.len());
        for out in self.outs.drain(..) {
            let t = uninit_tensor(&self.candle, out.meta.dtype, &out.meta.shape)
                .map_err(candle_error("allocating an output tensor"))?;
            let (dst, bytes) = checked_range(&t, &self.stream, name, "output", outputs.len())?;
            let src = out.buffer.addr().map_err(graft_core::MemoryError::from)?.0;
            copy(dst, src, bytes, &self.stream).map_err(|source| Error::Driver {
                what: "copying an output into the caller's tensor",
                source,
            })?;
            outputs.push(t);
        }
        Ok(Step { outputs, outcome })
    }

    /// Why graft ran the current signature eagerly.
    fn eager_cause(&self, name: &str) -> EagerCause {
        if let Some(op) = self.refusals.get(self.signature.as_slice()) {
            return EagerCause::Uncapturable(op.clone());
        }
        self.graft
            .explain()
            .filter(|r| &*r.function == name)
            .filter_map(|r| match &r.decision {
                Decision::Eager(reason) => Some(reason.clone()),
                _ => None,
            })
            .last()
            .map_or(EagerCause::Unlogged, EagerCause::Graft)
    }
}

/// Copies each output into a buffer from graft's pool and drops the candle tensor, so no
/// candle allocation outlives the body.
fn stage_out(
    ctx: &mut Ctx<'_, GraftCuda>,
    stream: &Arc<CudaStream>,
    produced: Vec<Tensor>,
) -> Result<Vec<Output<OutputMeta>>, BodyError> {
    let mut outputs = Vec::with_capacity(produced.len());
    for (position, t) in produced.into_iter().enumerate() {
        let t = t.contiguous().map_err(framework)?;
        let (src, bytes) = checked_range(&t, stream, &Arc::from("the step"), "output", position)
            .map_err(|e| BodyError::Framework(Box::new(e)))?;
        let buffer = ctx.alloc(bytes)?;
        if bytes > 0 {
            copy(buffer.addr()?.0, src, bytes, stream).map_err(framework)?;
        }
        outputs.push(Output::new(
            buffer,
            OutputMeta {
                dtype: t.dtype(),
                shape: t.shape().clone(),
            },
        ));
    }
    Ok(outputs)
}

fn framework(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> BodyError {
    BodyError::Framework(e.into())
}

/// An operation that broke the capture of a body that returned normally: cudarc records the
/// errors of calls that cannot return one (the synchronize after a host read, a free) and the
/// capture may be invalidated. Called at the end of a recorded body, so what cudarc holds is
/// this body's.
fn silent_capture_failure(stream: &Arc<CudaStream>) -> Option<Uncapturable> {
    if let Err(error) = stream.context().check_err() {
        return Some(Uncapturable::CudaCall {
            error: format!("{:?}", error.0),
        });
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
    // SAFETY: the stream is live (held by `stream`) and `status` is a valid out-pointer.
    let queried = unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) };
    let invalidated = status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    (queried.result().is_ok() && invalidated).then(|| Uncapturable::CudaCall {
        error: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED".to_string(),
    })
}

/// After a capture candle's body broke, cudarc may hold an error it recorded on the way
/// (a free or synchronize inside the invalidated capture) and would return it from the next
/// unrelated call. That error belongs to the failed capture, which graft already handled.
fn clear_cudarc_error(stream: &Arc<CudaStream>) {
    if let Err(error) = stream.context().check_err() {
        tracing::debug!(%error, "cleared cudarc's error left by the failed capture");
    }
}
