//! [`Destinations`]: the caller's allocator of a call's outputs, for outputs the caller owns
//! ([`crate::Graft::call_owned`]).

use crate::buffer::Buffer;

/// Where a call's outputs go when the caller owns them ([`crate::Graft::call_owned`]): typically a
/// framework allocating its own fresh tensor per output and handing graft an external
/// buffer over it ([`Buffer::external`]).
pub trait Destinations<M, E> {
    /// Memory for output `index` of this call: `bytes` long (at least), on the runtime's
    /// device, outside graft's pools, described by `meta` (what the body returned with it).
    /// Called before the launch of a replay or a recording, and after the body of a warmup
    /// or an eager run; the memory must stay allocated while the call's work runs (candle's
    /// stream-ordered frees do that by themselves). An error is returned as
    /// [`crate::CallError::Destination`] and nothing is launched.
    fn destination(&mut self, index: usize, meta: &M, bytes: usize) -> Result<Buffer, E>;
}
