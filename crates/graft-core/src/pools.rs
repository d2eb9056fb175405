//! The runtime's memory: the graph pool and the eager pool, and the cells graft must be able
//! to invalidate (loose graph-pool cells, eager cells, the handed-out list). Changed only
//! through its methods.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::buffer::Cell;
use crate::node_id::NodeId;
use crate::pool::Pool;

/// Locks a pool; a poisoned lock is taken as it is (the pool's bookkeeping is updated whole
/// under the lock).
pub(crate) fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Cells graft must be able to invalidate, pruned of unheld ones once the list has doubled.
#[derive(Default)]
struct Registry {
    cells: Vec<Arc<Cell>>,
    pruned_at: usize,
}

impl Registry {
    /// Adds the held ones of `cells`.
    fn extend(&mut self, cells: impl IntoIterator<Item = Arc<Cell>>) {
        self.cells.extend(cells.into_iter().filter(|c| c.is_held()));
        if self.cells.len() >= 2 * self.pruned_at.max(32) {
            self.cells.retain(|c| c.is_held());
            self.pruned_at = self.cells.len();
        }
    }
}

/// The pools and the cells out of them. Invariants: a cell is in `handed` at most once (its
/// listed mark says so); `stale` is set by every replay and cleared only by a restore or a
/// reset, and nothing allocates from the graph pool while it is set.
pub(crate) struct Pools {
    graph: Arc<Mutex<Pool>>,
    eager: Arc<Mutex<Pool>>,
    /// After a replay the pool bookkeeping describes the last recording, not the memory in
    /// use: it must be restored before anything allocates from it.
    stale: bool,
    /// Cells of graph-pool memory not owned by a node output slot (warmup outputs, held
    /// intermediates, placeholders handed to bodies). Pruned of unheld cells now and then.
    loose: Registry,
    /// Cells of eager-pool memory, so `Drop` can invalidate them.
    eager_cells: Registry,
    /// Graph-pool cells handed to callers or kept by bodies that may still be held: what a
    /// replay must invalidate when its graph overwrites them. Each cell appears once; cells
    /// nobody holds are dropped from the list by the next replay's scan, so a replay costs
    /// the number of held cells, however large the tree.
    handed: Vec<Arc<Cell>>,
}

impl Pools {
    /// Two empty pools, each reserving `reservation` bytes of address range.
    pub(crate) fn new(reservation: usize) -> Pools {
        Pools {
            graph: Arc::new(Mutex::new(Pool::new(reservation))),
            eager: Arc::new(Mutex::new(Pool::new(reservation))),
            stale: false,
            loose: Registry::default(),
            eager_cells: Registry::default(),
            handed: Vec::new(),
        }
    }

    /// The graph pool (shared with the cells allocated from it and the bodies' contexts).
    pub(crate) fn graph(&self) -> &Arc<Mutex<Pool>> {
        &self.graph
    }

    /// The eager pool (shared like the graph pool).
    pub(crate) fn eager(&self) -> &Arc<Mutex<Pool>> {
        &self.eager
    }

    /// Whether `cell` is memory of either pool.
    pub(crate) fn owns(&self, cell: &Cell) -> bool {
        cell.in_pool(&self.graph) || cell.in_pool(&self.eager)
    }

    /// Whether replays ran since the graph pool's bookkeeping was last true.
    pub(crate) fn is_stale(&self) -> bool {
        self.stale
    }

    /// A replay ran: the graph pool's bookkeeping no longer describes the memory in use.
    pub(crate) fn replayed(&mut self) {
        self.stale = true;
    }

    /// The graph pool's bookkeeping was rebuilt (or emptied): it is true again.
    pub(crate) fn restored(&mut self) {
        self.stale = false;
    }

    /// Adds the held ones of `cells` not yet listed to the handed-out list.
    pub(crate) fn list_held<'a>(&mut self, cells: impl IntoIterator<Item = &'a Arc<Cell>>) {
        for c in cells {
            if c.is_held() && c.mark_listed() {
                self.handed.push(Arc::clone(c));
            }
        }
    }

    /// Keeps graph-pool cells no node output slot owns (their held ones).
    pub(crate) fn keep_loose(&mut self, cells: impl IntoIterator<Item = Arc<Cell>>) {
        self.loose.extend(cells);
    }

    /// Keeps eager-pool cells (their held ones).
    pub(crate) fn keep_eager(&mut self, cells: impl IntoIterator<Item = Arc<Cell>>) {
        self.eager_cells.extend(cells);
    }

    /// The loose graph-pool cells.
    pub(crate) fn loose(&self) -> &[Arc<Cell>] {
        &self.loose.cells
    }

    /// Invalidates the loose cells with `invalidate` and forgets them.
    pub(crate) fn forget_loose(&mut self, invalidate: fn(&Cell)) {
        self.loose.cells.drain(..).for_each(|c| invalidate(&c));
    }

    /// Invalidates the eager cells (their runtime was dropped) and forgets them.
    pub(crate) fn forget_eager(&mut self) {
        self.eager_cells
            .cells
            .drain(..)
            .for_each(|c| c.invalidate_dropped());
    }

    /// Empties the handed-out list.
    pub(crate) fn unlist_all(&mut self) {
        self.handed.drain(..).for_each(|c| c.unlist());
    }

    /// Before a replay of node `node` whose graph writes where `overwrites` says: invalidates
    /// the held cells it overwrites, and drops the cells nobody holds from the handed-out
    /// list. Returns how many were invalidated. O(held cells).
    #[inline]
    pub(crate) fn invalidate_overwritten(
        &mut self,
        node: NodeId,
        overwrites: impl Fn(u64, u64) -> bool,
    ) -> u64 {
        let mut invalidated = 0;
        let mut i = 0;
        while let Some(cell) = self.handed.get(i) {
            if !cell.is_held() {
                cell.unlist();
                self.handed.swap_remove(i);
                continue;
            }
            if cell.is_valid() && overwrites(cell.addr().0, cell.end()) {
                cell.invalidate_overwritten(Some(node));
                invalidated += 1;
            }
            i += 1;
        }
        invalidated
    }
}
