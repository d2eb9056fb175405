//! The errors of graft-candle, with what happened and what to do.

use std::sync::Arc;

/// Errors of [`CandleGraft`](crate::CandleGraft)'s operations.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    /// The step id was not returned by `register` on this runtime.
    #[error("unknown step id {id}: register the step on this CandleGraft before calling it")]
    UnknownStep {
        /// The id passed.
        id: usize,
    },
    /// An input or static tensor lives on another device than the runtime's.
    #[error(
        "{role} {position} of {step} is on {found}, but this runtime runs on {expected}; move it to the runtime's device first"
    )]
    WrongDevice {
        /// The step called.
        step: Arc<str>,
        /// "input" or "static".
        role: &'static str,
        /// Its position in the slice passed.
        position: usize,
        /// The runtime's device.
        expected: String,
        /// The tensor's device.
        found: String,
    },
    /// An input or static tensor lives on the runtime's GPU but on another candle device
    /// (each `graft_candle::device` or `Device::new_cuda` call makes a new one, with its own
    /// stream).
    #[error(
        "{role} {position} of {step} is on {location} but not on this runtime's device: another candle device of the same GPU, with its own stream (each graft_candle::device or Device::new_cuda call makes a new one); make the runtime and the tensors from one Device, cloned"
    )]
    OtherDeviceOfGpu {
        /// The step called.
        step: Arc<str>,
        /// "input" or "static".
        role: &'static str,
        /// Its position in the slice passed.
        position: usize,
        /// The GPU both devices are on.
        location: String,
    },
    /// A tensor's dtype cannot cross graft's boundary (candle's raw-byte dummy types).
    #[error(
        "{role} {position} of {step} has dtype {dtype:?}, which graft-candle cannot copy; convert it to a standard dtype first"
    )]
    UnsupportedDtype {
        /// The step called.
        step: Arc<str>,
        /// "input", "static" or "output".
        role: &'static str,
        /// Its position.
        position: usize,
        /// The dtype.
        dtype: candle_core::DType,
    },
    /// An output tensor given to `CandleGraft::call_into` does not match what the body
    /// returns at its position.
    #[error(
        "output {position} of {step} is {returned}, but the tensor given for it is {given}; pass one tensor of the body's dtype and shape per output"
    )]
    OutputMismatch {
        /// The step called.
        step: Arc<str>,
        /// The output's position.
        position: usize,
        /// What the body returns there (dtype and shape), or "missing" past its outputs.
        returned: String,
        /// The tensor given (dtype and shape), or "missing" past the tensors given.
        given: String,
    },
    /// The step's body failed (a candle error: bad shapes, unsupported op, ...), in a run
    /// that was not a capture, or with an error that is not about capturing.
    #[error("body of {step} failed: {source}")]
    Body {
        /// The step called.
        step: Arc<str>,
        /// candle's error.
        source: candle_core::Error,
    },
    /// A model's host-side check refused a step before it ran (a full kv cache, a batch the
    /// cache does not hold, tokens of the wrong rank).
    #[error("the model refused the step: {source}")]
    Model {
        /// candle's error, with what to do.
        source: candle_core::Error,
    },
    /// candle failed outside the body (making the tensors graft-candle hands in or back).
    #[error("{step}: {what} failed: {source}")]
    Candle {
        /// The step called.
        step: Arc<str>,
        /// What graft-candle was doing.
        what: &'static str,
        /// candle's error.
        source: candle_core::Error,
    },
    /// Recording the step failed because its body freed a tensor made outside the step: it
    /// replaced state it keeps, and the replacement's work never ran. The call is not run
    /// again on that state, and the step runs eagerly from now on.
    #[error(
        "{step}: recording failed: {cause}. The state the body keeps now holds tensors whose work never ran, so the call was not run again: rebuild that state (a fresh cache) and call again; the step runs eagerly from now on"
    )]
    StateLost {
        /// The step called.
        step: Arc<str>,
        /// What broke the recording.
        cause: crate::Uncapturable,
    },
    /// graft refused or failed the call (see graft's `CallError`), boxed: it carries candle's
    /// error type.
    #[error(transparent)]
    Call(Box<graft_core::CallError<candle_core::Error>>),
    /// Launching a recorded graph failed. CUDA refuses to relaunch a graph while one of its
    /// allocations is held: a body that keeps a tensor it made (in a struct, a cache, a
    /// channel) causes this.
    #[error(
        "{step}: launching its recorded graph failed: {source}; if the body keeps a tensor it made (in a struct, a cache, a channel), CUDA refuses to relaunch the graph until that tensor is dropped: a step must drop everything it makes"
    )]
    Launch {
        /// The step called.
        step: Arc<str>,
        /// The device's error.
        source: graft_core::DeviceError,
    },
    /// Opening graft's CUDA device on candle's stream failed, or a driver query failed.
    #[error("{what}: {source}")]
    Device {
        /// What was being done.
        what: &'static str,
        /// The device's error.
        source: graft_core::DeviceError,
    },
    /// A CUDA driver call graft-candle makes itself (copies between candle tensors and graft
    /// buffers, graph memory queries) failed.
    #[error(
        "{what} failed with CUDA error {name} ({code}); the CUDA context may be broken, restart the process"
    )]
    Driver {
        /// What was being done.
        what: &'static str,
        /// CUDA's numeric error code.
        code: u32,
        /// CUDA's name of the error.
        name: String,
    },
    /// A CUDA-only operation was given a device or tensor that is not on CUDA.
    #[error("{what} needs a CUDA device made by graft_candle::device, but got one on {location}")]
    NotCuda {
        /// The operation called.
        what: &'static str,
        /// The device it got.
        location: String,
    },
    /// Sending NCCL's unique id over a tensor-parallel job's rendezvous failed.
    #[error(
        "sharing NCCL's unique id over the job's rendezvous failed: {source}; check that every rank started and reached the same point"
    )]
    Rendezvous {
        /// The rendezvous' error.
        source: graft_launch::ExchangeError,
    },
    /// The rank's watchdog on its peers could not start.
    #[error("starting this rank's watchdog failed: {source}")]
    Watchdog {
        /// The watchdog's error.
        source: graft_launch::WatchdogError,
    },
    /// A collective refused its tensor (dtype, device, layout).
    #[error("{op}: {why}")]
    Collective {
        /// The operation called.
        op: &'static str,
        /// Why, with what to do.
        why: &'static str,
    },
    /// A CUDA-only operation was called in a build of graft-candle without its `cuda`
    /// feature.
    #[error(
        "{what} needs CUDA, but graft-candle was built without its cuda feature; build it with --features cuda (see scripts/cuda-build-env.sh)"
    )]
    NoCuda {
        /// The operation called.
        what: &'static str,
    },
    /// Tensor parallelism was asked of a build of graft-candle without its `nccl` feature.
    #[error(
        "{what} needs NCCL, but graft-candle was built without its nccl feature; build it with --features nccl (it links libnccl)"
    )]
    NoNccl {
        /// The operation called.
        what: &'static str,
    },
}
