//! The device memory figures graft-candle reports on CUDA ([`GraphMemory`], [`EagerMemory`]),
//! read by `graft_candle::cuda`'s functions.

/// The device's graph memory figures, in bytes (CUDA's `CU_GRAPH_MEM_ATTR_*`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct GraphMemory {
    /// Memory currently associated with graphs (their allocations' physical backing).
    pub used_current: u64,
    /// The highest `used_current` since the last reset.
    pub used_high: u64,
    /// Physical memory the driver currently holds for graph allocations, used or not (CUDA
    /// calls it reserved memory; graft's word for physical memory behind addresses is mapped).
    pub mapped_current: u64,
    /// The highest `mapped_current` since the last reset.
    pub mapped_high: u64,
}

/// The device's default memory pool (where candle's eager allocations come from, through
/// `cuMemAllocAsync`): the bytes in use now and the most in use since the last
/// `reset_eager_high`, which is how an eager step's peak is measured.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct EagerMemory {
    /// Bytes of the pool in use now.
    pub used_current: u64,
    /// The highest `used_current` since the last reset.
    pub used_high: u64,
}
