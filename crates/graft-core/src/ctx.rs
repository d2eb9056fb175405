//! The context a function's body runs with: its inputs, the device, and allocation from the
//! right pool.

use std::sync::{Arc, Mutex, PoisonError};

use crate::buffer::{Buffer, Cell};
use crate::device::{Device, DevicePtr};
use crate::error::BodyError;
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
/// their placeholders), the device to launch on, and `alloc` for every buffer it makes.
pub struct Ctx<'a, D: Device> {
    pub(crate) device: &'a D,
    pub(crate) inputs: &'a [Buffer],
    pub(crate) pool: &'a Arc<Mutex<Pool>>,
    pub(crate) function: &'a Arc<str>,
    pub(crate) generation: u64,
    pub(crate) kind: RunKind,
    /// Cells allocated by this run, in order.
    pub(crate) allocs: Vec<Arc<Cell>>,
}

impl<'a, D: Device> Ctx<'a, D> {
    /// The device to launch work on (its runtime stream).
    pub fn device(&self) -> &'a D {
        self.device
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
    /// from here: that is what lets graft reuse memory across the whole tree.
    pub fn alloc(&mut self, bytes: usize) -> Result<Buffer, BodyError> {
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
        let (cell, buffer) = alloc_owned(
            self.pool,
            device,
            bytes,
            self.function.clone(),
            self.generation,
        )?;
        self.allocs.push(cell);
        Ok(buffer)
    }

    /// Allocates a buffer for `n` f32 values.
    pub fn alloc_f32(&mut self, n: usize) -> Result<Buffer, BodyError> {
        self.alloc(n * 4)
    }
}

/// Allocates `bytes` from `pool` and returns a cell owning the block, with one handle: the
/// block goes back to the pool when the last handle drops.
pub(crate) fn alloc_owned<D: Device>(
    pool: &Arc<Mutex<Pool>>,
    device: &D,
    bytes: usize,
    function: Arc<str>,
    generation: u64,
) -> Result<(Arc<Cell>, Buffer), PoolError> {
    let mut guard = pool.lock().unwrap_or_else(PoisonError::into_inner);
    let block = guard.alloc(bytes, &mut |n| device.alloc_segment(n))?;
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

impl<D: Device> std::fmt::Debug for Ctx<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("function", self.function)
            .field("kind", &self.kind)
            .field("inputs", &self.inputs.len())
            .finish_non_exhaustive()
    }
}
