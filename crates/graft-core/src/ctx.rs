//! The context a function's body runs with: its inputs, the device's queue, and allocation
//! from the right pool.

use std::sync::{Arc, Mutex, PoisonError};

use crate::buffer::{Buffer, Cell};
use crate::device::{Device, DeviceError, DevicePtr};
use crate::pool::{Pool, PoolError};

/// How the body is being run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RunKind {
    /// Eagerly, allocating from the graph pool (a warmup).
    Warmup,
    /// Under capture: launches are recorded, not run. Do not read results on the host.
    Recording,
    /// Eagerly, outside the graph pool (eager-only functions and fallbacks).
    Eager,
}

/// What the body sees: the inputs to use (during a recording, copied inputs are replaced by
/// their placeholders), the queue to launch on, and `alloc` for every buffer it makes. Nothing
/// here reaches the device's capture, mapping, graph or error-slot operations.
pub struct Ctx<'a, D: Device> {
    pub(crate) device: &'a D,
    pub(crate) inputs: &'a [Buffer],
    pub(crate) pool: &'a Arc<Mutex<Pool>>,
    /// The other pool of the runtime, released from on out-of-memory outside a capture.
    pub(crate) sibling: &'a Mutex<Pool>,
    pub(crate) function: &'a Arc<str>,
    pub(crate) generation: u64,
    pub(crate) kind: RunKind,
    /// Cells allocated by this run, in order.
    pub(crate) allocs: Vec<Arc<Cell>>,
    /// Where the body stands with respect to forks and conditionals (`fork.rs`).
    pub(crate) scope: Scope,
}

/// What a body is inside of: a fork (`Ctx::fork`), a conditional's body, or neither. They do
/// not nest in each other, nor a fork in a fork.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) enum Scope {
    /// Straight-line work on the runtime stream.
    #[default]
    Top,
    /// Between a fork and its join.
    Forked,
    /// Inside a conditional's body.
    Conditional,
}

impl<'a, D: Device> Ctx<'a, D> {
    /// The queue to enqueue work on: the device's runtime stream, as a body may use it
    /// (see [`Device::Queue`]).
    pub fn queue(&self) -> &'a D::Queue {
        self.device.queue()
    }

    /// The inputs to use, in call order. Always read inputs from here, not from captured
    /// variables: during a recording, copied inputs are replaced by graft's placeholders.
    pub fn inputs(&self) -> &'a [Buffer] {
        self.inputs
    }

    /// The input at `position`.
    ///
    /// # Panics
    /// If `position` is out of range (a bug in the body, like any slice index).
    pub fn input(&self, position: usize) -> &'a Buffer {
        &self.inputs[position]
    }

    /// How the body is being run.
    pub fn kind(&self) -> RunKind {
        self.kind
    }

    /// Allocates `bytes` from graft's pool for this run. Every buffer a body makes must come
    /// from here: that is what lets graft reuse memory across the whole tree. Its error
    /// converts into any [`crate::BodyError`] with `?`.
    pub fn alloc(&mut self, bytes: usize) -> Result<Buffer, PoolError> {
        let device = self.device;
        if bytes == 0 {
            let cell = Cell::new(
                DevicePtr(0),
                0,
                device.id(),
                self.function.clone(),
                self.generation,
                None,
            );
            return Ok(Buffer::from_cell(&cell));
        }
        let reclaim = if self.kind == RunKind::Recording {
            Reclaim::Never
        } else {
            Reclaim::Unused {
                sibling: self.sibling,
            }
        };
        let (cell, buffer) = alloc_owned(
            self.pool,
            device,
            bytes,
            self.function.clone(),
            self.generation,
            reclaim,
        )?;
        self.allocs.push(cell);
        Ok(buffer)
    }

    /// Allocates a buffer for `n` f32 values.
    pub fn alloc_f32(&mut self, n: usize) -> Result<Buffer, PoolError> {
        self.alloc(n * 4)
    }
}

/// What [`alloc_owned`] may do when the device is out of memory.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Reclaim<'a> {
    /// Nothing: fail at once. During a capture (unmapping is illegal there) and between a
    /// checkpoint and its rollback (releasing could unmap the checkpoint's blocks).
    Never,
    /// Release the memory no block and no pin uses, from the allocating pool and from
    /// `sibling` (the two pools compete for one device), then retry once.
    Unused {
        /// The runtime's other pool.
        sibling: &'a Mutex<Pool>,
    },
}

/// Unmaps the memory of `pool` that no block and no recorded graph uses (see
/// [`Pool::release_unused`]) and returns the bytes released. A failure is logged, not returned:
/// this runs on the way to reporting an out-of-memory error, which is the error that matters.
/// Call it only outside a capture, and never between a checkpoint of `pool` and its rollback.
pub(crate) fn release_unused<D: Device>(pool: &mut Pool, device: &D) -> usize {
    match pool.release_unused(device) {
        Ok(bytes) => bytes,
        Err(error) => {
            tracing::debug!(%error, "releasing unused pool memory failed");
            0
        }
    }
}

/// Allocates `bytes` from `pool` and returns a cell owning the block, with one handle: the
/// block goes back to the pool when the last handle drops. On out-of-memory, `reclaim` says
/// whether to release unused memory and retry once; a final out-of-memory is
/// [`PoolError::OutOfMemory`], with what the pool holds.
pub(crate) fn alloc_owned<D: Device>(
    pool: &Arc<Mutex<Pool>>,
    device: &D,
    bytes: usize,
    function: Arc<str>,
    generation: u64,
    reclaim: Reclaim<'_>,
) -> Result<(Arc<Cell>, Buffer), PoolError> {
    let mut guard = pool.lock().unwrap_or_else(PoisonError::into_inner);
    let mut result = guard.alloc(bytes, device);
    if is_oom(&result)
        && let Reclaim::Unused { sibling } = reclaim
    {
        let mut released = release_unused(&mut guard, device);
        drop(guard);
        if !std::ptr::eq(sibling, &**pool) {
            let mut other = sibling.lock().unwrap_or_else(PoisonError::into_inner);
            released += release_unused(&mut other, device);
        }
        tracing::debug!(
            released,
            bytes,
            "out of device memory: released unused pool memory, retrying"
        );
        guard = pool.lock().unwrap_or_else(PoisonError::into_inner);
        result = guard.alloc(bytes, device);
    }
    let block = match result {
        Ok(block) => block,
        Err(PoolError::Grow {
            source: source @ DeviceError::OutOfMemory { .. },
            ..
        }) => {
            let stats = guard.stats();
            return Err(PoolError::OutOfMemory {
                bytes,
                mapped: stats.mapped,
                allocated: stats.allocated,
                source,
            });
        }
        Err(e) => return Err(e),
    };
    let cell = Cell::new(
        block.addr,
        bytes,
        device.id(),
        function,
        generation,
        Some(Arc::downgrade(pool)),
    );
    let buffer = Buffer::from_cell(&cell);
    cell.adopt(block.id, &mut guard);
    Ok((cell, buffer))
}

/// Whether an allocation failed for want of device memory.
fn is_oom<T>(result: &Result<T, PoolError>) -> bool {
    matches!(
        result,
        Err(PoolError::Grow {
            source: DeviceError::OutOfMemory { .. },
            ..
        })
    )
}

impl<D: Device> std::fmt::Debug for Ctx<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("function", self.function)
            .field("kind", &self.kind)
            .field("inputs", &self.inputs.len())
            .finish_non_exhaustive()
    }
}
