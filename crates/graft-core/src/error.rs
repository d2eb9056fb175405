//! Errors of graft's operations, one enum per operation, with structured fields.

use std::sync::Arc;

use crate::buffer_error::BufferError;
use crate::device::{DeviceError, DeviceId};
use crate::pool::PoolError;

/// Identifies a registered function.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct FunctionId(pub(crate) usize);

impl std::fmt::Display for FunctionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "f{}", self.0)
    }
}

/// The framework error type a body returns when it does not name its own: any error.
pub type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// An error returned by a function's body. `E` is the framework's own error type: graft hands
/// it back untouched in [`CallError::Body`], so a framework gets its typed error back with
/// no downcast.
#[derive(thiserror::Error, Debug)]
pub enum BodyError<E = AnyError> {
    /// A device operation failed (during a recording, a capture violation here makes graft
    /// fall back to eager execution).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The body read a buffer that is no longer valid.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// The body could not allocate from graft's pool.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The framework's own error (bad shapes, unsupported dtype, ...).
    #[error("{0}")]
    Framework(E),
}

/// Errors of `Graft::call`. `E` is the framework's error type, as the body returned it.
#[derive(thiserror::Error, Debug)]
pub enum CallError<E = AnyError> {
    /// The id was not returned by `register` on this runtime.
    #[error("unknown function id {id}: register the function on this Graft before calling it")]
    UnknownFunction {
        /// The id passed.
        id: FunctionId,
    },
    /// An input lives on another device.
    #[error(
        "input {position} of {function} belongs to {found}, but this runtime drives {expected}; move it to this device first"
    )]
    WrongDevice {
        /// Function called.
        function: Arc<str>,
        /// Input position.
        position: usize,
        /// This runtime's device.
        expected: DeviceId,
        /// The input's device.
        found: DeviceId,
    },
    /// An input can no longer be read.
    #[error("input {position} of {function} is not readable: {source}")]
    InvalidInput {
        /// Function called.
        function: Arc<str>,
        /// Input position.
        position: usize,
        /// Why.
        source: BufferError,
    },
    /// A function with buckets was called without its bucket as `keys[0]`.
    #[error(
        "{function} has buckets, but the call passed no keys; pass the bucket (Graft::bucket) as keys[0]"
    )]
    MissingBucket {
        /// Function called.
        function: Arc<str>,
    },
    /// `keys[0]` of a function with buckets is not one of its buckets (and not above the
    /// largest, which would run eagerly).
    #[error(
        "{function} was called with size {size}, which is not one of its buckets; pad the inputs to bucket {bucket} and pass {bucket} as keys[0]"
    )]
    NotABucket {
        /// Function called.
        function: Arc<str>,
        /// The `keys[0]` passed.
        size: u64,
        /// The bucket that holds it.
        bucket: usize,
    },
    /// [`crate::Graft::bucket`] was asked about a function registered without buckets.
    #[error("{function} was registered without buckets; set FunctionSpec::buckets to use them")]
    NoBuckets {
        /// Function asked about.
        function: Arc<str>,
    },
    /// The body failed.
    #[error("body of {function} failed: {source}")]
    Body {
        /// Function called.
        function: Arc<str>,
        /// The body's error.
        source: BodyError<E>,
    },
    /// The caller's output allocator ([`crate::Destinations`]) failed; nothing was launched.
    #[error("{function}: allocating the caller's memory for output {index} failed: {error}")]
    Destination {
        /// Function called.
        function: Arc<str>,
        /// The output.
        index: usize,
        /// The allocator's error.
        error: E,
    },
    /// A destination ([`crate::Destinations`]) does not fit its output: another device, fewer
    /// bytes than the output, or memory of graft's own pools. No graph was launched.
    #[error(
        "{function}: the destination given for output {index} ({given} bytes) cannot take its {needed} bytes: {why}; allocate {needed} bytes of the runtime's device outside graft's pools"
    )]
    BadDestination {
        /// Function called.
        function: Arc<str>,
        /// The output.
        index: usize,
        /// Bytes of the destination.
        given: usize,
        /// Bytes of the output.
        needed: usize,
        /// What is wrong, lowercase.
        why: &'static str,
    },
    /// A function called with its outputs delivered into the caller's memory
    /// ([`crate::Graft::call_owned`]) and also without: a recording of one kind cannot serve
    /// the other.
    #[error(
        "{function} was recorded {recorded} and is called {called} now; call a function either always with Graft::call_owned or never"
    )]
    OwnedOutputs {
        /// Function called.
        function: Arc<str>,
        /// How the replayed node was recorded ("with owned outputs" or "without").
        recorded: &'static str,
        /// How it is called now.
        called: &'static str,
    },
    /// An external input ([`crate::Buffer::external`]) lies inside graft's own pools: it is
    /// graft's memory, whose reuse graft tracks through its own buffers only.
    #[error(
        "input {position} of {function} is external memory inside graft's own pools ({addr}); pass the graft buffer itself, not an external handle to its memory"
    )]
    ExternalInPool {
        /// Function called.
        function: Arc<str>,
        /// Input position.
        position: usize,
        /// Its address.
        addr: crate::device::DevicePtr,
    },
    /// A device operation graft itself issued failed.
    #[error("{function}: {source}")]
    Device {
        /// Function called.
        function: Arc<str>,
        /// The device's error.
        source: DeviceError,
    },
    /// The graph pool could not serve graft's own allocation (a placeholder).
    #[error("{function}: {source}")]
    Pool {
        /// Function called.
        function: Arc<str>,
        /// The pool's error.
        source: PoolError,
    },
    /// Another rank of this runtime's group failed to record the same call, so this rank
    /// discarded its own recording and ran nothing: all ranks return an error together.
    #[error(
        "{function}: rank {rank} of the group failed to record this call (its own call returned the error), so this rank discarded its recording and ran nothing; the ranks stay in step, and the next call records again"
    )]
    PeerFailed {
        /// Function called.
        function: Arc<str>,
        /// The lowest rank that failed.
        rank: usize,
    },
    /// The group's agreement on a recording failed: ranks timed out waiting for each other, or
    /// they record different calls. Nothing was launched.
    #[error("{function}: {source}")]
    Group {
        /// Function called.
        function: Arc<str>,
        /// The agreement's error.
        source: crate::group::GroupError,
    },
    /// An error recorded earlier by a `Drop` (graph destruction, buffer release).
    #[error("an earlier release failed: {source}")]
    Sticky {
        /// The recorded error.
        source: DeviceError,
    },
    /// The runtime's lifecycle refused a transition (a bug in graft).
    #[error(
        "internal lifecycle error: cannot move from {from:?} to {to:?}; this is a bug in graft, please report it"
    )]
    State {
        /// Phase the runtime was in.
        from: crate::lifecycle::Phase,
        /// Phase it was asked to move to.
        to: crate::lifecycle::Phase,
    },
    /// Verify mode found a replay that differs from eager execution.
    #[error(
        "replay of {function} (node {node}) differs from eager execution at {what}, byte {byte}; the body likely \
         depends on host state baked into the graph at recording (read it from a device buffer instead), or a kernel is nondeterministic"
    )]
    VerifyMismatch {
        /// Function called.
        function: Arc<str>,
        /// Node replayed.
        node: crate::node_id::NodeId,
        /// Which buffer differs.
        what: VerifyTarget,
        /// First differing byte.
        byte: usize,
    },
    /// Verify mode could not snapshot or read buffers.
    #[error("verifying the replay of {function} failed: {source}")]
    Verify {
        /// Function called.
        function: Arc<str>,
        /// Why.
        source: MemoryError,
    },
}

/// The buffer a verify mismatch was found in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum VerifyTarget {
    /// An output, by index.
    Output(usize),
    /// An input after the call (bodies may update inputs in place), by position.
    Input(usize),
}

impl std::fmt::Display for VerifyTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VerifyTarget::Output(i) => write!(f, "output {i}"),
            VerifyTarget::Input(i) => write!(f, "input {i}"),
        }
    }
}

/// Errors of graft's memory operations outside calls (`alloc`, `copy_out`, `read`, `write`, `reset`).
#[derive(thiserror::Error, Debug)]
pub enum MemoryError {
    /// The buffer can no longer be read.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A host slice does not match the buffer's length.
    #[error(
        "host slice of {host} bytes does not match the buffer's {buffer} bytes; pass a slice of the buffer's length"
    )]
    LengthMismatch {
        /// Host bytes.
        host: usize,
        /// Buffer bytes.
        buffer: usize,
    },
    /// The buffer belongs to another device.
    #[error("buffer belongs to {found}, but this runtime drives {expected}")]
    WrongDevice {
        /// This runtime's device.
        expected: DeviceId,
        /// The buffer's device.
        found: DeviceId,
    },
    /// The runtime's group is broken: what was read may come from collectives that a lost peer
    /// never completed, so it is not handed out.
    #[error("the read is refused: {source}")]
    Group {
        /// Why the group is broken.
        source: crate::group::GroupError,
    },
}
