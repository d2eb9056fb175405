//! The ops' errors: what was wrong with the inputs (or the kernels' compilation), and what to do.

use candle_core::DType;

/// Why a fused op refused its inputs or could not run its kernel. Returned inside
/// `candle_core::Error::Wrapped`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KernelError {
    /// An input's dtype is not one the kernels compute in.
    #[error(
        "{op}: {input} is {got:?}, but {op} supports f32, bf16 and f16; convert it with to_dtype first"
    )]
    UnsupportedDType {
        op: &'static str,
        input: &'static str,
        got: DType,
    },
    /// Two inputs that must share a dtype do not.
    #[error("{op}: {input} is {got:?} but {reference} is {expected:?}; give the inputs one dtype")]
    DTypeMismatch {
        op: &'static str,
        input: &'static str,
        got: DType,
        reference: &'static str,
        expected: DType,
    },
    /// An input's shape does not fit the op.
    #[error("{op}: {input} has shape {got:?}, expected {expected}; pass a tensor of that shape")]
    Shape {
        op: &'static str,
        input: &'static str,
        got: Vec<usize>,
        expected: &'static str,
    },
    /// An input is not contiguous in memory (a start offset is fine).
    #[error(
        "{op}: {input} is not contiguous; call .contiguous() on it first (a narrow along the first dimension of a contiguous tensor stays contiguous)"
    )]
    NotContiguous {
        op: &'static str,
        input: &'static str,
    },
    /// An input lives on another device than the first input.
    #[error("{op}: {input} is on another device than the other inputs; move it there first")]
    Device {
        op: &'static str,
        input: &'static str,
    },
    /// The query heads are not a whole multiple of the key/value heads (or either is 0).
    #[error(
        "{op}: {heads} query heads are not a multiple of {kv_heads} key/value heads; check the model's head counts"
    )]
    Heads {
        op: &'static str,
        heads: usize,
        kv_heads: usize,
    },
    /// The head dimension is outside what the attention kernel holds per key row.
    #[error(
        "decode_attention: head dim {head_dim} is outside 1..=256; use the unfused attention for this model"
    )]
    HeadDim { head_dim: usize },
    /// The query heads of one key/value head need more shared memory than the kernel may use.
    #[error(
        "decode_attention: {group} query heads per key/value head at head dim {head_dim} need {bytes} bytes of shared memory, over the kernel's {limit}; use the unfused attention for this model"
    )]
    GroupTooLarge {
        group: usize,
        head_dim: usize,
        bytes: usize,
        limit: usize,
    },
    /// A grouped projection got no weights or more than it takes.
    #[error("linear_cat: {got} weights, but it takes 1 to {max}; split the projection")]
    Parts { got: usize, max: usize },
    /// Positions or rows are not u32.
    #[error("{op}: {input} are {got:?}; pass them as u32")]
    IndexDType {
        op: &'static str,
        input: &'static str,
        got: DType,
    },
    /// The KV cache has no positions at all.
    #[error(
        "decode_attention: the KV cache has no positions (max_seq 0); allocate a cache of at least one position"
    )]
    EmptyCache,
    /// A sequence's position is past the end of its cache row (found on the CPU; the CUDA
    /// kernel clamps it to the last position instead, since it cannot report data).
    #[error(
        "decode_attention: sequence {sequence} is at position {position}, past the cache's {max_seq} positions; keep positions below max_seq"
    )]
    PositionPastCache {
        sequence: usize,
        position: u32,
        max_seq: usize,
    },
    /// A query's cache row is past the cache (found on the CPU; the CUDA kernels clamp it to
    /// the last row instead).
    #[error(
        "{op}: query {query} reads cache row {row}, but the cache has {rows} rows; pass rows below that"
    )]
    RowPastCache {
        op: &'static str,
        query: usize,
        row: u32,
        rows: usize,
    },
    /// A paged cache's block table names a block past the cache (found on the CPU; the CUDA
    /// kernels clamp it to the last block instead).
    #[error(
        "{op}: sequence {sequence}'s block table names block {block}, but the cache has {blocks} blocks; pass block ids below that"
    )]
    BlockPastCache {
        op: &'static str,
        sequence: usize,
        block: u32,
        blocks: usize,
    },
    /// A size does not fit the kernels' 32-bit indexing or launch limits.
    #[error(
        "{op}: {what} is {size}, more than the kernel's launch allows; split the work into smaller calls"
    )]
    TooLarge {
        op: &'static str,
        what: &'static str,
        size: usize,
    },
    /// A routing asks for more experts than there are, or there are none or too many.
    #[error(
        "route: top {top_k} of {experts} experts; pass 1 to {max} experts and a top k between 1 and their count"
    )]
    Experts {
        experts: usize,
        top_k: usize,
        max: usize,
    },
    /// The experts' weight lists are empty, too long or of different lengths.
    #[error(
        "experts: {gate} gate, {up} up and {down} down weights; pass one of each per expert, 1 to {max} experts"
    )]
    ExpertWeights {
        gate: usize,
        up: usize,
        down: usize,
        max: usize,
    },
    /// A fused op does not cover these shapes; run the unfused composition instead.
    #[error("{op}: {reason}; run the unfused candle composition for these shapes")]
    Unsupported {
        op: &'static str,
        reason: &'static str,
    },
    /// A fused op's forward pass was applied twice through one op value.
    #[error("{op}: the op's forward pass ran twice; make a new op for each call")]
    SavedTwice { op: &'static str },
    /// A backward pass found nothing its forward pass keeps for it.
    #[error(
        "{op}: the backward pass found no values saved by the forward pass; run the forward pass first"
    )]
    NotSaved { op: &'static str },
    /// A mixed-precision optimizer entry whose master is not f32 or whose copy is not 16-bit.
    #[error(
        "{op}: params[{index}] is {master:?} and copies[{index}] {copy:?}; mixed precision keeps f32 masters and bf16 or f16 copies"
    )]
    MixedDTypes {
        op: &'static str,
        index: usize,
        master: DType,
        copy: DType,
    },
    /// An input must have one dtype only.
    #[error("{op}: {input} is {got:?}; pass it as {expected:?}")]
    ExpectedDType {
        op: &'static str,
        input: &'static str,
        got: DType,
        expected: DType,
    },
    /// An optimizer's tensor lists do not have one entry per parameter.
    #[error(
        "{op}: {params} parameters but {got} {input}; pass one {input} entry per parameter, in the parameters' order"
    )]
    ListLength {
        op: &'static str,
        input: &'static str,
        params: usize,
        got: usize,
    },
    /// An entry of an optimizer's tensor lists does not have its parameter's shape.
    #[error(
        "{op}: {input}[{index}] has shape {got:?} but its parameter has {expected:?}; pass tensors of the parameters' shapes"
    )]
    EntryShape {
        op: &'static str,
        input: &'static str,
        index: usize,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    /// Two tensors of an optimizer step share memory that the step writes.
    #[error(
        "{op}: {input}[{index}] shares memory with {other}[{other_index}], which the step writes; give every parameter, state and the scalars their own memory"
    )]
    Overlap {
        op: &'static str,
        input: &'static str,
        index: usize,
        other: &'static str,
        other_index: usize,
    },
    /// An optimizer's hyperparameter is outside its range.
    #[error("{op}: {name} is {value}, expected {expected}; pass a value in that range")]
    Hyperparameter {
        op: &'static str,
        name: &'static str,
        value: f64,
        expected: &'static str,
    },
    /// SGD got momentum buffers without momentum, or momentum without buffers.
    #[error(
        "sgd_update: momentum {momentum} with {buffers}; pass one buffer per parameter when the momentum is not 0 and none when it is"
    )]
    MomentumBuffers {
        momentum: f64,
        buffers: &'static str,
    },
    /// `decode_step` got more rows than its projections take in this dtype.
    #[error(
        "decode_step: {rows} rows, but it takes at most {max} in {dtype:?}; run more rows through the per-op path (decode_step_fits says which)"
    )]
    StepRows {
        rows: usize,
        max: usize,
        dtype: DType,
    },
    /// More rows than the matrix-vector kernel takes, and an operand the tensor-core kernel
    /// cannot load (see `linear`'s module docs).
    #[error(
        "{op}: {rows} rows need the tensor-core projection, but {input} does not start 16-byte aligned or its columns are not a multiple of 8; pass aligned bf16 or f16 tensors, or run at most 2 rows at a time"
    )]
    Unaligned {
        op: &'static str,
        input: &'static str,
        rows: usize,
    },
    /// `decode_step` got another number of cache pairs than the model has layers.
    #[error(
        "decode_step: {got} key/value cache pairs for a model of {layers} layers; pass one pair per layer"
    )]
    Caches { layers: usize, got: usize },
    /// `decode_step` got a model without layers.
    #[error("decode_step: the model has no layers; give it at least one")]
    NoLayers,
    /// A CUDA-only custom op was applied to CPU tensors.
    #[error("{op}: this custom op runs on CUDA only; call {op} itself, which composes the CPU ops")]
    CudaOnly { op: &'static str },
    /// NVRTC rejected a module's CUDA source.
    #[error(
        "NVRTC could not compile the {module} kernels: {log}; check the CUDA toolkit's NVRTC version"
    )]
    Compile { module: &'static str, log: String },
    /// NVRTC itself failed (not the source).
    #[error(
        "NVRTC failed on the {module} kernels: {reason}; check that libnvrtc matches the driver"
    )]
    Nvrtc {
        module: &'static str,
        reason: String,
    },
    /// NVRTC returned PTX that is not text.
    #[error("NVRTC returned PTX for the {module} kernels that is not text; check the CUDA toolkit")]
    PtxNotText { module: &'static str },
    /// The driver would not say the device's compute capability (what a module is compiled
    /// for).
    #[cfg(feature = "cuda")]
    #[error(
        "the {module} kernels: the driver would not tell the device's compute capability ({source}); check the device's state"
    )]
    Capability {
        module: &'static str,
        source: candle_core::cuda_backend::cudarc::driver::DriverError,
    },
    /// The driver refused a kernel launch.
    #[cfg(feature = "cuda")]
    #[error("launching kernel {kernel} failed: {source}")]
    Launch {
        kernel: String,
        source: graft_core::DeviceError,
    },
}

impl From<KernelError> for candle_core::Error {
    fn from(err: KernelError) -> Self {
        candle_core::Error::wrap(err)
    }
}
