//! The one-shot all-reduce over peer memory, for small messages: one kernel on the runtime
//! stream in which every rank writes its message into every peer's workspace over NVLink,
//! raises a flag there, waits for the peers' flags in its own, and sums the ranks' messages in
//! rank order (`kernel.rs` has the algorithm and why its two parities suffice). An
//! [`NcclComm`] takes it for messages up to its limit ([`NcclComm::set_one_shot_limit`]) when
//! every rank's GPU reaches every other's memory; NCCL otherwise.
//!
//! `setup.rs` makes each rank's part and agrees on the path: peer access between the devices
//! of one process (`init_all`), or CUDA IPC handles exchanged over the communicator itself
//! (`init_rank`); `twin.rs` is the same sum on the host, the GPU tests' oracle.
//!
//! Each rank owns one `cuMemAlloc` workspace (not graft's pool: CUDA IPC does not export
//! `cuMemCreate` memory) and one pinned host word mapped into the device, the abort word:
//! [`NcclComm::abort`] sets it, and a kernel waiting on a peer that never comes returns.

mod kernel;
mod setup;
mod twin;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use graft_core::DeviceError;

use super::gather::Gather;
use super::status::OP;
use super::{NcclComm, NcclDtype};
use crate::device::CudaQueue;
use crate::driver;
use crate::module::{CudaModule, KernelArg};

pub(crate) use kernel::CAPACITY;
use kernel::{KERNELS, Layout, THREADS, blocks};
pub(super) use setup::{enable_all, enable_rank};
pub use twin::one_shot_sum;

/// How long dropping a blocking communicator (`init_all`'s, which has no deadline) waits for
/// its stream's last one-shot kernels before it raises the abort word.
const DRAIN: Duration = Duration::from_secs(30);

/// How long it then waits for aborted kernels to return before it keeps the workspace.
const ABORTED_DRAIN: Duration = Duration::from_secs(2);

/// Whether an all-reduce of `bytes` takes the one-shot path under `limit` (0 where the path is
/// off): the same answer on every rank, since every rank passes the same sizes and the ranks
/// agreed on whether the path is on.
pub(super) fn takes_one_shot(bytes: usize, limit: usize) -> bool {
    bytes > 0 && bytes <= limit
}

/// The limit [`NcclComm::set_one_shot_limit`] keeps for `asked` bytes: at most the workspace's
/// [`CAPACITY`], and 0 where the path is off.
pub(super) fn effective_limit(asked: usize, available: bool) -> usize {
    if available { asked.min(CAPACITY) } else { 0 }
}

/// One rank's one-shot all-reduce: its own memory and kernels, and how it reaches its peers'.
pub(super) struct OneShot {
    local: Local,
    rank: usize,
    peers: Peers,
}

/// How a rank reaches its peers' workspaces (their addresses are in its workspace's table).
enum Peers {
    /// Ranks of one process (`init_all`): by their own addresses, peer access enabled.
    Direct,
    /// Ranks as processes (`init_rank`): the peers' workspaces mapped from their IPC handles
    /// (closed on release), and the exchange that is the ranks' barrier before each frees
    /// its own (a workspace must outlive every process's mapping of it).
    Ipc { opened: Vec<u64>, barrier: Gather },
}

/// What one rank makes for itself: the workspace, the abort word, the kernels. Released in
/// `Drop` unless kept ([`Local::keep`]).
struct Local {
    queue: CudaQueue,
    layout: Layout,
    module: Option<CudaModule>,
    /// The workspace (`cuMemAlloc`); 0 until made.
    workspace: u64,
    /// The abort word, pinned host memory mapped into the device; null until made.
    abort_host: *mut u32,
    /// Its address on the device.
    abort_device: u64,
}

// SAFETY: `abort_host` is pinned host memory written only through atomics (`raise_abort`) and
// read by the device; the workspace and the module are driver objects any thread may use once
// the context is current (every use makes it current). Everything is released once, in
// `Drop`, which has exclusive access.
unsafe impl Send for Local {}
// SAFETY: as for `Send`: shared references only store to the abort word atomically and
// launch kernels, which the driver allows from several threads.
unsafe impl Sync for Local {}

impl Local {
    /// The workspace for `world` ranks (its flags and counters zeroed), the abort word (0) and
    /// the kernels, on `queue`'s device, whose runtime stream must not be capturing.
    fn make(queue: &CudaQueue, world: usize) -> Result<Local, DeviceError> {
        let layout = Layout { world };
        let mut local = Local {
            queue: queue.clone(),
            layout,
            module: None,
            workspace: 0,
            abort_host: std::ptr::null_mut(),
            abort_device: 0,
        };
        // From here on an early return drops `local`, which releases what was made.
        let inner = &queue.inner;
        inner.make_current(OP)?;
        // Freed once, in `Drop`.
        local.workspace = driver::memory::alloc(OP, layout.bytes())?;
        let header = vec![0u8; layout.bytes() - layout.flags_at()];
        driver::memory::write_sync(
            OP,
            local.workspace + layout.flags_at() as u64,
            &header,
            inner.stream,
        )?;
        // Freed once, in `Drop`.
        local.abort_host = driver::peer::alloc_host_mapped(OP, 4)?.cast();
        local.abort_word().store(0, Ordering::SeqCst);
        local.abort_device = driver::peer::host_device_pointer(OP, local.abort_host.cast())?;
        local.module = Some(queue.load_module(&kernel::source(), &KERNELS)?);
        Ok(local)
    }

    /// The abort word. Only for a made `Local` (non-null `abort_host`).
    fn abort_word(&self) -> &AtomicU32 {
        // SAFETY: `abort_host` is 4 bytes of pinned host memory from `cuMemHostAlloc`
        // (page-aligned, so aligned for a u32), live until `Drop` frees it (which needs
        // exclusive access, so no reference from here outlives it); the host touches it only
        // through this atomic, the device only reads it.
        unsafe { AtomicU32::from_ptr(self.abort_host) }
    }

    /// Writes every rank's workspace address (in this process) into this one's table.
    fn write_table(&self, bases: &[u64]) -> Result<(), DeviceError> {
        let bytes: Vec<u8> = bases.iter().flat_map(|b| b.to_ne_bytes()).collect();
        let inner = &self.queue.inner;
        inner.make_current(OP)?;
        let at = self.workspace + self.layout.table_at() as u64;
        driver::memory::write_sync(OP, at, &bytes, inner.stream)
    }

    /// Keeps the workspace and the abort word for the process's life (a peer may have them
    /// mapped); the module is still unloaded.
    fn keep_memory(&mut self) {
        self.workspace = 0;
        self.abort_host = std::ptr::null_mut();
    }

    /// Keeps the workspace, the abort word and the module (and so the device) for the
    /// process's life: a kernel may still use them.
    fn keep(&mut self) {
        self.keep_memory();
        std::mem::forget(self.module.take());
    }
}

impl Drop for Local {
    /// Unloads the module and frees the abort word and the workspace; errors go to the
    /// device's sticky slot. No kernel of this rank may still run (the caller drained the
    /// stream, or kept them).
    fn drop(&mut self) {
        let inner = &self.queue.inner;
        if let Err(e) = inner.make_current(OP) {
            inner.record_sticky(e);
            return;
        }
        // `CudaModule`'s own `Drop` unloads it (errors to the sticky slot).
        drop(self.module.take());
        if !self.abort_host.is_null() {
            // Pinned memory from `cuMemHostAlloc` in `make`, read by no running kernel, freed
            // exactly once here.
            inner.sticky_on_error(driver::memory::free_host(OP, self.abort_host.cast()));
        }
        if self.workspace != 0 {
            // Device memory from `cuMemAlloc` in `make`, used by no running kernel, freed
            // exactly once here.
            inner.sticky_on_error(driver::memory::free(OP, self.workspace));
        }
    }
}

impl OneShot {
    /// Enqueues the one-shot all-reduce of `count` elements of `dtype` at `at` on the runtime
    /// stream (captured when it is capturing): a plain launch, never a programmatic
    /// dependent, so it starts after the kernel before it ended. The caller checked that the
    /// message is at most [`CAPACITY`] bytes and not empty.
    pub(super) fn launch(
        &self,
        at: u64,
        count: usize,
        dtype: NcclDtype,
    ) -> Result<(), DeviceError> {
        let Some(module) = &self.local.module else {
            return Err(DeviceError::CollectiveAborted { op: OP });
        };
        let kernel = match dtype {
            NcclDtype::F32 => 0,
            NcclDtype::Bf16 => 1,
            NcclDtype::F16 => 2,
        };
        let args = [
            KernelArg::U64(at),
            KernelArg::U64(count as u64),
            KernelArg::U64(self.local.workspace),
            KernelArg::U64(self.local.abort_device),
            KernelArg::U32(self.rank as u32),
            KernelArg::U32(self.local.layout.world as u32),
        ];
        let grid = (blocks(count * dtype.size()), 1, 1);
        self.local
            .queue
            .launch_function(module, kernel, grid, (THREADS, 1, 1), 0, &args)
    }

    /// Sets the abort word: every one-shot kernel of this rank running or launched from now
    /// on returns instead of waiting for its peers (its data is then undefined).
    pub(super) fn raise_abort(&self) {
        self.local.abort_word().store(1, Ordering::SeqCst);
    }

    /// Whether the runtime stream ran everything enqueued on it within `limit` (an error
    /// asking counts as no).
    fn drained(&self, limit: Duration) -> bool {
        let inner = &self.local.queue.inner;
        let until = Instant::now() + limit;
        let mut pause = Duration::from_micros(50);
        loop {
            match driver::stream::query(OP, inner.stream) {
                Ok(true) => return true,
                Ok(false) if Instant::now() < until => std::thread::sleep(pause),
                _ => return false,
            }
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Releases this rank's part, once the runtime stream ran its last one-shot kernels (at
    /// most the communicator's deadline; past it the abort word is raised). Ranks as
    /// processes close their mappings of the peers' workspaces, then wait for every rank to
    /// have done so (a barrier over `comm`, while it is live) before freeing their own. Where
    /// a kernel may still run, or the barrier fails, the memory is kept (a warning says so).
    pub(super) fn release(mut self, comm: &NcclComm) {
        let inner = self.local.queue.inner.clone();
        if let Err(e) = inner.make_current(OP) {
            inner.record_sticky(e);
            self.local.keep();
            return;
        }
        let limit = comm.deadline.unwrap_or(DRAIN);
        if !self.drained(limit) {
            self.raise_abort();
            if !self.drained(ABORTED_DRAIN) {
                tracing::warn!(
                    rank = self.rank,
                    "a one-shot all-reduce kernel may still run: its workspace is kept, not freed"
                );
                self.local.keep();
                return;
            }
        }
        let Peers::Ipc { opened, barrier } = &mut self.peers else {
            return;
        };
        for at in opened.drain(..) {
            // Opened in setup, closed once here; this rank's kernels are done (drained).
            inner.sticky_on_error(driver::peer::ipc_close(OP, at));
        }
        let start = Instant::now();
        let words = vec![0; comm.world * setup::PART];
        let agreed =
            !comm.lock().is_null() && barrier.exchange(comm, &words, start, start + limit).is_ok();
        if !agreed {
            tracing::warn!(
                rank = self.rank,
                "the ranks did not all close their mappings of the one-shot all-reduce's workspaces (a peer is gone or the communicator was aborted): this rank's is kept, not freed"
            );
            self.local.keep_memory();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_depends_on_the_size_and_the_limit_alone() {
        assert!(
            !takes_one_shot(0, CAPACITY),
            "an empty message goes to NCCL"
        );
        assert!(takes_one_shot(2, CAPACITY));
        assert!(takes_one_shot(CAPACITY, CAPACITY));
        assert!(!takes_one_shot(CAPACITY + 2, CAPACITY));
        assert!(!takes_one_shot(4, 0), "limit 0: NCCL always");
        assert!(takes_one_shot(4096, 4096) && !takes_one_shot(4100, 4096));
    }

    #[test]
    fn the_limit_is_capped_by_the_workspace_and_zero_without_the_path() {
        assert_eq!(effective_limit(usize::MAX, true), CAPACITY);
        assert_eq!(effective_limit(1000, true), 1000);
        assert_eq!(effective_limit(0, true), 0);
        assert_eq!(effective_limit(1000, false), 0);
    }
}
