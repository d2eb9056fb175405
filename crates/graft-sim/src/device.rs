//! `SimDevice`: one simulated device with its runtime stream and side stream (their queues, `queue.rs`; forks in `fork.rs`) and a memory
//! limit, its counters (`SimStats`), capture status and fault injection; its
//! `graft_core::Device` implementation is `device_impl.rs`.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use graft_core::backend::StickyError;
use graft_core::{CaptureMode, DeviceError, DeviceId, DeviceOp};

use crate::memory::{DEFAULT_MEMORY_LIMIT, Lane, SimMemory};
use crate::queue::SimQueue;
use crate::state::{Capture, Counters, Faults, Inner, State};

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
    /// Graphs prepared to launch (`Device::end_capture`, `Device::prepare_launch`): what CUDA
    /// instantiates and uploads.
    pub instantiations: u64,
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
    pub(crate) queue: SimQueue,
    /// The side stream's queue (`Device::side_queue`), sharing the device.
    pub(crate) side: SimQueue,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDevice")
            .field("id", &self.queue.inner.id)
            .field("stats", &self.stats())
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

impl SimDevice {
    /// A fresh device with [`DEFAULT_MEMORY_LIMIT`] bytes of memory.
    pub fn new() -> SimDevice {
        SimDevice::with_memory_limit(DEFAULT_MEMORY_LIMIT)
    }

    /// A fresh device with `bytes` of memory: allocations that would take more fail with
    /// `OutOfMemory`. Memory is really allocated on the host, so keep it modest.
    pub fn with_memory_limit(bytes: usize) -> SimDevice {
        let inner = Arc::new(Inner {
            id: DeviceId::fresh(),
            state: Mutex::new(State {
                mem: SimMemory::new(bytes),
                capture: Capture::Idle,
                fork: None,
            }),
            sticky: StickyError::default(),
            counters: Counters::default(),
            faults: Faults::default(),
        });
        SimDevice {
            side: SimQueue {
                inner: Arc::clone(&inner),
                lane: Lane::Side,
            },
            queue: SimQueue {
                inner,
                lane: Lane::Main,
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
            instantiations: c.instantiations.load(Ordering::Relaxed),
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
    pub(crate) fn map_fault_fires(&self) -> bool {
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
