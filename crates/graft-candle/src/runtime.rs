//! [`CandleGraft`]: a candle step function under graft. Candle tensors in, candle tensors out;
//! on a CUDA device the step is warmed up, recorded and replayed by graft, anywhere else it
//! runs eagerly with a typed reason.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::cuda::GraphEngine;
use crate::diagnostics::Diagnostics;
use crate::error::Error;
use crate::looping::Loops;
use crate::refusal::EagerCause;
use crate::step::{Call, Step, StepId, StepInfo, StepOutcome};

/// Writes an eager call's `outputs` into the tensors `into` given for them (`call_into`): each
/// must be of its output's dtype and shape, one per output.
fn write_into(step: &Arc<str>, outputs: Vec<Tensor>, into: &[Tensor]) -> Result<(), Error> {
    for position in 0..outputs.len().max(into.len()) {
        let (output, given) = (outputs.get(position), into.get(position));
        match (output, given) {
            (Some(o), Some(g))
                if o.dtype() == g.dtype() && o.shape() == g.shape() && g.is_contiguous() =>
            {
                // Flattened, a contiguous tensor is a view of the same storage.
                let (o, g) = (o.flatten_all(), g.flatten_all());
                o.and_then(|o| g.and_then(|g| g.slice_set(&o, 0, 0)))
                    .map_err(|source| Error::Candle {
                        step: step.clone(),
                        what: "writing an output into the tensor given for it",
                        source,
                    })?;
            }
            _ => {
                return Err(Error::OutputMismatch {
                    step: step.clone(),
                    position,
                    returned: crate::step::describe(output),
                    given: crate::step::describe(given),
                });
            }
        }
    }
    Ok(())
}

/// Where calls run: the two backends behind [`CandleGraft`].
#[derive(Debug)]
enum Engine {
    /// Not a CUDA device (or a build without the `cuda` feature): every call runs the body
    /// directly.
    Eager(EagerCause),
    /// graft over candle's CUDA stream.
    Graphed(Box<GraphEngine>),
}

/// graft for candle: runs registered step functions of candle tensors under graft's graph
/// tree on a candle CUDA device (see the crate documentation for the contract), and eagerly
/// on any other device.
#[derive(Debug)]
pub struct CandleGraft {
    device: Device,
    engine: Engine,
    steps: Vec<StepInfo>,
}

impl CandleGraft {
    /// A runtime for `device` with graft's default configuration. On a CUDA device, that
    /// device must have been made by [`crate::device`] (its own stream, event tracking off).
    pub fn new(device: &Device) -> Result<CandleGraft, Error> {
        CandleGraft::with_config(device, graft_core::Config::default())
    }

    /// A runtime for `device` with `config` (warmups, re-record limit, allow-list, ...).
    pub fn with_config(device: &Device, config: graft_core::Config) -> Result<CandleGraft, Error> {
        let engine = match GraphEngine::open(device, config)? {
            Some(engine) => Engine::Graphed(Box::new(engine)),
            None => Engine::Eager(EagerCause::NotCuda {
                location: format!("{:?}", device.location()),
            }),
        };
        Ok(CandleGraft {
            device: device.clone(),
            engine,
            steps: Vec::new(),
        })
    }

    /// The candle device calls run on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether calls run under graft (a CUDA device in a `cuda` build) rather than eagerly.
    pub fn is_graphed(&self) -> bool {
        !matches!(self.engine, Engine::Eager(_))
    }

    /// Makes this runtime one rank of a tensor-parallel group (graft-core's `Graft::join`):
    /// every recording then ends with a vote of all ranks, so that all keep it, all fall
    /// back to eager, or all fail, before any rank launches it (make the member with
    /// [`crate::cuda::TpComm::member`]). Join before the first call. A runtime that runs
    /// eagerly (not a CUDA device, or a build without `cuda`) records nothing to agree on
    /// and drops the member.
    pub fn join(&mut self, member: graft_core::Member) {
        if let Engine::Graphed(engine) = &mut self.engine {
            engine.join(member);
        }
    }

    /// Registers a step (an inference function) and returns its id. Names appear in errors,
    /// logs and graft's diagnostics.
    pub fn register(&mut self, name: &str) -> StepId {
        self.register_with(
            name,
            graft_core::FunctionSpec::inference(Vec::<usize>::new()),
        )
    }

    /// Registers a step recorded at `buckets`: every call passes its bucket as `keys[0]`
    /// (pad the batch with [`crate::pad`]); a size above the largest bucket runs eagerly.
    pub fn register_bucketed(&mut self, name: &str, buckets: graft_core::Buckets) -> StepId {
        let spec = graft_core::FunctionSpec::inference(Vec::<usize>::new()).buckets(buckets);
        self.register_with(name, spec)
    }

    /// Registers a step with a full graft spec: a training step's mode (`Mode::Forward` for a
    /// micro-batch step whose gradients still await their update, `Mode::Backward` for the
    /// update that consumes them: graft's pending-backward rule), warmups, buckets, a graph
    /// limit. Static positions in the spec are ignored: pass statics to [`CandleGraft::call`].
    /// `never_copy_inputs` is always set: the body reads the caller's tensors, so an input
    /// the graph cannot follow is recorded again where it moves, never copied.
    pub fn register_with(&mut self, name: &str, spec: graft_core::FunctionSpec) -> StepId {
        // The body reads the caller's tensors, never graft's handles: an input graft copied
        // into a placeholder would not be read (the recording would keep reading the tensor of
        // the call that recorded it).
        let spec = graft_core::FunctionSpec {
            static_inputs: Vec::new(),
            never_copy_inputs: true,
            ..spec
        };
        let name: Arc<str> = Arc::from(name);
        let function = match &mut self.engine {
            Engine::Eager(_) => None,
            Engine::Graphed(engine) => Some(engine.register(&name, spec)),
        };
        self.steps.push(StepInfo { name, function });
        StepId(self.steps.len() - 1)
    }

    /// Calls step `step`: `inputs` are the tensors that change from call to call (tokens);
    /// `body` gets them and uses them in place, as an eager call would: on a replay graft
    /// patches the recorded graph's kernels to the tensors of this call, so an input costs no
    /// copy (on a CUDA device a non-contiguous input is first made contiguous, by an eager
    /// copy outside the graph; run eagerly, the body gets the caller's tensors as they are). `statics` are the tensors `body` captures by reference and reads
    /// or writes in place (weights, KV caches, positions): graft binds them once per
    /// position and checks per call only that the same tensors are passed (a tensor id
    /// comparison); another tensor at a position means a new recording, never a stale
    /// address. `keys` are integers of your own that must match for a replay (the bucket,
    /// for one). The inputs' dtypes and shapes are keys too, and so are candle's
    /// reduced-precision GEMM switches (`candle_core::cuda::set_gemm_reduced_precision_f32`
    /// and its f16 and bf16 twins): a step called after one is flipped warms up and records
    /// again.
    ///
    /// `body` is ordinary candle code. Under graft it may run (warmup, recording, eager
    /// fallback) or not (replay); it must not read results to the host, upload host data
    /// that changes between calls, or keep any tensor it makes beyond its return. A body
    /// that does one of the first two runs eagerly from then on with the operation as the
    /// reason ([`EagerCause::Uncapturable`]). Each output is a fresh tensor the caller owns,
    /// written by the graph's last copy for it.
    pub fn call<F>(
        &mut self,
        step: StepId,
        inputs: &[&Tensor],
        statics: &[&Tensor],
        keys: &[u64],
        mut body: F,
    ) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    {
        self.call_looping(step, inputs, statics, keys, |inputs, _| body(inputs))
    }

    /// [`CandleGraft::call`] whose body may loop on the device: it also gets [`Loops`], whose
    /// `while_loop` is recorded as one CUDA conditional node (a replay runs every iteration
    /// with no host round trip) and runs on the host when the step runs eagerly. See
    /// [`Loops::while_loop`] for what a loop's body may do.
    pub fn call_looping<F>(
        &mut self,
        step: StepId,
        inputs: &[&Tensor],
        statics: &[&Tensor],
        keys: &[u64],
        body: F,
    ) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
    {
        let call = Call {
            inputs,
            statics,
            keys,
            into: None,
        };
        self.run(step, call, body)
    }

    /// [`CandleGraft::call`] writing the outputs into `outputs`, tensors the caller made once
    /// (one per output, of the body's dtype and shape) and passes again on every call: no
    /// output tensor is allocated, and a call on the same tensors (inputs, statics, outputs)
    /// as the last call of its step allocates nothing on the host (a decode loop whose tokens
    /// live in one tensor: its replays cost graft's launch and a few compares). An output
    /// tensor of another dtype or shape, or one too many or too few, is
    /// [`Error::OutputMismatch`]. The outputs are written in stream order, as any candle op
    /// writes its result. Returns what the call did.
    pub fn call_into<F>(
        &mut self,
        step: StepId,
        inputs: &[&Tensor],
        statics: &[&Tensor],
        keys: &[u64],
        outputs: &[Tensor],
        mut body: F,
    ) -> Result<StepOutcome, Error>
    where
        F: FnMut(&[Tensor]) -> candle_core::Result<Vec<Tensor>>,
    {
        let call = Call {
            inputs,
            statics,
            keys,
            into: Some(outputs),
        };
        let run = self.run(step, call, |inputs, _| body(inputs))?;
        Ok(run.outcome)
    }

    /// A call, its outputs fresh or written into the tensors `call.into` gives.
    fn run<F>(&mut self, step: StepId, call: Call<'_>, body: F) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
    {
        let info = self
            .steps
            .get(step.0)
            .ok_or(Error::UnknownStep { id: step.0 })?;
        check_devices(&self.device, &info.name, "input", call.inputs)?;
        check_devices(&self.device, &info.name, "static", call.statics)?;
        match &mut self.engine {
            Engine::Eager(why) => {
                let mut body = body;
                let owned: Vec<Tensor> = call.inputs.iter().map(|&t| t.clone()).collect();
                let mut loops = Loops { graft: None };
                let outputs = body(&owned, &mut loops).map_err(|source| Error::Body {
                    step: info.name.clone(),
                    source,
                })?;
                // An eager run has no signature: the keys do not matter.
                let _ = call.keys;
                let outputs = match call.into {
                    Some(into) => {
                        write_into(&info.name, outputs, into)?;
                        Vec::new()
                    }
                    None => outputs,
                };
                Ok(Step {
                    outputs,
                    outcome: StepOutcome::Eager(why.clone()),
                })
            }
            Engine::Graphed(engine) => engine.call(step.0, info, call, body),
        }
    }

    /// Drops state that a failed recording left invalid (`Error::StateLost`). Its tensors
    /// made inside the abandoned capture were never allocated for real, so CUDA refuses to
    /// free them, and cudarc would report that refusal from the next, unrelated candle call:
    /// it is taken here instead. Any other value is simply dropped.
    pub fn discard<T>(&self, state: T) {
        drop(state);
        if let Engine::Graphed(engine) = &self.engine {
            engine.take_deferred_error();
        }
    }

    /// What kept `step` from replaying, if graft found it: a key, an input's size or a
    /// static's address that changed on each of 8 or more calls in a row (graft warns once
    /// too). Positions count the step's inputs first, then its statics; keys are yours,
    /// followed by the dtype and dims of each input. `None` when calls run eagerly.
    pub fn churn(&self, step: StepId) -> Option<graft_core::Churn> {
        let function = self.steps.get(step.0)?.function?;
        self.graft()?.churn(function)
    }

    /// Starts a new step of graft's tree (optional for inference loops; see graft's
    /// `Graft::mark_step_begin`).
    pub fn mark_step_begin(&mut self) {
        if let Engine::Graphed(engine) = &mut self.engine {
            engine.mark_step_begin();
        }
    }

    /// Guards the next call that would replay: graft captures the step again and compares the
    /// capture with its recording (see graft's `Graft::guard_next_call` and `Config::guards`).
    /// Nothing when calls run eagerly.
    pub fn guard_next_call(&mut self) {
        if let Engine::Graphed(engine) = &mut self.engine {
            engine.guard_next_call();
        }
    }

    /// The diagnostics of the graft runtime underneath (`explain`, `stats`, `dump_text`,
    /// `nodes`, `memory_report`); `None` when calls run eagerly.
    pub fn graft(&self) -> Option<Diagnostics<'_>> {
        match &self.engine {
            Engine::Graphed(engine) => Some(Diagnostics::new(engine.inspect())),
            Engine::Eager(_) => None,
        }
    }
}

/// Every tensor of `tensors` must be on `device`.
fn check_devices(
    device: &Device,
    step: &Arc<str>,
    role: &'static str,
    tensors: &[&Tensor],
) -> Result<(), Error> {
    for (position, t) in tensors.iter().enumerate() {
        if !t.device().same_device(device) {
            let (found, expected) = (t.device().location(), device.location());
            if found == expected {
                return Err(Error::OtherDeviceOfGpu {
                    step: step.clone(),
                    role,
                    position,
                    location: format!("{found:?}"),
                });
            }
            return Err(Error::WrongDevice {
                step: step.clone(),
                role,
                position,
                expected: format!("{expected:?}"),
                found: format!("{found:?}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_runs_eagerly_with_a_typed_reason() {
        let mut g = CandleGraft::new(&Device::Cpu).unwrap();
        assert!(!g.is_graphed());
        let step = g.register("double");
        let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
        let out = g
            .call(step, &[&x], &[], &[], |ins| Ok(vec![(&ins[0] * 2.0)?]))
            .unwrap();
        assert!(matches!(
            out.outcome,
            StepOutcome::Eager(EagerCause::NotCuda { .. })
        ));
        assert_eq!(out.outputs[0].to_vec1::<f32>().unwrap(), [2., 4., 6.]);
        g.mark_step_begin();
        assert!(g.graft().is_none());
        assert!(g.churn(step).is_none());
    }

    #[test]
    fn unknown_steps_and_body_errors_are_typed() {
        let mut g = CandleGraft::new(&Device::Cpu).unwrap();
        let e = g
            .call(StepId(3), &[], &[], &[], |_| Ok(Vec::new()))
            .unwrap_err();
        assert!(matches!(e, Error::UnknownStep { id: 3 }), "{e}");
        let step = g.register("fails");
        let e = g
            .call(step, &[], &[], &[], |_| {
                candle_core::bail!("shape mismatch in the body")
            })
            .unwrap_err();
        assert!(
            matches!(&e, Error::Body { step, .. } if &**step == "fails"),
            "{e}"
        );
        assert!(e.to_string().contains("shape mismatch"), "{e}");
    }
}
