//! The tensor layer's error type, and its conversions to and from graft's.

use graft_core::PoolError;
use graft_core::{BodyError, BufferError, CallError, DeviceError, MemoryError};

use crate::dtype::DType;

/// Errors of tensor operations and of the decoder.
///
/// Device, buffer and pool errors keep their graft types, and convert back into the matching
/// [`BodyError`] variants, so that a capture violation inside a body reaches graft as one (and
/// graft falls back to eager execution) instead of as an opaque framework error.
#[derive(thiserror::Error, Debug)]
pub enum TensorError {
    /// An operand has the wrong shape.
    #[error(
        "{op}: {operand} has shape {found:?} but {expected:?} is required; pass a tensor of the required shape"
    )]
    Shape {
        /// The operation.
        op: &'static str,
        /// Which operand.
        operand: &'static str,
        /// The shape required.
        expected: Vec<usize>,
        /// The shape passed.
        found: Vec<usize>,
    },
    /// An operand has the wrong element type.
    #[error("{op}: {operand} has dtype {found} but {expected} is required")]
    DType {
        /// The operation.
        op: &'static str,
        /// Which operand.
        operand: &'static str,
        /// The dtype required.
        expected: DType,
        /// The dtype passed.
        found: DType,
    },
    /// A tensor's shape does not fit its buffer.
    #[error(
        "a tensor of shape {shape:?} ({dtype}) at byte offset {offset} needs {needed} bytes but its buffer has {available}; allocate a larger buffer or use a smaller view"
    )]
    OutOfBounds {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
        /// Byte offset into the buffer.
        offset: usize,
        /// Bytes the tensor needs from the buffer's start.
        needed: usize,
        /// Bytes the buffer has.
        available: usize,
    },
    /// Host data does not match the tensor's element count.
    #[error("host data has {found} elements but the shape {shape:?} holds {expected}")]
    HostLength {
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements passed.
        found: usize,
    },
    /// A tensor passed to a graft call must be a whole buffer (graft tracks buffers, not views).
    #[error(
        "{operand} is a view (byte offset {offset}, {bytes} of {buffer} bytes); graft inputs must be whole buffers: copy the view into its own buffer first"
    )]
    NotWholeBuffer {
        /// Which operand.
        operand: &'static str,
        /// Byte offset of the view.
        offset: usize,
        /// Bytes the view covers.
        bytes: usize,
        /// Bytes of the buffer.
        buffer: usize,
    },
    /// The batch is larger than the largest bucket.
    #[error(
        "batch of {batch} rows is larger than the largest bucket ({max}); split it into batches of at most {max}"
    )]
    BatchTooLarge {
        /// Rows asked for.
        batch: usize,
        /// Largest bucket.
        max: usize,
    },
    /// The batch is empty.
    #[error("a batch needs at least one row")]
    EmptyBatch,
    /// A token id outside the vocabulary.
    #[error("token id {id} at row {row} is outside the vocabulary 0..{vocab}")]
    TokenOutOfRange {
        /// Row of the batch.
        row: usize,
        /// The id.
        id: i32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// Every position of the KV cache is used.
    #[error(
        "the KV cache of bucket {bucket} is full ({ctx} positions); reset the state to start a new sequence"
    )]
    ContextFull {
        /// The bucket.
        bucket: usize,
        /// Context length.
        ctx: usize,
    },
    /// The state was made for another bucket than the tokens.
    #[error(
        "tokens are padded to bucket {tokens} but the state is for bucket {state}; use the state of the tokens' bucket"
    )]
    BucketMismatch {
        /// Bucket of the tokens.
        tokens: usize,
        /// Bucket of the state.
        state: usize,
    },
    /// A configuration that the decoder cannot run.
    #[error("invalid decoder configuration: {what}")]
    Config {
        /// What is wrong.
        what: &'static str,
    },
    /// A sampling temperature that is negative or not a number.
    #[error(
        "sampling temperature {temperature} is negative or not finite; pass 0 for greedy decoding or a positive finite temperature"
    )]
    Temperature {
        /// The temperature passed.
        temperature: f32,
    },
    /// A token loop asked for no tokens, or for more than a launch can hold.
    #[error(
        "a token loop of {max_tokens} tokens per launch cannot run; pass max_tokens from 1 to {max}"
    )]
    LoopLength {
        /// Tokens per launch asked for.
        max_tokens: usize,
        /// The most a launch of this batch can hold.
        max: usize,
    },
    /// An end token outside the vocabulary.
    #[error(
        "end token {eos} is outside the vocabulary 0..{vocab}; pass a token id of the vocabulary, or none"
    )]
    EosOutOfRange {
        /// The end token.
        eos: i32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// More token limits than rows.
    #[error(
        "{found} token limits were passed for a state of {bucket} rows; pass one limit per real row"
    )]
    Limits {
        /// Limits passed.
        found: usize,
        /// Rows of the state.
        bucket: usize,
    },
    /// A graft call returned no output where one was expected.
    #[error(
        "{function} returned {found} outputs, expected {expected}; this is a bug in graft-tensor"
    )]
    Outputs {
        /// The function.
        function: &'static str,
        /// Outputs expected.
        expected: usize,
        /// Outputs returned.
        found: usize,
    },
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A buffer can no longer be read.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Graft's pool could not allocate.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A graft memory operation failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A graft call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A body error that is not one of the above (a framework error of another layer).
    #[error("{0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
}

impl From<BodyError> for TensorError {
    fn from(e: BodyError) -> TensorError {
        match e {
            BodyError::Device(e) => TensorError::Device(e),
            BodyError::Buffer(e) => TensorError::Buffer(e),
            BodyError::Pool(e) => TensorError::Pool(e),
            BodyError::Framework(e) => TensorError::Body(e),
        }
    }
}

impl From<TensorError> for BodyError {
    fn from(e: TensorError) -> BodyError {
        match e {
            TensorError::Device(e) => BodyError::Device(e),
            TensorError::Buffer(e) => BodyError::Buffer(e),
            TensorError::Pool(e) => BodyError::Pool(e),
            TensorError::Memory(MemoryError::Device(e)) => BodyError::Device(e),
            TensorError::Memory(MemoryError::Buffer(e)) => BodyError::Buffer(e),
            TensorError::Memory(MemoryError::Pool(e)) => BodyError::Pool(e),
            TensorError::Body(e) => BodyError::Framework(e),
            other => BodyError::Framework(Box::new(other)),
        }
    }
}

/// Results of the tensor layer.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;
