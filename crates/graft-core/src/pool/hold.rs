//! Frees held back while a fork runs work on two streams: a block freed between a fork and its join goes to the free lists only at the join.
//!
//! Between [`Pool::hold_frees`] and [`Pool::release_held`], [`Pool::free`] checks the id and
//! keeps the block allocated in the bookkeeping (its bytes still count in `allocated`), so no
//! allocation can be handed the block while the other stream's work may still use it: stream
//! order no longer protects memory once two streams run concurrently. The rollback and the
//! restore install a new layout and forget what was held, as they forget every other id.

use super::{BlockId, Pool, PoolError};

#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
impl Pool {
    /// Starts holding frees back (a fork opened). Holding already: nothing changes.
    pub fn hold_frees(&mut self) {
        self.held.get_or_insert_with(Vec::new);
    }

    /// Whether frees are being held back.
    #[cfg(feature = "test-support")]
    pub fn is_holding(&self) -> bool {
        self.held.is_some()
    }

    /// The blocks freed and held back since [`Pool::hold_frees`], in free order.
    #[cfg(feature = "test-support")]
    pub fn held(&self) -> &[BlockId] {
        self.held.as_deref().unwrap_or(&[])
    }

    /// [`Pool::free`] while holding: checks that `id` is allocated and not already held, and
    /// holds it. Returns its size.
    pub(super) fn hold(&mut self, id: BlockId) -> Result<usize, PoolError> {
        let size = self
            .ids
            .get(&id)
            .and_then(|addr| self.blocks.get(addr))
            .map(|slot| slot.size)
            .ok_or(PoolError::UnknownBlock { id })?;
        let held = self.held.get_or_insert_with(Vec::new);
        if held.contains(&id) {
            return Err(PoolError::UnknownBlock { id });
        }
        held.push(id);
        Ok(size)
    }

    /// Stops holding (the join) and frees every held block, in free order. Returns the bytes
    /// freed. Every block is attempted; the first error is returned after all of them (a block
    /// a restore or rollback made stale meanwhile is not one: it is simply gone).
    pub fn release_held(&mut self) -> Result<usize, PoolError> {
        let mut freed = 0;
        let mut first = None;
        for id in self.held.take().unwrap_or_default() {
            match self.free(id) {
                Ok(bytes) => freed += bytes,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(freed), Err)
    }
}
