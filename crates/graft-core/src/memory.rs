//! The pools seen from the runtime: restoring the graph pool after replays, the eager-memory
//! API (`alloc`, `copy_out`, `read`, `write`), `reset` and `Drop`.

use std::sync::Arc;

use crate::buffer::{Buffer, Cell};
use crate::ctx::{Reclaim, alloc_owned};
use crate::device::{CORE, Device, DevicePtr};
use crate::error::{FunctionId, MemoryError};
use crate::graft::Graft;
use crate::group::Member;
use crate::pools::lock;
use crate::reason::Decision;
use crate::tree::{OutputSlot, key_of};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Before a warmup or recording: if replays ran since the bookkeeping was last true, the
    /// path diverged from the recorded tree here, and the pool is restored.
    pub(crate) fn diverge_if_replayed(&mut self, function: FunctionId) {
        if self.pools.is_stale() {
            let _span = tracing::debug_span!(
                "divergence",
                function = %self.functions[function].name,
                tip = ?self.phase.tip()
            )
            .entered();
            self.restore(function);
        }
    }

    /// Rebuilds the graph pool's bookkeeping from what is actually held (after replays).
    fn restore(&mut self, function: FunctionId) {
        let _span =
            tracing::debug_span!("restore", function = %self.functions[function].name).entered();
        let mut held: Vec<Arc<Cell>> = Vec::new();
        let mut consider = |c: &Arc<Cell>| {
            c.disown();
            if c.is_readable_by_someone() && c.len() > 0 {
                held.push(c.clone());
            }
        };
        for node in self.tree.values() {
            for o in &node.outputs {
                if let OutputSlot::Tracked { cell, spares } = &o.slot {
                    consider(cell);
                    spares.iter().for_each(&mut consider);
                }
            }
        }
        self.pools.loose().iter().for_each(&mut consider);
        let live: Vec<(DevicePtr, usize)> = held.iter().map(|c| (c.addr(), c.len())).collect();
        let mut pool = lock(self.pools.graph());
        let placed = pool.restore(&live);
        let mut invalidated = 0;
        for (cell, block) in held.iter().zip(&placed) {
            match block {
                Some(b) => cell.adopt(b.id, &mut pool),
                None => {
                    cell.invalidate_reclaimed();
                    invalidated += 1;
                }
            }
        }
        drop(pool);
        self.pools.restored();
        self.stats.restores += 1;
        self.stats.invalidations += invalidated as u64;
        let kept = held.len() - invalidated;
        tracing::debug!(kept, invalidated, "pool restored");
        let tip = self.phase.tip().map(key_of);
        self.log(function, tip, Decision::Restore { kept, invalidated });
    }

    /// Allocates `bytes` outside the graph pool, for memory that lives across steps
    /// (weights, caches, copies). Freed when the last handle drops.
    pub fn alloc(&mut self, bytes: usize) -> Result<Buffer, MemoryError> {
        if let Some(e) = self.device.take_sticky_error(CORE) {
            return Err(e.into());
        }
        let (cell, buffer) = alloc_owned(
            self.pools.eager(),
            &self.device,
            bytes,
            Arc::from("alloc"),
            self.generation,
            Reclaim::Unused {
                sibling: self.pools.graph(),
            },
        )?;
        self.pools.keep_eager([cell]);
        Ok(buffer)
    }

    fn check_device(&self, buffer: &Buffer) -> Result<DevicePtr, MemoryError> {
        if buffer.device() != self.device.id() {
            return Err(MemoryError::WrongDevice {
                expected: self.device.id(),
                found: buffer.device(),
            });
        }
        Ok(buffer.addr()?)
    }

    /// Copies a buffer into new memory outside the graph pool that the caller owns: it stays
    /// valid across steps.
    pub fn copy_out(&mut self, buffer: &Buffer) -> Result<Buffer, MemoryError> {
        let src = self.check_device(buffer)?;
        let copy = self.alloc(buffer.len())?;
        if !buffer.is_empty() {
            self.device.copy(CORE, copy.addr()?, src, buffer.len())?;
        }
        Ok(copy)
    }

    /// Reads a buffer's bytes to the host.
    pub fn read(&self, buffer: &Buffer, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.check_device(buffer)?;
        if dst.len() != buffer.len() {
            return Err(MemoryError::LengthMismatch {
                host: dst.len(),
                buffer: buffer.len(),
            });
        }
        self.device.read(CORE, src, dst)?;
        // Checked after the copy: a peer lost while the copy waited on its collectives aborted
        // them, so the bytes may be what an unfinished collective left.
        if let Some(source) = self
            .member
            .as_ref()
            .filter(|m| m.is_broken())
            .and_then(Member::refuse)
        {
            return Err(MemoryError::Group { source });
        }
        Ok(())
    }

    /// Writes host bytes into a buffer.
    pub fn write(&self, buffer: &Buffer, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.check_device(buffer)?;
        if src.len() != buffer.len() {
            return Err(MemoryError::LengthMismatch {
                host: src.len(),
                buffer: buffer.len(),
            });
        }
        Ok(self.device.write(CORE, dst, src)?)
    }

    /// Reads a buffer of f32 values.
    pub fn read_f32(&self, buffer: &Buffer) -> Result<Vec<f32>, MemoryError> {
        let mut bytes = vec![0u8; buffer.len()];
        self.read(buffer, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Writes f32 values into a buffer.
    pub fn write_f32(&self, buffer: &Buffer, values: &[f32]) -> Result<(), MemoryError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(buffer, &bytes)
    }

    /// Drops every graph and returns the graph pool's memory and address range to the device. Buffers still
    /// held from graph-pool memory become invalid (reading them returns
    /// [`crate::BufferError::Reset`]); memory from [`Graft::alloc`] and eager runs stays.
    pub fn reset(&mut self) -> Result<(), MemoryError> {
        let _span = tracing::info_span!("reset").entered();
        let synced = self.device.synchronize();
        self.invalidate_graph_memory(Cell::invalidate_reset);
        self.tree.clear();
        self.policy.clear_places();
        for f in self.functions.iter_mut() {
            for s in &mut f.sigs {
                s.warmups_done = 0;
            }
            f.root_level = false;
            f.warmed.clear();
        }
        self.pools.restored();
        self.pools.unlist_all();
        self.new_generation();
        let device = &self.device;
        let released = lock(self.pools.graph()).release_all(device);
        synced?;
        released?;
        if let Some(e) = self.device.take_sticky_error(CORE) {
            return Err(e.into());
        }
        Ok(())
    }

    /// Invalidates every graph-pool buffer graft handed out (node outputs, their spares,
    /// warmup and intermediate cells) with `invalidate`, and forgets the loose cells.
    fn invalidate_graph_memory(&mut self, invalidate: fn(&Cell)) {
        for node in self.tree.values() {
            for o in &node.outputs {
                if let OutputSlot::Tracked { cell, spares } = &o.slot {
                    invalidate(cell);
                    spares.iter().for_each(|c| invalidate(c));
                }
            }
        }
        self.pools.forget_loose(invalidate);
    }

    /// Closes the runtime: waits for the device, invalidates every buffer it handed out
    /// (reading one then says its runtime was dropped), destroys every graph and returns both
    /// pools' memory to the device. Returns the first error. Dropping the runtime does the
    /// same but can only log an error: close it to handle one.
    pub fn close(mut self) -> Result<(), MemoryError> {
        self.teardown()
    }

    /// What `close` and `Drop` do. Running it twice is harmless: the second finds nothing.
    fn teardown(&mut self) -> Result<(), MemoryError> {
        let synced = self.device.synchronize();
        self.invalidate_graph_memory(Cell::invalidate_dropped);
        self.pools.forget_eager();
        // Graph destruction reports failures to the sticky slot: taken below.
        self.tree.clear();
        let graph = lock(self.pools.graph()).release_all(&self.device);
        let eager = lock(self.pools.eager()).release_all(&self.device);
        let sticky = self.device.take_sticky_error(CORE);
        synced?;
        graph?;
        eager?;
        sticky.map_or(Ok(()), |e| Err(e.into()))
    }
}

impl<D: Device, M: Clone> Drop for Graft<D, M> {
    fn drop(&mut self) {
        if let Err(error) = self.teardown() {
            tracing::error!(%error, "tearing the graft runtime down failed; call Graft::close to handle this error");
        }
    }
}
