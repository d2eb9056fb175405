//! Buffers: graft's handles to device memory, their liveness and their invalidation.
//!
//! A [`Buffer`] is a counted handle to a shared cell. The cell carries the address and length,
//! where the memory came from (which function and node produced it, in which generation), a
//! count of user handles (liveness in O(1): no scan, no allocation) and an invalidation state.
//! Graft itself keeps the cells of every output it handed out, so it can invalidate a buffer
//! before a replay overwrites its bytes, and can tell whether an output is still held.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::buffer_error::BufferError;
use crate::device::{DeviceError, DeviceId, DeviceOp, DevicePtr};
pub(crate) use crate::node_id::{NodeId, NodeLabel};
use crate::pool::{BlockId, Pool};

const VALID: u8 = 0;
const OVERWRITTEN: u8 = 1;
const RECLAIMED: u8 = 2;
const RESET: u8 = 3;
const DROPPED: u8 = 4;
const NO_NODE: u64 = u64::MAX;

/// Where a cell's block lives, so that dropping the last handle can free it.
pub(crate) type PoolRef = Weak<Mutex<Pool>>;

/// The shared state behind every handle to one piece of memory.
pub(crate) struct Cell {
    addr: DevicePtr,
    len: usize,
    device: DeviceId,
    function: Arc<str>,
    users: AtomicUsize,
    state: AtomicU8,
    node: AtomicU64,
    overwritten_by: AtomicU64,
    generation: AtomicU64,
    is_static: AtomicBool,
    /// Used in place by a recorded graph, which is patched to follow it (see
    /// [`Buffer::mark_in_place`]).
    in_place: AtomicBool,
    /// Memory graft does not own (see [`Buffer::external`]): never freed, reused or
    /// invalidated by graft.
    external: bool,
    /// What keeps external memory allocated while a handle lives: dropped with the cell.
    _keepalive: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// In the runtime's list of handed-out graph-pool cells (see `Pools`, `pools.rs`).
    listed: AtomicBool,
    /// The pool block this cell owns, as `BlockId + 1` (0: none). Swapped out exactly once by
    /// whoever frees it: the last handle's drop, or a restore that rebuilds the bookkeeping.
    owner: AtomicU64,
    pool: Option<PoolRef>,
}

impl fmt::Debug for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cell")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("function", &self.function)
            .field("users", &self.users.load(Ordering::Relaxed))
            .field("state", &self.state.load(Ordering::Relaxed))
            .finish()
    }
}

impl Cell {
    pub(crate) fn new(
        addr: DevicePtr,
        len: usize,
        device: DeviceId,
        function: Arc<str>,
        generation: u64,
        pool: Option<PoolRef>,
    ) -> Arc<Cell> {
        Arc::new(Cell::build(addr, len, device, function, generation, pool))
    }

    fn build(
        addr: DevicePtr,
        len: usize,
        device: DeviceId,
        function: Arc<str>,
        generation: u64,
        pool: Option<PoolRef>,
    ) -> Cell {
        Cell {
            addr,
            len,
            device,
            function,
            users: AtomicUsize::new(0),
            state: AtomicU8::new(VALID),
            node: AtomicU64::new(NO_NODE),
            overwritten_by: AtomicU64::new(NO_NODE),
            generation: AtomicU64::new(generation),
            is_static: AtomicBool::new(false),
            in_place: AtomicBool::new(false),
            external: false,
            _keepalive: None,
            listed: AtomicBool::new(false),
            owner: AtomicU64::new(0),
            pool,
        }
    }

    /// A cell over memory graft does not own (see [`Buffer::external`]).
    fn external(
        device: DeviceId,
        addr: DevicePtr,
        len: usize,
        keepalive: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Arc<Cell> {
        Arc::new(Cell {
            external: true,
            _keepalive: keepalive,
            ..Cell::build(addr, len, device, Arc::from("external"), 0, None)
        })
    }

    pub(crate) fn addr(&self) -> DevicePtr {
        self.addr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn end(&self) -> u64 {
        self.addr.0 + self.len as u64
    }

    /// Whether a caller holds a handle: the O(1) liveness check of the replay fast path.
    #[inline]
    pub(crate) fn is_held(&self) -> bool {
        self.users.load(Ordering::Acquire) > 0
    }

    #[inline]
    pub(crate) fn is_valid(&self) -> bool {
        self.state.load(Ordering::Acquire) == VALID
    }

    /// Held and valid: a caller can still read it, so nothing may reuse its bytes silently.
    #[inline]
    pub(crate) fn is_readable_by_someone(&self) -> bool {
        self.is_held() && self.is_valid()
    }

    /// Marks the cell as listed; returns whether it was not listed before.
    #[inline]
    pub(crate) fn mark_listed(&self) -> bool {
        !self.listed.swap(true, Ordering::Relaxed)
    }

    /// Marks the cell as no longer listed.
    #[inline]
    pub(crate) fn unlist(&self) {
        self.listed.store(false, Ordering::Relaxed);
    }

    pub(crate) fn set_node(&self, node: NodeId) {
        self.node.store(node.0, Ordering::Relaxed);
    }

    pub(crate) fn node(&self) -> Option<NodeId> {
        let n = self.node.load(Ordering::Relaxed);
        (n != NO_NODE).then_some(NodeId(n))
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub(crate) fn is_static(&self) -> bool {
        self.is_static.load(Ordering::Relaxed)
    }

    pub(crate) fn is_in_place(&self) -> bool {
        self.in_place.load(Ordering::Relaxed)
    }

    /// Memory graft does not own (see [`Buffer::external`]).
    pub(crate) fn is_external(&self) -> bool {
        self.external
    }

    /// Marks the cell overwritten by `by` (a node, or none for a warmup). Idempotent: the first
    /// reason wins.
    #[inline]
    pub(crate) fn invalidate_overwritten(&self, by: Option<NodeId>) {
        if self
            .state
            .compare_exchange(VALID, OVERWRITTEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.overwritten_by
                .store(by.map_or(NO_NODE, |n| n.0), Ordering::Release);
            tracing::trace!(addr = %self.addr, function = %self.function, "buffer invalidated");
        }
    }

    pub(crate) fn invalidate_reclaimed(&self) {
        let _ = self
            .state
            .compare_exchange(VALID, RECLAIMED, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(crate) fn invalidate_reset(&self) {
        self.invalidate_freed(RESET);
    }

    pub(crate) fn invalidate_dropped(&self) {
        self.invalidate_freed(DROPPED);
    }

    /// The memory goes back to the device with the whole pool: no block to free any more.
    fn invalidate_freed(&self, state: u8) {
        let _ = self
            .state
            .compare_exchange(VALID, state, Ordering::AcqRel, Ordering::Acquire);
        self.owner.store(0, Ordering::Release);
    }

    /// Whether this cell's memory comes from `pool`: the runtime's identity, since every
    /// runtime owns its pools.
    pub(crate) fn in_pool(&self, pool: &Arc<Mutex<Pool>>) -> bool {
        self.pool
            .as_ref()
            .is_some_and(|p| std::ptr::eq(p.as_ptr(), Arc::as_ptr(pool)))
    }

    /// Makes a cell nobody holds fresh for reuse by the next replay of its slot.
    /// Only called when `users == 0`, so no handle can observe the change.
    pub(crate) fn recycle(&self, generation: u64) {
        debug_assert!(!self.is_held());
        self.state.store(VALID, Ordering::Release);
        self.overwritten_by.store(NO_NODE, Ordering::Relaxed);
        self.generation.store(generation, Ordering::Relaxed);
    }

    /// Hands block ownership to this cell (its last handle's drop frees the block). If the
    /// last handle went away concurrently, frees the block right here, through `pool`, which
    /// the caller has locked.
    pub(crate) fn adopt(&self, block: BlockId, pool: &mut Pool) {
        self.owner.store(block.0 + 1, Ordering::Release);
        if !self.is_held() {
            let b = self.owner.swap(0, Ordering::AcqRel);
            if b != 0 {
                // The block was placed a moment ago, so it is known; nothing to report.
                let _ = pool.free(BlockId(b - 1));
            }
        }
    }

    /// Forgets the owned block without freeing it (the pool is being rebuilt or rolled back).
    pub(crate) fn disown(&self) {
        self.owner.store(0, Ordering::Release);
    }

    pub(crate) fn error(&self) -> BufferError {
        let function = self.function.clone();
        let generation = self.generation();
        let node = NodeLabel(self.node());
        match self.state.load(Ordering::Acquire) {
            OVERWRITTEN => {
                let by = self.overwritten_by.load(Ordering::Acquire);
                BufferError::Overwritten {
                    function,
                    node,
                    generation,
                    overwritten_by: NodeLabel((by != NO_NODE).then_some(NodeId(by))),
                }
            }
            RESET => BufferError::Reset {
                function,
                generation,
            },
            DROPPED => BufferError::Dropped {
                function,
                generation,
            },
            _ => BufferError::Reclaimed {
                function,
                node,
                generation,
            },
        }
    }
}

/// A handle to device memory managed by graft. Cloning shares the storage; the memory is
/// returned to graft's pool when the last handle is dropped (from any thread).
///
/// Reading the address of a buffer whose memory graft had to reuse returns a
/// [`BufferError`] saying what happened and what to do; it never yields stale memory.
pub struct Buffer {
    cell: Arc<Cell>,
}

impl Buffer {
    /// A handle to `len` bytes at `addr` on `device` that graft does not own: a framework's own
    /// allocation (a candle tensor's storage, say) passed to a call as an input, returned by
    /// a body as an output, or given as a call's output destination. Graft never frees,
    /// reuses or invalidates it; `keepalive`, if any, is whatever keeps the memory allocated
    /// (the framework's tensor), and is dropped when the last handle is.
    ///
    /// The caller vouches for the range: live memory of `device`, allocated for as long as
    /// this handle lives, and, for a static input, for as long as graphs recorded with it
    /// exist. A wrong range is a device fault (the simulator reports it as
    /// [`DeviceError::InvalidAddress`]), never host memory unsafety. As an input it is
    /// static, in place, or copied like any buffer (see [`Buffer::mark_static`] and
    /// [`Buffer::mark_in_place`]); a range inside graft's own pools is refused at the call.
    pub fn external(
        device: DeviceId,
        addr: DevicePtr,
        len: usize,
        keepalive: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Buffer {
        Buffer::from_cell(&Cell::external(device, addr, len, keepalive))
    }

    /// A new user handle to `cell`.
    pub(crate) fn from_cell(cell: &Arc<Cell>) -> Buffer {
        cell.users.fetch_add(1, Ordering::Relaxed);
        Buffer { cell: cell.clone() }
    }

    pub(crate) fn cell(&self) -> &Arc<Cell> {
        &self.cell
    }

    /// The device address, or why the memory may no longer be read.
    #[inline]
    pub fn addr(&self) -> Result<DevicePtr, BufferError> {
        if self.cell.is_valid() {
            Ok(self.cell.addr)
        } else {
            Err(self.cell.error())
        }
    }

    /// The address `offset` bytes into this buffer, for operation `op` of device `device`
    /// touching `extent` bytes from there: what a backend's typed launch checks each buffer
    /// argument with, so the driver only ever sees live memory of its own device. Errors:
    /// another device's buffer, or a range past the buffer's end (`InvalidArgument`); memory
    /// graft reused or freed (`InvalidBuffer`, with the buffer's error).
    pub fn device_addr(
        &self,
        op: DeviceOp,
        device: DeviceId,
        offset: usize,
        extent: usize,
    ) -> Result<DevicePtr, DeviceError> {
        if self.cell.device != device {
            return Err(DeviceError::InvalidArgument {
                op,
                what: "a buffer argument belongs to another device",
            });
        }
        if offset
            .checked_add(extent)
            .is_none_or(|end| end > self.cell.len)
        {
            return Err(DeviceError::InvalidArgument {
                op,
                what: "a buffer argument's range runs past the buffer's end",
            });
        }
        let addr = self
            .addr()
            .map_err(|source| DeviceError::InvalidBuffer { op, source })?;
        Ok(addr.offset(offset))
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.cell.len
    }

    /// Whether the buffer has zero length.
    pub fn is_empty(&self) -> bool {
        self.cell.len == 0
    }

    /// Whether the memory may still be read.
    pub fn is_valid(&self) -> bool {
        self.cell.is_valid()
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> DeviceId {
        self.cell.device
    }

    /// The generation (step) that produced this buffer.
    pub fn generation(&self) -> u64 {
        self.cell.generation()
    }

    /// The node whose recording or replay produced this buffer, if any.
    pub fn node(&self) -> Option<NodeId> {
        self.cell.node()
    }

    /// Declares that this buffer's address is stable across calls (a weight, a KV cache):
    /// wherever it is passed as an input it is used in place and never copied.
    pub fn mark_static(&self) {
        self.cell.is_static.store(true, Ordering::Relaxed);
    }

    /// Declares that a call uses this buffer in place, at whatever address the caller passes:
    /// the body reads (and may write) the caller's buffer directly, as an eager run would,
    /// and a replay patches the graph's kernels to the buffer of its call instead of copying
    /// it (see `Device::redirect`). Where the device cannot follow every use, the graph
    /// replays only at the address it was recorded with. For inputs that move every call
    /// (a framework's fresh token tensor) and must not cost a copy.
    pub fn mark_in_place(&self) {
        self.cell.in_place.store(true, Ordering::Relaxed);
    }

    /// Whether two handles share one storage.
    pub fn same_storage(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.cell, &other.cell)
    }
}

impl Clone for Buffer {
    fn clone(&self) -> Buffer {
        Buffer::from_cell(&self.cell)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.cell.users.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        let owned = self.cell.owner.swap(0, Ordering::AcqRel);
        if owned == 0 {
            return;
        }
        if let Some(pool) = self.cell.pool.as_ref().and_then(Weak::upgrade) {
            let mut pool = pool.lock().unwrap_or_else(PoisonError::into_inner);
            // An unknown id means a restore already rebuilt the bookkeeping without this
            // block (ids are never reused), so there is nothing left to free.
            let _ = pool.free(BlockId(owned - 1));
        }
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &self.cell.addr)
            .field("len", &self.cell.len)
            .field("valid", &self.cell.is_valid())
            .field("function", &self.cell.function)
            .field("generation", &self.cell.generation())
            .finish()
    }
}
