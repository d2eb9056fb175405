//! Why a pool operation failed.

use crate::device::{DeviceError, DevicePtr};

use super::BlockId;

/// Why a pool operation failed.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum PoolError {
    /// Reserving the pool's address range failed. The pool is unchanged.
    #[error(
        "reserving {bytes} bytes of address space for the pool failed: {source}; lower Config::pool_reservation"
    )]
    Reserve {
        /// Size of the range asked for.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// Mapping physical memory under a new block failed. The block layout is unchanged.
    #[error("mapping {bytes} bytes of device memory into the pool at {addr} failed: {source}")]
    Grow {
        /// First address of the range that could not be mapped.
        addr: DevicePtr,
        /// Size of that range.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The device is out of memory even after graft released the memory no block and no
    /// recorded graph uses.
    #[error(
        "out of device memory allocating {bytes} bytes: the pool holds {mapped} bytes, {allocated} of them live ({source}); free buffers you hold, call Graft::reset to drop recorded graphs, or lower the batch size"
    )]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
        /// Bytes mapped into the pool.
        mapped: usize,
        /// Bytes in allocated blocks of the pool.
        allocated: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The request does not fit in the free part of the pool's address range.
    #[error(
        "an allocation of {bytes} bytes does not fit in the pool's {reservation}-byte address range ({allocated} bytes allocated); raise Config::pool_reservation"
    )]
    ReservationExhausted {
        /// Bytes requested.
        bytes: usize,
        /// Size of the pool's address range.
        reservation: usize,
        /// Bytes allocated when it failed.
        allocated: usize,
    },
    /// The id is not an allocated block of this pool.
    #[error(
        "{id} is not allocated in this pool: it was already freed, made stale by a restore, rollback or release, or comes from another pool; free each block once, with an id this pool issued"
    )]
    UnknownBlock {
        /// The id given.
        id: BlockId,
    },
    /// The device failed to take memory back. The pool's bookkeeping says why it still counts
    /// it or not (see `Pool::release_unused` and `Pool::release_all`).
    #[error("returning {addr}+{bytes} bytes of the pool to the device failed: {source}")]
    Release {
        /// First address.
        addr: DevicePtr,
        /// Bytes.
        bytes: usize,
        /// The device's error.
        source: DeviceError,
    },
    /// The request cannot be rounded to the pool's granularity without overflow.
    #[error(
        "an allocation of {bytes} bytes is larger than the pool can address; request less memory"
    )]
    TooLarge {
        /// Bytes requested.
        bytes: usize,
    },
    /// The backing's granularity or reservation breaks its contract. The pool did not take it.
    #[error(
        "the device returned reservation {addr}+{bytes} bytes with granularity {granularity}, which is not aligned to it or not a multiple of 512 bytes; this is a bug in the device backend"
    )]
    BadReservation {
        /// Address returned (0 when the granularity alone was wrong).
        addr: DevicePtr,
        /// Size asked for.
        bytes: usize,
        /// The backing's granularity.
        granularity: usize,
    },
    /// The checkpoint was taken from another pool.
    #[error(
        "the checkpoint was taken from another pool; roll a pool back only to its own checkpoints"
    )]
    ForeignCheckpoint,
    /// A block the checkpoint describes lies over memory the pool has unmapped or released since.
    #[error(
        "the checkpoint's block at {addr} ({bytes} bytes) lies over memory the pool has unmapped or released since; do not release memory between a checkpoint and its rollback"
    )]
    StaleCheckpoint {
        /// The block's address.
        addr: DevicePtr,
        /// The block's size.
        bytes: usize,
    },
}
