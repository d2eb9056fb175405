//! The engine behind a [`CandleGraft`](crate::CandleGraft) on a CUDA device: graft-core over
//! candle's own stream, with candle's tensors passed to the core as memory it does not own.
//!
//! A call hands graft-core (1) each input tensor as an external buffer used in place: the
//! body reads the caller's own tensor, and a replay patches the graph's kernels to the
//! tensor of its call; (2) each static tensor as an external static buffer, bound once per
//! step position and re-bound only when the caller passes another tensor there; (3) an
//! allocator of the caller's output tensors: each output costs one copy, the graph's last
//! node for it, straight into a fresh tensor allocated before the launch. The body drops
//! every candle tensor it makes before the capture ends, so every recorded graph is
//! self-contained.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::CudaDevice as CandleCuda;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, sys};
use candle_core::{DType, Shape, Tensor, TensorId};
use graft_core::{
    BodyError, Buffer, CallError, CaptureViolation, Config, Ctx, Destinations, DeviceError,
    DeviceId, DevicePtr, EagerReason, FunctionId, FunctionSpec, Graft, Outcome, Output, RunKind,
};
use graft_cuda::CudaDevice as GraftCuda;

use super::copy::{checked_range, uninit_tensor};
use super::looping::GraftLoops;
use crate::error::Error;
use crate::looping::{How, Loops};
use crate::refusal::{EagerCause, Uncapturable, classify, deferred};
use crate::step::{Step, StepInfo, StepOutcome, push_shape_keys};

/// What graft keeps per output of a recorded step: enough to allocate the caller's tensor
/// on a replay, without running the body.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OutputMeta {
    /// The output's dtype.
    pub dtype: DType,
    /// The output's shape.
    pub shape: Shape,
}

/// One static tensor as bound to graft: the tensor (which keeps its memory alive while
/// graphs may use it) and graft's external buffer over it.
struct Bound {
    id: TensorId,
    buffer: Buffer,
}

/// The most eager signatures whose refusal [`CudaEngine`] remembers.
const MAX_REFUSALS: usize = 64;

/// graft over one candle CUDA device.
pub(crate) struct CudaEngine {
    graft: Graft<GraftCuda, OutputMeta>,
    candle: CandleCuda,
    stream: Arc<CudaStream>,
    device: DeviceId,
    /// Per step, its static tensors as bound (see [`CudaEngine::bind_statics`]).
    statics: Vec<Vec<Bound>>,
    /// Per step and keys, the operation that made a signature eager, for the outcome.
    refusals: HashMap<(usize, Vec<u64>), Uncapturable>,
    /// Scratch: the keys of the call in progress.
    keys: Vec<u64>,
    /// Scratch: graft's outputs (the caller's tensors are in `Allocator::made`).
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
            .field("steps", &self.statics.len())
            .finish_non_exhaustive()
    }
}

/// The caller's output tensors of one call, allocated when graft asks for them: before the
/// launch of a replay or a recording, after the body of a warmup or eager run.
struct Allocator<'e> {
    candle: &'e CandleCuda,
    stream: &'e Arc<CudaStream>,
    device: DeviceId,
    step: &'e Arc<str>,
    made: Vec<Tensor>,
}

impl Destinations<OutputMeta, candle_core::Error> for Allocator<'_> {
    fn destination(
        &mut self,
        index: usize,
        meta: &OutputMeta,
        bytes: usize,
    ) -> Result<Buffer, candle_core::Error> {
        let t = uninit_tensor(self.candle, meta.dtype, &meta.shape)?;
        let (addr, len) = checked_range(&t, self.stream, self.step, "output", index)
            .map_err(candle_core::Error::wrap)?;
        if len != bytes {
            candle_core::bail!(
                "output {index} of {} holds {bytes} bytes, but a {:?} tensor of shape {:?} holds {len}",
                self.step,
                meta.dtype,
                meta.shape
            );
        }
        self.made.push(t);
        // The tensor stays in `made` (then with the caller) while graft writes it.
        Ok(Buffer::external(self.device, DevicePtr(addr), len, None))
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
        let id = graft_core::Device::id(&device);
        Ok(CudaEngine {
            graft: Graft::new(device, config),
            candle: candle.clone(),
            stream: stream.clone(),
            device: id,
            statics: Vec::new(),
            refusals: HashMap::new(),
            keys: Vec::new(),
            outs: Vec::new(),
            _trim: TrimOnDrop(stream),
        })
    }

    pub(crate) fn register(&mut self, name: &str, spec: FunctionSpec) -> FunctionId {
        self.statics.push(Vec::new());
        self.graft.register(name, spec)
    }

    /// Takes the error cudarc deferred, if any (see [`crate::CandleGraft::discard`]).
    pub(crate) fn take_deferred_error(&self) {
        take_deferred_error(&self.stream);
    }

    pub(crate) fn graft(&self) -> &Graft<GraftCuda, OutputMeta> {
        &self.graft
    }

    pub(crate) fn graft_mut(&mut self) -> &mut Graft<GraftCuda, OutputMeta> {
        &mut self.graft
    }

    /// Makes the bound statics of `step` the tensors `statics`: a position keeps its buffer
    /// while the caller passes the same tensor there (one id comparison), and gets a new
    /// external static buffer over the tensor otherwise, so graft sees the new address and
    /// never replays a graph recorded with the old one.
    fn bind_statics(
        &mut self,
        step: usize,
        name: &Arc<str>,
        statics: &[&Tensor],
    ) -> Result<(), Error> {
        let bound = &mut self.statics[step];
        bound.truncate(statics.len());
        for (position, t) in statics.iter().enumerate() {
            if bound.get(position).is_some_and(|b| b.id == t.id()) {
                continue;
            }
            let (addr, len) = checked_range(t, &self.stream, name, "static", position)?;
            // The buffer keeps the tensor, so its memory stays allocated while it is bound.
            let buffer = Buffer::external(
                self.device,
                DevicePtr(addr),
                len,
                Some(Box::new((*t).clone())),
            );
            buffer.mark_static();
            let fresh = Bound { id: t.id(), buffer };
            match bound.get_mut(position) {
                Some(b) => *b = fresh,
                None => bound.push(fresh),
            }
        }
        Ok(())
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
        F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
    {
        let name = &info.name;
        let function = info.function.ok_or(Error::UnknownStep { id: step })?;
        // Inputs contiguous (an eager copy only for those that are not).
        let mut contiguous = Vec::with_capacity(inputs.len());
        for t in inputs {
            contiguous.push(t.contiguous().map_err(|source| Error::Candle {
                step: name.clone(),
                what: "making an input contiguous",
                source,
            })?);
        }
        self.keys.clear();
        self.keys.extend_from_slice(keys);
        for t in &contiguous {
            push_shape_keys(&mut self.keys, t);
        }
        self.bind_statics(step, name, statics)?;
        let mut dynamic = Vec::with_capacity(contiguous.len());
        for (position, t) in contiguous.iter().enumerate() {
            let (addr, len) = checked_range(t, &self.stream, name, "input", position)?;
            // The caller holds the tensor for the whole call.
            let b = Buffer::external(self.device, DevicePtr(addr), len, None);
            b.mark_in_place();
            dynamic.push(b);
        }
        let all: Vec<&Buffer> = dynamic
            .iter()
            .chain(self.statics[step].iter().map(|b| &b.buffer))
            .collect();

        let (candle, stream, device) = (&self.candle, &self.stream, self.device);
        let mut allocator = Allocator {
            candle,
            stream,
            device,
            step: name,
            made: Vec::new(),
        };
        let mut refusal: Option<Uncapturable> = None;
        let mut clear_pending = false;
        // A failed recording whose body replaced state it keeps: the call is not re-run.
        let mut state_lost = false;
        // candle serves its small constant uploads (kernel layout arrays) from a cache inside
        // captures while this guard lives; it also makes candle refuse host copies then.
        let cache = candle.enable_cuda_graph_htod_cache();
        let result = self.graft.call_owned(
            function,
            &all,
            &self.keys,
            |ctx: &mut Ctx<'_, GraftCuda>| {
                if std::mem::take(&mut clear_pending) {
                    // The failed capture's leftovers are checked, not trusted: a free of a
                    // tensor made outside the step means the body replaced state it keeps
                    // with tensors whose work never ran, and running it again would read them.
                    let freed = |op: &Uncapturable| matches!(op, Uncapturable::FreedOutside { .. });
                    state_lost |= refusal.as_ref().is_some_and(freed)
                        || take_deferred_error(stream).as_ref().is_some_and(freed);
                }
                if state_lost {
                    return Err(BodyError::Framework(candle_core::Error::Msg(
                        "not run again: the failed recording left the body's state invalid".into(),
                    )));
                }
                let recording = ctx.kind() == RunKind::Recording;
                let mut failed = None;
                let ran = body(
                    &contiguous,
                    &mut Loops {
                        how: How::Graft(&mut GraftLoops {
                            ctx,
                            stream,
                            device,
                            step: name,
                            failed: &mut failed,
                        }),
                    },
                );
                if ran.is_err()
                    && let Some(error) = failed
                {
                    // A loop the device refused: graft-core falls back with the reason.
                    return Err(BodyError::Device(error));
                }
                let produced = match ran {
                    Ok(produced) => produced,
                    Err(error) => {
                        if recording && let Some(op) = classify(&error) {
                            let op_kind = op.device_op();
                            refusal = Some(op);
                            clear_pending = true;
                            return Err(BodyError::Device(DeviceError::Capture {
                                op: op_kind,
                                violation: CaptureViolation::Unsupported,
                            }));
                        }
                        return Err(BodyError::Framework(error));
                    }
                };
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
                external_outputs(device, stream, name, produced)
            },
            &mut allocator,
            &mut self.outs,
        );
        drop(cache);
        self.outs.clear();
        if clear_pending {
            take_deferred_error(stream);
        }
        if state_lost {
            // The stream must have left the capture and the context must still work.
            stream.synchronize().map_err(|source| Error::Driver {
                what: "checking the stream after a failed recording",
                source,
            })?;
            let cause = refusal.unwrap_or(Uncapturable::FreedOutside {
                error: "CUDA_ERROR_INVALID_VALUE".to_string(),
            });
            self.remember_refusal(step, cause.clone());
            return Err(Error::StateLost {
                step: name.clone(),
                cause,
            });
        }
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(CallError::Body {
                source: BodyError::Framework(source),
                ..
            }) => {
                return Err(Error::Body {
                    step: name.clone(),
                    source,
                });
            }
            Err(CallError::Destination { error, .. }) => {
                return Err(Error::Candle {
                    step: name.clone(),
                    what: "allocating an output tensor",
                    source: error,
                });
            }
            Err(CallError::Device { source, .. })
                if source.op() == graft_core::DeviceOp::GraphLaunch =>
            {
                return Err(Error::Launch {
                    step: name.clone(),
                    source,
                });
            }
            Err(e) => return Err(Error::Call(Box::new(e))),
        };
        let outputs = allocator.made;
        let outcome = match outcome {
            Outcome::Replayed(node) => StepOutcome::Replayed(node),
            Outcome::Recorded(node) => StepOutcome::Recorded(node),
            Outcome::Warmup => StepOutcome::Warmup,
            Outcome::Eager(reason) => StepOutcome::Eager(self.eager_cause(step, reason, refusal)),
        };
        Ok(Step { outputs, outcome })
    }

    /// Why graft ran the call eagerly: the candle operation that broke the capture when
    /// graft-core's reason is that failure, else graft-core's reason.
    fn eager_cause(
        &mut self,
        step: usize,
        reason: EagerReason,
        refused_now: Option<Uncapturable>,
    ) -> EagerCause {
        if !matches!(reason, EagerReason::CaptureFailed { .. }) {
            return EagerCause::Graft(reason);
        }
        if let Some(op) = refused_now {
            self.remember_refusal(step, op.clone());
            return EagerCause::Uncapturable(op);
        }
        match self.refusals.get(&(step, self.keys.clone())) {
            Some(op) => EagerCause::Uncapturable(op.clone()),
            None => EagerCause::Graft(reason),
        }
    }

    /// Keeps the operation that made the current call's signature eager, for the outcomes of
    /// its later calls. At most [`MAX_REFUSALS`] are kept (a step whose keys change on every
    /// call would otherwise grow the map forever); a signature whose entry was dropped still
    /// runs eagerly, with graft-core's reason.
    fn remember_refusal(&mut self, step: usize, op: Uncapturable) {
        let key = (step, self.keys.clone());
        if self.refusals.len() >= MAX_REFUSALS && !self.refusals.contains_key(&key) {
            let victim = self.refusals.keys().next().cloned();
            if let Some(victim) = victim {
                self.refusals.remove(&victim);
            }
        }
        self.refusals.insert(key, op);
    }
}

/// The body's outputs as external buffers that own their tensors: graft copies each into
/// the caller's tensor and then drops it, inside the capture when recording, so no candle
/// allocation of a recording outlives it.
fn external_outputs(
    device: DeviceId,
    stream: &Arc<CudaStream>,
    step: &Arc<str>,
    produced: Vec<Tensor>,
) -> Result<Vec<Output<OutputMeta>>, BodyError<candle_core::Error>> {
    let mut outputs = Vec::with_capacity(produced.len());
    for (position, t) in produced.into_iter().enumerate() {
        let t = t.contiguous().map_err(BodyError::Framework)?;
        let (addr, len) = checked_range(&t, stream, step, "output", position)
            .map_err(|e| BodyError::Framework(candle_core::Error::wrap(e)))?;
        let meta = OutputMeta {
            dtype: t.dtype(),
            shape: t.shape().clone(),
        };
        let buffer = Buffer::external(device, DevicePtr(addr), len, Some(Box::new(t)));
        outputs.push(Output::new(buffer, meta));
    }
    Ok(outputs)
}

/// An operation that broke the capture of a body that returned normally: cudarc records the
/// errors of calls that cannot return one (the synchronize after a host read, a free) and the
/// capture may be invalidated. Called at the end of a recorded body, so what cudarc holds is
/// this body's.
fn silent_capture_failure(stream: &Arc<CudaStream>) -> Option<Uncapturable> {
    if let Err(error) = stream.context().check_err() {
        return Some(deferred(error.0).unwrap_or(Uncapturable::CudaCall {
            error: format!("{:?}", error.0),
        }));
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
/// unrelated call. That error belongs to the failed capture: it is taken here, and what it
/// says about the body returned.
fn take_deferred_error(stream: &Arc<CudaStream>) -> Option<Uncapturable> {
    let error = stream.context().check_err().err()?;
    tracing::debug!(%error, "took cudarc's error left by the failed capture");
    Some(deferred(error.0).unwrap_or(Uncapturable::CudaCall {
        error: format!("{:?}", error.0),
    }))
}
