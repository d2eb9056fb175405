//! `SimDevice`: one simulated device with one stream, its capture state machine, counters and fault injection.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use graft_core::backend::{CopyEnds, CoreOnly, StickyError};
use graft_core::{
    Buffer, CaptureMode, CaptureViolation, Conditional, ConditionalRule, Device, DeviceError,
    DeviceId, DeviceOp, DevicePtr, GraphSummary, UpdateRefusal,
};

use crate::graph::{self, Op, SimGraph, Tally};
use crate::memory::{DEFAULT_MEMORY_LIMIT, GRANULARITY, SimMemory};

thread_local! {
    /// Set while this thread runs stream work (a kernel body), during which the device is locked.
    static ON_STREAM: Cell<bool> = const { Cell::new(false) };
}

/// Marks the current thread as running stream work until dropped (also on panic).
struct StreamGuard;

impl StreamGuard {
    fn enter() -> StreamGuard {
        ON_STREAM.with(|c| c.set(true));
        StreamGuard
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        ON_STREAM.with(|c| c.set(false));
    }
}

/// What a launch or update of another device's graph is refused with.
const FOREIGN_GRAPH: &str = "the graph was captured on another device";
const NO_CAPTURE: &str = "no capture is underway";
const CAPTURE_UNDERWAY: &str = "a capture is already underway";
const CAPTURE_INVALIDATED: &str = "an invalidated capture is underway";

/// Where the stream stands with respect to capture (`cudaStreamGetCaptureInfo`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CaptureStatus {
    /// Not capturing: work runs when it is enqueued.
    Idle,
    /// Capturing: work is recorded.
    Active {
        /// The mode the capture was begun with.
        mode: CaptureMode,
    },
    /// Capturing, but an earlier operation broke the capture; only ending or aborting it helps.
    Invalidated {
        /// The mode the capture was begun with.
        mode: CaptureMode,
    },
}

enum Capture {
    Idle,
    Recording {
        mode: CaptureMode,
        /// Where work is recorded now: the graph's top level, or the body of the innermost
        /// open conditional.
        ops: Vec<Op>,
        /// Work was forked onto the side stream and never joined back.
        unjoined: bool,
        /// Open conditional nodes, innermost last.
        open: Vec<OpenConditional>,
    },
    Invalidated {
        mode: CaptureMode,
    },
}

/// A conditional node being recorded: the work before it, and its bodies so far.
struct OpenConditional {
    kind: Conditional,
    selector: DevicePtr,
    /// The bodies already ended.
    done: Vec<Arc<[Op]>>,
    /// What was recorded before the node, at the level it belongs to.
    before: Vec<Op>,
}

/// What a conditional call finds when no capture, or no conditional, is open.
const NO_CONDITIONAL: &str = "no conditional node is open";

/// Everything behind the device lock.
struct State {
    mem: SimMemory,
    capture: Capture,
}

/// Counters readable without the lock.
#[derive(Default)]
pub(crate) struct Counters {
    mapped_bytes: AtomicUsize,
    reservations: AtomicUsize,
    live_raw_allocs: AtomicUsize,
    pub(crate) live_graphs: AtomicUsize,
    kernels_run: AtomicU64,
    copies_run: AtomicU64,
    graph_launches: AtomicU64,
    maps: AtomicU64,
}

/// Armed fault injection points; each fires once.
#[derive(Default)]
pub(crate) struct Faults {
    /// 0: off; k > 0: the k-th map from when it was armed fails.
    map_countdown: AtomicU64,
    instantiate: AtomicBool,
    launch: AtomicBool,
    /// Conditional nodes are refused, as by a driver older than CUDA 12.4.
    no_conditionals: AtomicBool,
    pub(crate) fail_next_graph_destroy: AtomicBool,
}

pub(crate) struct Inner {
    pub(crate) id: DeviceId,
    state: Mutex<State>,
    pub(crate) sticky: StickyError,
    pub(crate) counters: Counters,
    pub(crate) faults: Faults,
}

/// Counters of a [`SimDevice`], for tests.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SimStats {
    /// Bytes of pool memory mapped and not yet unmapped.
    pub mapped_bytes: usize,
    /// Address reservations made and not yet released.
    pub reservations: usize,
    /// Raw (user) allocations not yet freed.
    pub live_raw_allocs: usize,
    /// Graphs instantiated and not yet dropped.
    pub live_graphs: usize,
    /// Kernels executed, eagerly or by graph launches (recording one does not count).
    pub kernels_run: u64,
    /// Device-to-device copies executed, eagerly or by graph launches.
    pub copies_run: u64,
    /// Graph launches that ran to completion.
    pub graph_launches: u64,
    /// Successful [`Device::map`] calls.
    pub maps: u64,
}

/// A simulated CUDA device with one stream. Cloning it is cheap and shares the device.
///
/// See the crate documentation for the rules it enforces. It dereferences to its
/// [`SimQueue`], so eager code calls the queue's methods on the device.
#[derive(Clone)]
pub struct SimDevice {
    queue: SimQueue,
}

/// The body-facing handle of a [`SimDevice`] ([`graft_core::Device::Queue`]): kernels, copies,
/// host reads and writes, synchronize, on the device's one stream. There is no way from it
/// back to the device's capture, mapping, graph or error-slot operations.
#[derive(Clone)]
pub struct SimQueue {
    inner: Arc<Inner>,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDevice")
            .field("id", &self.queue.inner.id)
            .field("stats", &self.stats())
            .finish()
    }
}

impl fmt::Debug for SimQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimQueue")
            .field("device", &self.inner.id)
            .finish()
    }
}

impl std::ops::Deref for SimDevice {
    type Target = SimQueue;

    fn deref(&self) -> &SimQueue {
        &self.queue
    }
}

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice::new()
    }
}

fn invalidated(op: DeviceOp) -> DeviceError {
    DeviceError::Capture {
        op,
        violation: CaptureViolation::Invalidated,
    }
}

impl State {
    /// For operations CUDA refuses during a capture: fails and invalidates the capture, or
    /// passes when the stream is idle.
    fn forbid_in_capture(&mut self, op: DeviceOp) -> Result<(), DeviceError> {
        match self.capture {
            Capture::Idle => Ok(()),
            Capture::Recording { mode, .. } => {
                self.capture = Capture::Invalidated { mode };
                Err(DeviceError::Capture {
                    op,
                    violation: CaptureViolation::Unsupported,
                })
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
        }
    }
}

impl SimDevice {
    /// A fresh device with [`DEFAULT_MEMORY_LIMIT`] bytes of memory.
    pub fn new() -> SimDevice {
        SimDevice::with_memory_limit(DEFAULT_MEMORY_LIMIT)
    }

    /// A fresh device with `bytes` of memory: allocations that would take more fail with
    /// `OutOfMemory`. Memory is really allocated on the host, so keep it modest.
    pub fn with_memory_limit(bytes: usize) -> SimDevice {
        SimDevice {
            queue: SimQueue {
                inner: Arc::new(Inner {
                    id: DeviceId::fresh(),
                    state: Mutex::new(State {
                        mem: SimMemory::new(bytes),
                        capture: Capture::Idle,
                    }),
                    sticky: StickyError::default(),
                    counters: Counters::default(),
                    faults: Faults::default(),
                }),
            },
        }
    }

    /// The device's counters. Never blocks.
    pub fn stats(&self) -> SimStats {
        let c = &self.queue.inner.counters;
        SimStats {
            mapped_bytes: c.mapped_bytes.load(Ordering::Relaxed),
            reservations: c.reservations.load(Ordering::Relaxed),
            live_raw_allocs: c.live_raw_allocs.load(Ordering::Relaxed),
            live_graphs: c.live_graphs.load(Ordering::Relaxed),
            kernels_run: c.kernels_run.load(Ordering::Relaxed),
            copies_run: c.copies_run.load(Ordering::Relaxed),
            graph_launches: c.graph_launches.load(Ordering::Relaxed),
            maps: c.maps.load(Ordering::Relaxed),
        }
    }

    /// Whether the stream is capturing. Legal during a capture.
    pub fn capture_status(&self) -> Result<CaptureStatus, DeviceError> {
        let st = self.lock(DeviceOp::Query)?;
        Ok(match st.capture {
            Capture::Idle => CaptureStatus::Idle,
            Capture::Recording { mode, .. } => CaptureStatus::Active { mode },
            Capture::Invalidated { mode } => CaptureStatus::Invalidated { mode },
        })
    }

    /// Makes the `(n+1)`-th [`Device::map`] from now fail with `Injected { op: Map }` (`n = 0`:
    /// the next one), mapping nothing. Fires once; re-arming replaces the previous setting.
    pub fn fail_map_after(&self, n: u64) {
        self.queue
            .inner
            .faults
            .map_countdown
            .store(n.saturating_add(1), Ordering::Relaxed);
    }

    /// From now on, refuses conditional nodes as a driver older than CUDA 12.4 would
    /// ([`Device::supports_conditionals`] is false; opening one is `DeviceError::Unavailable`).
    pub fn disable_conditionals(&self) {
        self.queue
            .inner
            .faults
            .no_conditionals
            .store(true, Ordering::Relaxed);
    }

    /// Makes the next [`Device::end_capture`] that gets as far as instantiating fail with
    /// `Injected { op: Instantiate }`; the capture is over after it and its graph discarded.
    /// Fires once.
    pub fn fail_next_instantiate(&self) {
        self.queue
            .inner
            .faults
            .instantiate
            .store(true, Ordering::Relaxed);
    }

    /// Makes the next [`Device::launch`] fail with `Injected { op: GraphLaunch }` before running
    /// anything. Fires once.
    pub fn fail_next_launch(&self) {
        self.queue
            .inner
            .faults
            .launch
            .store(true, Ordering::Relaxed);
    }

    /// Makes the next drop of a [`SimGraph`] of this device record
    /// `Injected { op: GraphDestroy }` in the sticky error slot. Fires once.
    pub fn fail_next_graph_destroy(&self) {
        self.queue
            .inner
            .faults
            .fail_next_graph_destroy
            .store(true, Ordering::Relaxed);
    }

    /// Consumes one step of the map countdown; true when this map fails.
    fn map_fault_fires(&self) -> bool {
        let mut fires = false;
        let _ = self.queue.inner.faults.map_countdown.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |v| {
                fires = v == 1;
                v.checked_sub(1)
            },
        );
        fires
    }
}

impl SimQueue {
    /// Locks the device. Calls made from inside a kernel body (which runs under the lock) fail
    /// like CUDA calls made from a host callback (the driver's real `CUDA_ERROR_NOT_PERMITTED`),
    /// instead of deadlocking.
    fn lock(&self, op: DeviceOp) -> Result<MutexGuard<'_, State>, DeviceError> {
        if ON_STREAM.with(Cell::get) {
            return Err(DeviceError::Driver {
                op,
                code: 800,
                name: "CUDA_ERROR_NOT_PERMITTED",
            });
        }
        Ok(self
            .inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// The address `offset` bytes into `buffer`, for a kernel touching `extent` bytes from
    /// there: checked as CUDA's typed launches check their buffer arguments
    /// ([`Buffer::device_addr`]: this device's, still valid, in bounds). Kernel closures
    /// capture what it returns.
    pub fn buffer_addr(
        &self,
        buffer: &Buffer,
        offset: usize,
        extent: usize,
    ) -> Result<DevicePtr, DeviceError> {
        buffer.device_addr(DeviceOp::KernelLaunch, self.inner.id, offset, extent)
    }

    /// Enqueues a kernel on the runtime stream: run now when idle (the stream runs in program
    /// order), recorded when capturing. Bad memory accesses inside it are errors it returns.
    ///
    /// The body must not call back into the device (it runs with the device locked); such
    /// calls fail with a `CUDA_ERROR_NOT_PERMITTED` driver error.
    pub fn launch_kernel<F>(&self, name: &'static str, f: F) -> Result<(), DeviceError>
    where
        F: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
    {
        let mut st = self.lock(DeviceOp::KernelLaunch)?;
        match &mut st.capture {
            Capture::Idle => {}
            Capture::Recording { ops, .. } => {
                ops.push(Op::Kernel {
                    name,
                    f: Arc::new(f),
                });
                return Ok(());
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::KernelLaunch)),
        }
        self.run_kernel_now(&mut st, f)
    }

    /// Refuses `op` inside a conditional body with `rule` (invalidating the capture), as
    /// CUDA's instantiation would; anywhere else it is allowed.
    pub(crate) fn refuse_in_conditional(
        &self,
        op: DeviceOp,
        rule: ConditionalRule,
    ) -> Result<(), DeviceError> {
        let mut st = self.lock(op)?;
        if let Capture::Recording { open, mode, .. } = &st.capture
            && !open.is_empty()
        {
            st.capture = Capture::Invalidated { mode: *mode };
            return Err(DeviceError::Conditional { op, rule });
        }
        Ok(())
    }

    fn run_kernel_now<F>(&self, st: &mut State, f: F) -> Result<(), DeviceError>
    where
        F: Fn(&mut SimMemory) -> Result<(), DeviceError>,
    {
        let _guard = StreamGuard::enter();
        self.inner
            .counters
            .kernels_run
            .fetch_add(1, Ordering::Relaxed);
        f(&mut st.mem)
    }

    /// Enqueues a kernel on a second stream. When idle it runs now. During a capture it forks
    /// work off the capture that this simulator never joins back, so the capture's
    /// [`Device::end_capture`] fails with [`CaptureViolation::Unjoined`].
    #[cfg(feature = "test-support")]
    pub fn launch_kernel_on_side_stream<F>(
        &self,
        name: &'static str,
        f: F,
    ) -> Result<(), DeviceError>
    where
        F: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
    {
        let _ = name;
        let mut st = self.lock(DeviceOp::OtherStream)?;
        match &mut st.capture {
            Capture::Idle => {}
            Capture::Recording { open, mode, .. } if !open.is_empty() => {
                let mode = *mode;
                st.capture = Capture::Invalidated { mode };
                return Err(DeviceError::Conditional {
                    op: DeviceOp::OtherStream,
                    rule: ConditionalRule::Event,
                });
            }
            Capture::Recording { unjoined, .. } => {
                *unjoined = true;
                return Ok(());
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::OtherStream)),
        }
        self.run_kernel_now(&mut st, f)
    }

    /// A device allocation made by user code (`cudaMalloc`), outside graft's pool. Fails during
    /// a capture with [`CaptureViolation::Unsupported`] and invalidates it.
    #[cfg(feature = "test-support")]
    pub fn raw_alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let mut st = self.lock(DeviceOp::RawAlloc)?;
        st.forbid_in_capture(DeviceOp::RawAlloc)?;
        let ptr = st.mem.alloc_raw(DeviceOp::RawAlloc, bytes)?;
        self.inner
            .counters
            .live_raw_allocs
            .fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    /// Frees a [`SimQueue::raw_alloc`] allocation (`cudaFree`); `ptr` must be its start. Fails
    /// during a capture like [`SimQueue::raw_alloc`] (reported as [`DeviceOp::RawAlloc`]).
    #[cfg(feature = "test-support")]
    pub fn raw_free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::RawAlloc)?;
        st.forbid_in_capture(DeviceOp::RawAlloc)?;
        st.mem.free_raw(DeviceOp::RawAlloc, ptr)?;
        self.inner
            .counters
            .live_raw_allocs
            .fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether all work on the stream has finished (`cudaStreamQuery`); always true here, since
    /// work runs when enqueued. Fails during a capture and invalidates it.
    #[cfg(feature = "test-support")]
    pub fn query(&self) -> Result<bool, DeviceError> {
        let mut st = self.lock(DeviceOp::Query)?;
        st.forbid_in_capture(DeviceOp::Query)?;
        Ok(true)
    }

    /// Reads `n` `f32`s from the device, synchronously (a [`Device::read`]).
    #[cfg(feature = "test-support")]
    pub fn read_f32(&self, src: DevicePtr, n: usize) -> Result<Vec<f32>, DeviceError> {
        let mut st = self.lock(DeviceOp::Read)?;
        st.forbid_in_capture(DeviceOp::Read)?;
        // Check the range before allocating the result, so that a huge `n` is an error.
        let bytes = n.checked_mul(4).ok_or(DeviceError::InvalidAddress {
            op: DeviceOp::Read,
            addr: src,
            len: usize::MAX,
        })?;
        st.mem.range(DeviceOp::Read, src, bytes)?;
        let mut out = vec![0.0; n];
        st.mem.read_f32_as(DeviceOp::Read, src, &mut out)?;
        Ok(out)
    }

    /// Writes `values` to the device as `f32`s, synchronously (a [`Device::write`]).
    #[cfg(feature = "test-support")]
    pub fn write_f32(&self, dst: DevicePtr, values: &[f32]) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Write)?;
        st.forbid_in_capture(DeviceOp::Write)?;
        st.mem.write_f32_as(DeviceOp::Write, dst, values)
    }

    /// [`Device::copy`] of the first `bytes` of `src` to the start of `dst`, on graft buffers
    /// checked first as graft-cuda's `CudaQueue::copy` checks them ([`Buffer::device_addr`]:
    /// this device's, still valid, long enough). Overlapping ranges fail.
    pub fn copy(&self, dst: &Buffer, src: &Buffer, bytes: usize) -> Result<(), DeviceError> {
        let at = |b: &Buffer| b.device_addr(DeviceOp::Copy, self.inner.id, 0, bytes);
        self.copy_raw(at(dst)?, at(src)?, bytes)
    }

    /// [`Device::write`] of `src` to the start of `dst`, checked as [`SimQueue::copy`] checks.
    pub fn write(&self, dst: &Buffer, src: &[u8]) -> Result<(), DeviceError> {
        self.write_raw(
            dst.device_addr(DeviceOp::Write, self.inner.id, 0, src.len())?,
            src,
        )
    }

    /// [`Device::read`] of the first `dst.len()` bytes of `src`, checked as [`SimQueue::copy`]
    /// checks.
    pub fn read(&self, src: &Buffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.read_raw(
            src.device_addr(DeviceOp::Read, self.inner.id, 0, dst.len())?,
            dst,
        )
    }

    /// Enqueues a device-to-device copy (recorded when capturing); overlapping ranges fail.
    fn copy_raw(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Copy)?;
        match &mut st.capture {
            Capture::Idle => {}
            Capture::Recording { ops, .. } => {
                ops.push(Op::Copy {
                    dst,
                    src,
                    len: bytes,
                });
                return Ok(());
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::Copy)),
        }
        self.inner
            .counters
            .copies_run
            .fetch_add(1, Ordering::Relaxed);
        st.mem.copy_as(DeviceOp::Copy, dst, src, bytes)
    }

    /// Copies host bytes to the device, synchronously. Fails during a capture.
    fn write_raw(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Write)?;
        st.forbid_in_capture(DeviceOp::Write)?;
        st.mem
            .range_mut(DeviceOp::Write, dst, src.len())?
            .copy_from_slice(src);
        Ok(())
    }

    /// Copies device bytes to the host, synchronously. Fails during a capture.
    fn read_raw(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Read)?;
        st.forbid_in_capture(DeviceOp::Read)?;
        dst.copy_from_slice(st.mem.range(DeviceOp::Read, src, dst.len())?);
        Ok(())
    }

    /// Waits for the stream (a no-op when idle). Fails during a capture.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Synchronize)?;
        st.forbid_in_capture(DeviceOp::Synchronize)
    }
}

impl Device for SimDevice {
    type Graph = SimGraph;
    type Queue = SimQueue;

    fn queue(&self) -> &SimQueue {
        &self.queue
    }

    fn id(&self) -> DeviceId {
        self.queue.inner.id
    }

    fn describe(&self) -> String {
        "host simulator".to_owned()
    }

    fn granularity(&self) -> usize {
        GRANULARITY
    }

    /// Legal in every capture state, like the CUDA backend's relaxed-mode reservation.
    fn reserve(&self, _: &CoreOnly, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let mut st = self.lock(DeviceOp::Reserve)?;
        let ptr = st.mem.reserve(DeviceOp::Reserve, bytes)?;
        self.queue
            .inner
            .counters
            .reservations
            .fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    fn release_reservation(
        &self,
        _: &CoreOnly,
        addr: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::ReleaseReservation;
        let mut st = self.lock(op)?;
        st.forbid_in_capture(op)?;
        st.mem.release_reservation(op, addr, bytes)?;
        self.queue
            .inner
            .counters
            .reservations
            .fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }

    /// Legal in every capture state: CUDA backends switch to relaxed mode around it.
    fn map(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Map;
        let mut st = self.lock(op)?;
        if self.map_fault_fires() {
            return Err(DeviceError::Injected { op });
        }
        st.mem.map(op, addr, bytes)?;
        let c = &self.queue.inner.counters;
        c.maps.fetch_add(1, Ordering::Relaxed);
        c.mapped_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn unmap(&self, _: &CoreOnly, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        let op = DeviceOp::Unmap;
        let mut st = self.lock(op)?;
        st.forbid_in_capture(op)?;
        st.mem.unmap(op, addr, bytes)?;
        self.queue
            .inner
            .counters
            .mapped_bytes
            .fetch_sub(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn copy(
        &self,
        _: &CoreOnly,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.queue.copy_raw(dst, src, bytes)
    }

    fn write(&self, _: &CoreOnly, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        self.queue.write_raw(dst, src)
    }

    fn read(&self, _: &CoreOnly, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.queue.read_raw(src, dst)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.queue.synchronize()
    }

    fn begin_capture(&self, _: &CoreOnly, mode: CaptureMode) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::BeginCapture)?;
        let state = match st.capture {
            Capture::Idle => {
                st.capture = Capture::Recording {
                    mode,
                    ops: Vec::new(),
                    unjoined: false,
                    open: Vec::new(),
                };
                return Ok(());
            }
            Capture::Recording { .. } => CAPTURE_UNDERWAY,
            Capture::Invalidated { .. } => CAPTURE_INVALIDATED,
        };
        Err(DeviceError::CaptureState {
            op: DeviceOp::BeginCapture,
            state,
        })
    }

    fn end_capture(&self, _: &CoreOnly) -> Result<SimGraph, DeviceError> {
        let mut st = self.lock(DeviceOp::EndCapture)?;
        // Like cudaStreamEndCapture, ending leaves the stream idle whether or not it succeeds.
        let ops = match std::mem::replace(&mut st.capture, Capture::Idle) {
            Capture::Idle => {
                return Err(DeviceError::CaptureState {
                    op: DeviceOp::EndCapture,
                    state: NO_CAPTURE,
                });
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::EndCapture)),
            Capture::Recording { unjoined: true, .. } => {
                return Err(DeviceError::Capture {
                    op: DeviceOp::EndCapture,
                    violation: CaptureViolation::Unjoined,
                });
            }
            Capture::Recording { open, .. } if !open.is_empty() => {
                return Err(DeviceError::CaptureState {
                    op: DeviceOp::EndCapture,
                    state: "a conditional node is still open",
                });
            }
            Capture::Recording { ops, .. } => ops,
        };
        drop(st);
        if self
            .queue
            .inner
            .faults
            .instantiate
            .swap(false, Ordering::Relaxed)
        {
            return Err(DeviceError::Injected {
                op: DeviceOp::Instantiate,
            });
        }
        let ops: Arc<[Op]> = ops.into();
        let summary = graph::summarize(&ops);
        self.queue
            .inner
            .counters
            .live_graphs
            .fetch_add(1, Ordering::Relaxed);
        Ok(SimGraph {
            ops,
            redirects: Vec::new(),
            disabled: Vec::new(),
            summary,
            owner: Arc::clone(&self.queue.inner),
        })
    }

    /// Updates in place when the capture has `graph`'s topology (`graph::update_refusal`:
    /// the same operations in the same order, kernels by name, copies by length), as CUDA's
    /// `cuGraphExecUpdate` does; else instantiates.
    fn end_capture_into(
        &self,
        core: &CoreOnly,
        graph: &mut SimGraph,
    ) -> Result<Option<UpdateRefusal>, DeviceError> {
        let new = self.end_capture(core)?;
        match graph::update_refusal(&graph.ops, &new.ops) {
            None => {
                graph.ops = Arc::clone(&new.ops);
                graph.redirects.clear();
                graph.disabled.clear();
                Ok(None)
            }
            Some(refusal) => {
                *graph = new;
                Ok(Some(refusal))
            }
        }
    }

    fn supports_conditionals(&self) -> bool {
        !self
            .queue
            .inner
            .faults
            .no_conditionals
            .load(Ordering::Relaxed)
    }

    fn begin_conditional(
        &self,
        _: &CoreOnly,
        kind: Conditional,
        selector: DevicePtr,
    ) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        if !self.supports_conditionals() {
            return Err(DeviceError::Unavailable {
                op,
                what: "this simulated driver has no conditional graph nodes (as before CUDA 12.4); loop on the host instead",
            });
        }
        // CUDA's rule as graft-cuda meets it: a body is captured as a graph of its own and
        // copied into its node, which a conditional node cannot be.
        self.refuse_in_conditional(op, ConditionalRule::Nested)?;
        let mut st = self.lock(op)?;
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                open.push(OpenConditional {
                    kind,
                    selector,
                    done: Vec::new(),
                    before: std::mem::take(ops),
                });
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn next_branch(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        let mut st = self.lock(op)?;
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                let Some(node) = open.last_mut() else {
                    return Err(DeviceError::CaptureState {
                        op,
                        state: NO_CONDITIONAL,
                    });
                };
                if node.done.len() + 1 >= node.kind.branches() {
                    return Err(DeviceError::InvalidArgument {
                        op,
                        what: "the conditional node has no further body",
                    });
                }
                node.done.push(std::mem::take(ops).into());
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn end_conditional(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let op = DeviceOp::Conditional;
        let mut st = self.lock(op)?;
        match &mut st.capture {
            Capture::Recording { ops, open, .. } => {
                let Some(mut node) = open.pop() else {
                    return Err(DeviceError::CaptureState {
                        op,
                        state: NO_CONDITIONAL,
                    });
                };
                node.done.push(std::mem::take(ops).into());
                if node.done.len() != node.kind.branches() {
                    open.push(node);
                    return Err(DeviceError::InvalidArgument {
                        op,
                        what: "the conditional node was closed before its last body",
                    });
                }
                *ops = node.before;
                ops.push(Op::Conditional {
                    kind: node.kind,
                    selector: node.selector,
                    bodies: node.done.into(),
                });
                Ok(())
            }
            Capture::Invalidated { .. } => Err(invalidated(op)),
            Capture::Idle => Err(DeviceError::CaptureState {
                op,
                state: NO_CAPTURE,
            }),
        }
    }

    fn abort_capture(&self, _: &CoreOnly) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::EndCapture)?;
        match std::mem::replace(&mut st.capture, Capture::Idle) {
            Capture::Idle => Err(DeviceError::CaptureState {
                op: DeviceOp::EndCapture,
                state: NO_CAPTURE,
            }),
            Capture::Recording { .. } | Capture::Invalidated { .. } => Ok(()),
        }
    }

    fn launch(&self, _: &CoreOnly, graph: &SimGraph) -> Result<(), DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphLaunch,
                what: FOREIGN_GRAPH,
            });
        }
        let mut guard = self.lock(DeviceOp::GraphLaunch)?;
        if self
            .queue
            .inner
            .faults
            .launch
            .swap(false, Ordering::Relaxed)
        {
            return Err(DeviceError::Injected {
                op: DeviceOp::GraphLaunch,
            });
        }
        let st = &mut *guard;
        match &mut st.capture {
            Capture::Idle => {}
            Capture::Recording { ops, .. } => {
                ops.push(Op::Child(Arc::clone(&graph.ops)));
                return Ok(());
            }
            Capture::Invalidated { .. } => return Err(invalidated(DeviceOp::GraphLaunch)),
        }
        let mut tally = Tally::default();
        let result = {
            let _on_stream = StreamGuard::enter();
            st.mem.set_redirects(&graph.redirects);
            let ran = graph::run_ops(&mut st.mem, &graph.ops, &graph.disabled, &mut tally);
            st.mem.set_redirects(&[]);
            ran
        };
        let c = &self.queue.inner.counters;
        c.kernels_run.fetch_add(tally.kernels, Ordering::Relaxed);
        c.copies_run.fetch_add(tally.copies, Ordering::Relaxed);
        if result.is_ok() {
            c.graph_launches.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn summarize(&self, graph: &SimGraph) -> Result<GraphSummary, DeviceError> {
        Ok(graph.summary)
    }

    /// Redirects exactly (every access inside the range, by kernels and copies, goes to `to`):
    /// the simulator sees every access, so it always can.
    fn redirect(
        &self,
        _: &CoreOnly,
        graph: &mut SimGraph,
        from: DevicePtr,
        len: usize,
        copy: Option<CopyEnds>,
        to: Option<DevicePtr>,
    ) -> Result<bool, DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: FOREIGN_GRAPH,
            });
        }
        graph.redirect(from, len, copy, to);
        Ok(true)
    }

    fn repoint_copy(
        &self,
        _: &CoreOnly,
        graph: &mut SimGraph,
        recorded: CopyEnds,
        now: CopyEnds,
    ) -> Result<(), DeviceError> {
        if graph.owner.id != self.queue.inner.id {
            return Err(DeviceError::InvalidArgument {
                op: DeviceOp::GraphUpdate,
                what: FOREIGN_GRAPH,
            });
        }
        let st = self.lock(DeviceOp::GraphUpdate)?;
        let moves_kind = |a: DevicePtr, b: DevicePtr| st.mem.is_raw(a) != st.mem.is_raw(b);
        if moves_kind(recorded.dst, now.dst) || moves_kind(recorded.src, now.src) {
            // CUDA's `cuGraphExecMemcpyNodeSetParams` refuses operands whose mapping changed.
            return Err(DeviceError::Driver {
                op: DeviceOp::GraphUpdate,
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE",
            });
        }
        drop(st);
        graph.repoint_copy(recorded, now)
    }

    fn take_sticky_error(&self, _: &CoreOnly) -> Option<DeviceError> {
        self.queue.inner.sticky.take()
    }

    fn record_sticky_error(&self, _: &CoreOnly, error: DeviceError) {
        self.queue.inner.sticky.record(error);
    }
}
