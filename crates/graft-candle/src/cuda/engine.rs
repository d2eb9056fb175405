//! The engine behind a [`CandleGraft`](crate::CandleGraft) on a CUDA device: graft-core over
//! candle's own stream, with candle's tensors passed to the core as memory it does not own.
//!
//! A call hands graft-core (1) each input tensor as an external buffer used in place: the
//! body reads the caller's own tensor, and a replay patches the graph's kernels to the
//! tensor of its call; (2) each static tensor as an external static buffer; (3) the caller's
//! output tensors: each output costs one copy, the graph's last node for it, straight into a
//! fresh tensor allocated before the launch, or into the tensor the caller gave for it
//! (`call_into`). Inputs, statics and given outputs are bound per step position, and bound
//! anew only when the caller passes another tensor there, so a call on the same tensors as
//! the last one allocates nothing on the host. The body drops every candle tensor it makes
//! before the capture ends, so every recorded graph is self-contained.

use std::sync::Arc;

use candle_core::cuda_backend::CudaDevice as CandleCuda;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{Device, Tensor};
use graft_core::{
    BodyError, Buffer, CaptureViolation, Config, Ctx, Destinations, DeviceError, DeviceId,
    DevicePtr, FunctionId, FunctionSpec, Graft, Output, RunKind,
};
use graft_cuda::CudaDevice as GraftCuda;
use smallvec::SmallVec;

use super::copy::{checked_range, uninit_tensor};
use super::deferred::{classify_driver, silent_capture_failure, take_deferred_error};
use super::looping::GraftLoops;
use crate::diagnostics::Inspect;
use crate::error::Error;
use crate::graphed::attempt::{Attempt, AttemptError, Event, transition};
use crate::graphed::bindings::Bindings;
use crate::graphed::classify::classify;
use crate::graphed::keys::push_shape_keys;
use crate::graphed::outcome::{call_error, step_outcome};
use crate::graphed::refusals::Refusals;
use crate::looping::Loops;
use crate::refusal::Uncapturable;
use crate::step::{Call, OutputMeta, Step, StepInfo, describe};

/// graft over one candle CUDA device.
pub(crate) struct CudaEngine {
    graft: Graft<GraftCuda, OutputMeta>,
    candle: CandleCuda,
    stream: Arc<CudaStream>,
    device: DeviceId,
    /// Per step, its static tensors as bound (see [`Bindings::bind`]): buffers that keep
    /// their tensors, so their memory stays allocated while graphs may use it.
    statics: Bindings<Buffer>,
    /// Per step, its input tensors as bound: buffers that do not keep them (the caller holds
    /// each for its call).
    inputs: Bindings<Buffer>,
    /// Per step, the output tensors given to `call_into` as bound (the caller holds them).
    given: Bindings<Buffer>,
    /// Scratch: the call's inputs, made contiguous.
    contiguous: Vec<Tensor>,
    /// Per step and keys, the operation that made a signature eager, for the outcome.
    refusals: Refusals,
    /// Scratch: the keys of the call in progress.
    keys: Vec<u64>,
    /// Scratch: graft's outputs (the caller's tensors are in `Allocator::made`).
    outs: Vec<Output<OutputMeta>>,
    /// Scratch: the call's inputs then statics as graft takes them, empty between calls (a
    /// model's hundreds of statics would otherwise cost an allocation a call; see `reuse`).
    all: Vec<&'static Buffer>,
    /// graft-cuda's handle on candle's stream (a clone of graft's device): asks whether a
    /// recording's capture was invalidated. Declared last, so dropped after `graft` (and with
    /// it every graph): trims the graph memory those graphs held.
    cuda: TrimOnDrop,
}

/// A graft-cuda device that trims the GPU's graph memory when dropped
/// (`CudaDevice::trim_graph_memory`): memory no graph that is executing or scheduled uses goes
/// back to the OS.
struct TrimOnDrop(GraftCuda);

impl Drop for TrimOnDrop {
    fn drop(&mut self) {
        if let Err(error) = self.0.trim_graph_memory() {
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

/// The caller's output tensors of one call, when graft asks for them (before the launch of a
/// replay or a recording, after the body of a warmup or eager run): allocated, or the
/// tensors the caller gave (`call_into`) as bound.
struct Allocator<'e> {
    candle: &'e CandleCuda,
    stream: &'e Arc<CudaStream>,
    device: DeviceId,
    step: &'e Arc<str>,
    made: Vec<Tensor>,
    /// The tensors given, for `call_into`, and where their buffers are bound (per step).
    given: Option<(&'e [Tensor], &'e Bindings<Buffer>, usize)>,
    /// A given tensor that does not match its output.
    mismatch: Option<Error>,
}

impl Destinations<OutputMeta, candle_core::Error> for Allocator<'_> {
    fn destination(
        &mut self,
        index: usize,
        meta: &OutputMeta,
        bytes: usize,
    ) -> Result<Buffer, candle_core::Error> {
        if let Some((tensors, bindings, step)) = self.given {
            let t = tensors.get(index);
            if let (Some(t), Some(b)) = (t, bindings.get(step, index))
                && t.dtype() == meta.dtype
                && t.shape() == &*meta.shape
                && t.is_contiguous()
                && b.len() == bytes
            {
                return Ok(b.clone());
            }
            self.mismatch = Some(Error::OutputMismatch {
                step: self.step.clone(),
                position: index,
                returned: format!("{:?} {:?}", meta.dtype, meta.shape),
                given: describe(t),
            });
            candle_core::bail!("output {index} of {} does not match its tensor", self.step);
        }
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

/// What one run of the body needs of the engine besides graft's context.
struct Env<'e> {
    candle: &'e CandleCuda,
    stream: &'e Arc<CudaStream>,
    cuda: &'e GraftCuda,
    device: DeviceId,
    step: &'e Arc<str>,
}

impl CudaEngine {
    /// graft over `device` when it is a CUDA device; `None` on any other device.
    pub(crate) fn open(device: &Device, config: Config) -> Result<Option<CudaEngine>, Error> {
        match device {
            Device::Cuda(cuda) => CudaEngine::new(cuda, config).map(Some),
            _ => Ok(None),
        }
    }

    fn new(candle: &CandleCuda, config: Config) -> Result<CudaEngine, Error> {
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
            graft: Graft::new(device.clone(), config),
            candle: candle.clone(),
            stream,
            device: id,
            statics: Bindings::default(),
            inputs: Bindings::default(),
            given: Bindings::default(),
            contiguous: Vec::new(),
            refusals: Refusals::default(),
            keys: Vec::new(),
            outs: Vec::new(),
            all: Vec::new(),
            cuda: TrimOnDrop(device),
        })
    }

    /// Makes graft one rank of a tensor-parallel group (graft-core's `Graft::join`).
    pub(crate) fn join(&mut self, member: graft_core::Member) {
        self.graft.join(member);
    }

    pub(crate) fn register(&mut self, name: &str, spec: FunctionSpec) -> FunctionId {
        self.statics.add_step();
        self.inputs.add_step();
        self.given.add_step();
        self.graft.register(name, spec)
    }

    /// Takes the error cudarc deferred, if any (see [`crate::CandleGraft::discard`]).
    pub(crate) fn take_deferred_error(&self) {
        take_deferred_error(&self.stream);
    }

    /// graft's diagnostics of this engine.
    pub(crate) fn inspect(&self) -> &dyn Inspect {
        &self.graft
    }

    /// Starts a new step of graft's tree.
    pub(crate) fn mark_step_begin(&mut self) {
        self.graft.mark_step_begin();
    }

    /// Guards the next call that would replay.
    pub(crate) fn guard_next_call(&mut self) {
        self.graft.guard_next_call();
    }

    /// Calls `step`: its outputs as fresh tensors in [`Step::outputs`], or, with `into`,
    /// written into those tensors (one per output, of its dtype and shape) with
    /// [`Step::outputs`] empty.
    pub(crate) fn call<F>(
        &mut self,
        step: usize,
        info: &StepInfo,
        call: Call<'_>,
        mut body: F,
    ) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
    {
        let Call {
            inputs,
            statics,
            keys,
            into,
        } = call;
        let name = &info.name;
        let function = info.function.ok_or(Error::UnknownStep { id: step })?;
        // Inputs contiguous (an eager copy only for those that are not).
        self.contiguous.clear();
        for t in inputs {
            self.contiguous
                .push(t.contiguous().map_err(|source| Error::Candle {
                    step: name.clone(),
                    what: "making an input contiguous",
                    source,
                })?);
        }
        self.keys.clear();
        self.keys.extend_from_slice(keys);
        self.keys.push(precision_key());
        for t in &self.contiguous {
            push_shape_keys(&mut self.keys, t);
        }
        let (stream, device) = (&self.stream, self.device);
        self.statics.bind(step, statics, |position, t| {
            let (addr, len) = checked_range(t, stream, name, "static", position)?;
            // The buffer keeps the tensor, so its memory stays allocated while it is bound.
            let buffer = Buffer::external(device, DevicePtr(addr), len, Some(Box::new(t.clone())));
            buffer.mark_static();
            Ok::<_, Error>(buffer)
        })?;
        // graft tells statics apart by address and length: their layouts are keys.
        self.keys.push(self.statics.layout_key(step));
        let contiguous: SmallVec<[&Tensor; 8]> = self.contiguous.iter().collect();
        self.inputs.bind(step, &contiguous, |position, t| {
            let (addr, len) = checked_range(t, stream, name, "input", position)?;
            // The caller holds the tensor for every call that passes it.
            let b = Buffer::external(device, DevicePtr(addr), len, None);
            b.mark_in_place();
            Ok::<_, Error>(b)
        })?;
        if let Some(into) = into {
            let given: SmallVec<[&Tensor; 8]> = into.iter().collect();
            self.given.bind(step, &given, |position, t| {
                let (addr, len) = checked_range(t, stream, name, "output", position)?;
                // The caller holds the tensor while graft writes it.
                Ok::<_, Error>(Buffer::external(device, DevicePtr(addr), len, None))
            })?;
        }
        let mut all = reuse(std::mem::take(&mut self.all));
        all.extend(self.inputs.buffers(step).chain(self.statics.buffers(step)));

        let mut allocator = Allocator {
            candle: &self.candle,
            stream,
            device,
            step: name,
            made: Vec::new(),
            given: into.map(|tensors| (tensors, &self.given, step)),
            mismatch: None,
        };
        let env = Env {
            candle: &self.candle,
            stream,
            cuda: &self.cuda.0,
            device,
            step: name,
        };
        let mut attempt = Attempt::Clean;
        let tensors = &self.contiguous;
        let result = self.graft.call_owned(
            function,
            &all,
            &self.keys,
            |ctx: &mut Ctx<'_, GraftCuda>| run_body(ctx, &mut attempt, &mut body, tensors, &env),
            &mut allocator,
            &mut self.outs,
        );
        self.all = reuse(all);
        let delivered = self.outs.len();
        self.outs.clear();
        if matches!(attempt, Attempt::Refused { .. }) {
            // The body did not run again after its refusal: what the failed capture left is
            // taken here, not by the next unrelated candle call.
            take_deferred_error(stream);
        }
        if let Attempt::StateLost { cause } = attempt {
            // The stream must have left the capture and the context must still work.
            stream.synchronize().map_err(super::driver(
                "checking the stream after a failed recording",
            ))?;
            self.refusals.remember(step, &self.keys, cause.clone());
            return Err(Error::StateLost {
                step: name.clone(),
                cause,
            });
        }
        if let Some(mismatch) = allocator.mismatch {
            return Err(mismatch);
        }
        let outcome = result.map_err(|e| call_error(name, e))?;
        if let Some(into) = into
            && into.len() > delivered
        {
            // More tensors given than the body returns: the extra ones were not written.
            return Err(Error::OutputMismatch {
                step: name.clone(),
                position: delivered,
                returned: describe(None),
                given: describe(into.get(delivered)),
            });
        }
        let (refusals, keys) = (&mut self.refusals, &self.keys);
        let outcome = step_outcome(outcome, |reason| {
            refusals.eager_cause(step, keys, reason, attempt.refusal().cloned())
        });
        Ok(Step {
            outputs: allocator.made,
            outcome,
        })
    }
}

/// `v` emptied, as references of another lifetime, in the same allocation: std collects a
/// mapped `vec::IntoIter` in place where the two element types have one layout, as these do
/// (the map never runs: the vector is empty).
fn reuse<'b, T>(mut v: Vec<&T>) -> Vec<&'b T> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// One run of the body under graft (a warmup, a recording, an eager run). A run after a
/// refused recording first checks what the failed capture left, and a body whose state it lost
/// does not run; a recording the capture refuses moves `attempt` and hands graft-core the
/// capture failure, so it falls back to running the body eagerly.
fn run_body<F>(
    ctx: &mut Ctx<'_, GraftCuda>,
    attempt: &mut Attempt,
    body: &mut F,
    inputs: &[Tensor],
    env: &Env<'_>,
) -> Result<Vec<Output<OutputMeta>>, BodyError<candle_core::Error>>
where
    F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
{
    if let Attempt::Refused { op } = attempt {
        // The failed capture's leftovers are checked, not trusted: a free of a tensor made
        // outside the step means the body replaced state it keeps with tensors whose work
        // never ran, and running it again would read them.
        let freed = |op: &Uncapturable| matches!(op, Uncapturable::FreedOutside { .. });
        let freed_outside =
            freed(op) || take_deferred_error(env.stream).as_ref().is_some_and(freed);
        transition(attempt, Event::Checked { freed_outside }).map_err(lifecycle)?;
    }
    if matches!(attempt, Attempt::StateLost { .. }) {
        return Err(BodyError::Framework(candle_core::Error::Msg(
            "not run again: the failed recording left the body's state invalid".into(),
        )));
    }
    let recording = ctx.kind() == RunKind::Recording;
    // candle serves its small constant uploads (kernel layout arrays) from a cache inside
    // captures while this guard lives (filled by the warmups); it also makes candle refuse
    // host copies in a capture then. An eager run needs none of it, and pays for it: a lookup
    // and a capture-status query per upload.
    let _cache = (ctx.kind() != RunKind::Eager).then(|| env.candle.enable_cuda_graph_htod_cache());
    let mut failed = None;
    let ran = body(
        inputs,
        &mut Loops {
            graft: Some(&mut GraftLoops {
                ctx,
                stream: env.stream,
                device: env.device,
                step: env.step,
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
            if recording && let Some(op) = classify(&error, classify_driver) {
                return Err(refuse(attempt, op, CaptureViolation::Unsupported));
            }
            return Err(BodyError::Framework(error));
        }
    };
    if recording && let Some(op) = silent_capture_failure(env.stream, env.cuda) {
        // A call inside the body broke the capture without returning an error.
        drop(produced);
        return Err(refuse(attempt, op, CaptureViolation::Invalidated));
    }
    external_outputs(env.device, env.stream, env.step, produced)
}

/// Moves `attempt` to the refusal of `op` and gives graft-core the capture failure to fall
/// back on.
fn refuse(
    attempt: &mut Attempt,
    op: Uncapturable,
    violation: CaptureViolation,
) -> BodyError<candle_core::Error> {
    let device_op = op.device_op();
    match transition(attempt, Event::Refused(op)) {
        Ok(()) => BodyError::Device(DeviceError::Capture {
            op: device_op,
            violation,
        }),
        Err(error) => lifecycle(error),
    }
}

/// A lifecycle move the engine should never ask for, as the body's error.
fn lifecycle(error: AttemptError) -> BodyError<candle_core::Error> {
    BodyError::Framework(candle_core::Error::wrap(error))
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
            shape: Arc::new(t.shape().clone()),
        };
        let buffer = Buffer::external(device, DevicePtr(addr), len, Some(Box::new(t)));
        outputs.push(Output::new(buffer, meta));
    }
    Ok(outputs)
}

/// candle's reduced-precision GEMM switches (TF32 for f32, reduced reductions for f16 and
/// bf16) as one key: candle reads them at every matmul it launches, so a recording holds the
/// GEMMs of the switches it was made under, and a call under others must record anew (as
/// PyTorch's compiled graphs guard on `allow_tf32`), not replay them.
fn precision_key() -> u64 {
    use candle_core::cuda::{
        gemm_reduced_precision_bf16, gemm_reduced_precision_f16, gemm_reduced_precision_f32,
    };
    u64::from(gemm_reduced_precision_f32())
        | u64::from(gemm_reduced_precision_f16()) << 1
        | u64::from(gemm_reduced_precision_bf16()) << 2
}

#[cfg(test)]
mod tests {
    use super::reuse;

    #[test]
    fn reuse_keeps_the_allocation() {
        let values = [1u64, 2, 3];
        let mut v: Vec<&u64> = Vec::with_capacity(400);
        v.extend(&values);
        let (at, capacity) = (v.as_ptr() as usize, v.capacity());
        let again: Vec<&'static u64> = reuse(v);
        assert!(again.is_empty());
        assert_eq!((again.as_ptr() as usize, again.capacity()), (at, capacity));
    }
}
