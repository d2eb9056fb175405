//! graft-sim: a host simulator of one CUDA device and its stream, the backend graft's tests run on.
//!
//! [`SimDevice`] implements [`graft_core::Device`] with no GPU, deterministically, and fails
//! wherever CUDA would fail, so that bugs show up in tests instead of as silent corruption on a
//! GPU. The rules it enforces:
//!
//! - **Memory at fixed addresses.** Raw allocations and pool reservations are placed at
//!   increasing addresses from [`ADDRESS_BASE`], each on a 2 MiB boundary ([`GRANULARITY`])
//!   with at least one unmapped 2 MiB gap after it, and an address is never handed out twice.
//!   Pool memory is mapped into a reservation and unmapped in 2 MiB granules, with the rules of
//!   graft-core's device module (misuse is
//!   [`DeviceError::InvalidArgument`](graft_core::DeviceError::InvalidArgument)); a reservation
//!   costs host memory only up to its highest mapped granule. Every access must lie inside one
//!   raw allocation or inside mapped granules of one reservation, so out-of-bounds accesses and
//!   uses after free or unmap fail with
//!   [`DeviceError::InvalidAddress`](graft_core::DeviceError::InvalidAddress), never read stale
//!   data. Fresh allocations and fresh mappings are filled with [`POISON_BYTE`], not zeros. The
//!   memory limit counts mapped bytes plus raw allocations.
//! - **One stream, program order.** Kernels ([`SimQueue::launch_kernel`], closures over
//!   [`SimMemory`]) and copies run when enqueued; synchronizing is a no-op outside a capture.
//! - **A side stream, with CUDA's fork and join.** `Device::side_queue` is a [`SimQueue`] on
//!   the side stream; `Device::fork` and `Device::join` open and close a fork (no nesting, not
//!   in a conditional body, a join needs a fork). During a capture the side queue may be used
//!   only inside a fork (else `DeviceError::Fork` with `SideOutsideFork`, invalidating the
//!   capture), and `end_capture` with a fork open fails with `Unjoined`. Work still runs in
//!   program order, but between a fork and its join every byte each stream reads and writes is
//!   logged, and at the join (eagerly) or when a graph's recorded fork runs, one stream writing
//!   bytes the other touched is a `DeviceError::StreamRace`: the race a GPU would have.
//! - **Capture records instead of running.** Between `begin_capture` and `end_capture`, kernels,
//!   copies and graph launches are recorded; [`SimGraph`] replays them in order at the recorded
//!   addresses against current memory. Reserving and mapping stay legal during a capture.
//! - **What CUDA forbids during capture fails the same way** with
//!   [`DeviceError::Capture`](graft_core::DeviceError::Capture) and invalidates the capture:
//!   synchronize, host reads and writes, unmapping, releasing a reservation, and the
//!   `test-support` hooks below: raw allocations, queries. Work on the side stream through the
//!   `launch_kernel_on_side_stream` hook is never joined, so `end_capture` fails with `Unjoined`. After a violation every stream operation fails with `Invalidated` until the
//!   capture is ended or aborted. All capture modes are treated alike (real CUDA would allow a
//!   raw allocation in `Relaxed` mode).
//! - **Undefined behaviour is an error.** Overlapping copies fail with
//!   [`DeviceError::OverlappingCopy`](graft_core::DeviceError::OverlappingCopy), eagerly and on
//!   replay; elementwise kernels may work in place but not on partly overlapping ranges; typed
//!   accesses must be aligned; a kernel body calling back into the device gets
//!   `CUDA_ERROR_NOT_PERMITTED` instead of a deadlock.
//! - **Fault injection**, each firing once: [`SimDevice::fail_map_after`],
//!   [`SimDevice::fail_next_instantiate`], [`SimDevice::fail_next_launch`],
//!   [`SimDevice::fail_next_graph_destroy`] (which goes to the sticky error slot).
//!
//! - **Several devices, one all-reduce.** [`SimComm`] joins simulated devices into a group
//!   with an in-process all-reduce, recorded into graphs like NCCL's kernels; where NCCL
//!   would hang it times out with an error.
//!
//! [`SimDevice::stats`] exposes counters for tests. Behind the `test-support` feature (enabled
//! by graft-testkit and graft's dev-dependencies) are the calls only tests make, modelling
//! what a framework's code might do wrong inside a captured body: `SimQueue::raw_alloc` /
//! `SimQueue::raw_free` (`cudaMalloc` / `cudaFree`), `SimQueue::query` (`cudaStreamQuery`),
//! `SimQueue::launch_kernel_on_side_stream`, and raw-address `SimQueue::read_f32` /
//! `SimQueue::write_f32`. graft's shared test kernels live in graft-testkit.
#![forbid(unsafe_code)]

mod collective;
mod compare;
mod device;
mod device_impl;
mod fork;
mod graph;
mod memory;
mod ops;
mod queue;
mod state;

pub use collective::SimComm;
pub use device::{CaptureStatus, SimDevice, SimStats};
pub use graph::SimGraph;
pub use memory::{ADDRESS_BASE, DEFAULT_MEMORY_LIMIT, GRANULARITY, POISON_BYTE, SimMemory};
pub use ops::KernelFn;
pub use queue::SimQueue;
