//! graft-cuda: graft's [`Device`](graft_core::Device) over the CUDA driver API, through cudarc.
//!
//! [`CudaDevice`] owns one non-blocking runtime stream on one GPU and implements core's capture
//! lifecycle with stream capture (`cuStreamBeginCapture` / `cuStreamEndCapture`), instantiating
//! and uploading each graph ([`CudaGraph`]) so that its first replay is as cheap as the rest.
//! Pool memory is virtual memory (`cuMemAddressReserve`, then `cuMemCreate` and `cuMemMap` per
//! granule: `vmm.rs`), mapped legally inside a capture by switching the thread to relaxed
//! capture mode around the calls, as PyTorch's caching allocator does. `patch.rs` moves a
//! recorded graph's uses of a range to other memory (copy-free and in-place inputs);
//! `conditional.rs` and `relocate.rs` build conditional nodes inside a capture. Behind the
//! `test-support` feature it offers a few calls that model what a framework's code might do
//! wrong inside a captured body (`CudaQueue::raw_alloc`, `CudaQueue::query`,
//! `CudaQueue::launch_function_on_side_stream`), mirroring the simulator; graft's shared
//! test kernels live in graft-testkit.
//!
//! For frameworks built on it (graft-tensor) it offers a safe generic kernel API:
//! [`CudaQueue::load_module`] compiles CUDA C++ with NVRTC once and
//! [`CudaQueue::launch_function`] launches its kernels on the runtime stream with
//! [`KernelArg`]s checked against each kernel's real parameter sizes; and cuBLAS:
//! [`CudaQueue::sgemm`], a row-major f32 GEMM on a per-device handle bound to the runtime
//! stream, with a fixed workspace so it never allocates during a capture.
//!
//! By default (feature `dynamic-loading`) cudarc loads CUDA at run time, so this crate builds
//! without a CUDA toolkit and a program using it starts on a machine without a GPU:
//! [`CudaDevice::is_available`] then returns false and [`CudaDevice::new`] an error, neither
//! panics. The other feature, `dynamic-linking`, links libcuda, libnvrtc and libcublas at build
//! time instead, as candle's CUDA backend requires (graft-candle's `cuda` build); its programs
//! need those libraries to start. Exactly one of the two must be on.
//!
//! With the `nccl` feature, `NcclComm` adds NCCL communicators, for several GPUs of one
//! process (`init_all`) or one GPU per process (`init_rank`, non-blocking, every wait
//! bounded), whose all-reduces run on each device's runtime stream and so are captured into
//! graft's graphs; `NcclBallotBox` carries a group's votes over the same communicator. Small
//! all-reduces (up to `NcclComm::one_shot_limit`, 256 KiB by default) take a one-shot kernel
//! of graft's own over NVLink peer memory instead of NCCL where every rank's GPU reaches the
//! others' (peer access within a process, CUDA IPC handles between processes, agreed by all
//! ranks when the communicator is made); `one_shot_sum` is the same sum on the host.
//!
//! # Layers
//! At the bottom, the `driver` floor (`src/driver/`, like cudarc's `result` layer under its
//! `safe` one) wraps every call graft-cuda makes into libcuda, cuBLAS and NCCL once, with its
//! `unsafe`, the invariant it relies on, and its result mapped to a typed error. Above it,
//! `context.rs` holds the primary context, the runtime stream and the sticky error slot, and
//! each subsystem owns its own state (`vmm.rs` the pool's mappings, `blas.rs` the cuBLAS
//! handle, `conditional.rs` the capture's conditional nodes, `side.rs` the test side stream);
//! `inner.rs` composes them into one device, which `device.rs` exposes.
//!
//! graft-core, graft-sim and graft-tensor forbid `unsafe`; graft-candle has its own. In this
//! crate every `unsafe` block names the invariant it relies on, and all of them are in the
//! floor except: launching kernels whose arguments were checked against the kernel's
//! parameters (`module.rs`, and the set-conditional kernel in `conditional.rs`: a launch is
//! only sound when the arguments match the kernel, which the floor cannot know), the pinned
//! host buffers of the exchanges over NCCL (`nccl/gather.rs`: whether a copy still runs on
//! them is the exchange's state), the one-shot all-reduce's host-mapped abort word
//! (`nccl/one_shot/mod.rs`, an atomic over pinned memory), and the `Send`/`Sync` impls of the
//! types that hold raw handles.
//!
//! Driver errors map to core's [`DeviceError`](graft_core::DeviceError) (`error.rs`): out of
//! memory, the stream-capture family (as `Capture` with the violation), and everything else as
//! `Driver` with CUDA's code and name; cuBLAS's and NCCL's statuses become `Library` errors.
//! Errors from `Drop` (destroying a graph) go to the device's sticky error slot.

#[cfg(all(feature = "dynamic-loading", feature = "dynamic-linking"))]
compile_error!(
    "graft-cuda: features `dynamic-loading` and `dynamic-linking` are exclusive; build \
     graft-candle's `cuda` feature on its own (cargo build -p graft-candle --features cuda)"
);
#[cfg(not(any(feature = "dynamic-loading", feature = "dynamic-linking")))]
compile_error!("graft-cuda: enable one of the features `dynamic-loading` or `dynamic-linking`");

mod blas;
mod capture;
mod compare;
mod conditional;
mod context;
mod device;
mod driver;
mod error;
mod graph;
mod inner;
mod module;
#[cfg(feature = "nccl")]
mod nccl;
mod patch;
pub mod programmatic;
mod queue;
mod relocate;
mod side;
#[cfg(feature = "test-support")]
mod test_hooks;
mod vmm;

pub use blas::{Operand, Sgemm, WORKSPACE_BYTES};
pub use device::{CudaDevice, CudaQueue, MemoryFigures};
pub use graph::CudaGraph;
pub use module::{CudaModule, KernelArg, compile_ptx, compile_ptx_for};
#[cfg(feature = "nccl")]
pub use nccl::{NcclBallotBox, NcclComm, NcclDtype, UNIQUE_ID_BYTES, one_shot_sum};
pub use programmatic::Launch;

/// CUDA C that NVRTC sources start with (no headers there): 16-bit floats as structs of their
/// bits (`GraftBf16`, `GraftF16`) and their conversions to and from f32 (`graft_to_f32`,
/// `graft_from_f32<T>`). graft-cuda's one-shot all-reduce and graft-candle-kernels' modules
/// use it.
pub const HALF_CU: &str = include_str!("half.cu");

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        assert_send_sync::<CudaDevice>();
        assert_send_sync::<CudaGraph>();
    }
}
