//! `SimQueue`: the body-facing handle of a simulated device, its one stream's kernels,
//! copies, host reads and writes (and the `test-support` hooks), under the device lock.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};

use graft_core::{Buffer, ConditionalRule, DeviceError, DeviceOp, DevicePtr, ForkRule};

use crate::memory::{Lane, SimMemory};
use crate::ops::{KernelFn, Op};
use crate::state::{Capture, Fork, Inner, ON_STREAM, State, StreamGuard, invalidated};

/// The body-facing handle of a [`SimDevice`] ([`graft_core::Device::Queue`]): kernels, copies,
/// host reads and writes, synchronize, on one of the device's streams (the runtime stream, or
/// for [`graft_core::Device::side_queue`] the side stream). There is no way from it
/// back to the device's capture, mapping, graph or error-slot operations.
#[derive(Clone)]
pub struct SimQueue {
    pub(crate) inner: Arc<Inner>,
    /// The stream this queue enqueues on: the runtime stream, or the side stream
    /// (`Device::side_queue`).
    pub(crate) lane: Lane,
}

impl fmt::Debug for SimQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimQueue")
            .field("device", &self.inner.id)
            .field("lane", &self.lane)
            .finish()
    }
}

impl SimQueue {
    /// Locks the device. Calls made from inside a kernel body (which runs under the lock) fail
    /// like CUDA calls made from a host callback (the driver's real `CUDA_ERROR_NOT_PERMITTED`),
    /// instead of deadlocking.
    pub(crate) fn lock(&self, op: DeviceOp) -> Result<MutexGuard<'_, State>, DeviceError> {
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
    /// Its arguments are undeclared: whatever `f` captured (a host value included) is
    /// invisible to graft's guards, and a graph holding such a kernel cannot be compared
    /// (`Device::compare` answers `None`, graft warns once per recording and replays it
    /// unguarded). Bodies should launch with [`SimQueue::launch_kernel_with_args`].
    ///
    /// The body must not call back into the device (it runs with the device locked); such
    /// calls fail with a `CUDA_ERROR_NOT_PERMITTED` driver error.
    pub fn launch_kernel<F>(&self, name: &'static str, f: F) -> Result<(), DeviceError>
    where
        F: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
    {
        self.launch(name, None, None, Arc::new(f))
    }

    /// Like [`SimQueue::launch_kernel`], declaring the kernel's arguments as a CUDA launch
    /// passes them (each argument's bytes: a scalar's value, an address as a little-endian
    /// `u64`). `f` must use the same values, which it captures; a capture records the
    /// arguments with the kernel, as CUDA's kernel node parameters do, and
    /// `Device::compare` compares them.
    pub fn launch_kernel_with_args<F>(
        &self,
        name: &'static str,
        args: &[&[u8]],
        f: F,
    ) -> Result<(), DeviceError>
    where
        F: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
    {
        self.launch(name, Some(args), None, Arc::new(f))
    }

    /// Enqueues a kernel launched as a *programmatic dependent* of the kernel before it on
    /// the stream (CUDA's programmatic dependent launch): `before` runs first, then the
    /// kernel's wait (`griddepcontrol.wait`), then `after`; arguments as
    /// [`SimQueue::launch_kernel_with_args`]. On a GPU the kernel may start while the kernels
    /// before it still run, so what `before` touches is checked against what they touch: the
    /// kernel before it and, while they are dependents too, the ones before that, back to the
    /// last plain kernel. A conflict (one side writes) is a [`DeviceError::ProgrammaticRace`]
    /// naming both kernels. A dependent that follows no kernel (first on the stream, after a
    /// copy or a host access, first in a graph) starts after everything before it, as on a
    /// GPU. A capture records the programmatic edge ([`graft_core::GraphSummary`]'s
    /// `programmatic_edges`).
    pub fn launch_dependent<B, F>(
        &self,
        name: &'static str,
        args: &[&[u8]],
        before: B,
        after: F,
    ) -> Result<(), DeviceError>
    where
        B: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
        F: Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static,
    {
        let before: Arc<KernelFn> = Arc::new(before);
        let after: Arc<KernelFn> = Arc::new(after);
        self.launch(name, Some(args), Some(before), after)
    }

    /// A kernel launch, its arguments declared or not, dependent (with its part before the
    /// wait) or plain.
    fn launch(
        &self,
        name: &'static str,
        args: Option<&[&[u8]]>,
        before: Option<Arc<KernelFn>>,
        f: Arc<KernelFn>,
    ) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::KernelLaunch)?;
        if let Some(ops) = self.recording(&mut st, DeviceOp::KernelLaunch)? {
            ops.push(Op::Kernel {
                name,
                args: args.map(|args| args.iter().map(|a| Box::<[u8]>::from(*a)).collect()),
                before,
                f,
            });
            return Ok(());
        }
        self.run_kernel_now(&mut st, name, before.as_deref(), &*f)
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

    /// Where stream work of this queue goes: `None` to run now (no capture), else the
    /// operations to record into: the capture's, or during a captured fork the side stream's
    /// for the side queue. The side queue outside a fork during a capture is refused
    /// (`ForkRule::SideOutsideFork`) and invalidates the capture: CUDA would not capture it.
    pub(crate) fn recording<'s>(
        &self,
        st: &'s mut State,
        op: DeviceOp,
    ) -> Result<Option<&'s mut Vec<Op>>, DeviceError> {
        let forked = matches!(st.fork, Some(Fork { recorded: Some(_) }));
        match (&st.capture, self.lane) {
            (Capture::Idle, _) => return Ok(None),
            (Capture::Invalidated { .. }, _) => return Err(invalidated(op)),
            (Capture::Recording { mode, .. }, Lane::Side) if !forked => {
                st.capture = Capture::Invalidated { mode: *mode };
                return Err(DeviceError::Fork {
                    op,
                    rule: ForkRule::SideOutsideFork,
                });
            }
            (Capture::Recording { .. }, _) => {}
        }
        Ok(match (&mut st.capture, &mut st.fork, self.lane) {
            (
                _,
                Some(Fork {
                    recorded: Some((_, side)),
                }),
                Lane::Side,
            ) => Some(side),
            (Capture::Recording { ops, .. }, ..) => Some(ops),
            _ => None,
        })
    }

    pub(crate) fn run_kernel_now(
        &self,
        st: &mut State,
        name: &'static str,
        before: Option<&KernelFn>,
        f: &KernelFn,
    ) -> Result<(), DeviceError> {
        let _guard = StreamGuard::enter();
        self.inner
            .counters
            .kernels_run
            .fetch_add(1, Ordering::Relaxed);
        st.mem.set_lane(Some(self.lane));
        let ran = crate::ops::run_kernel(&mut st.mem, DeviceOp::KernelLaunch, name, before, f);
        st.mem.set_lane(None);
        ran
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
        self.run_kernel_now(&mut st, name, None, &f)
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
    pub(crate) fn copy_raw(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Copy)?;
        if let Some(ops) = self.recording(&mut st, DeviceOp::Copy)? {
            ops.push(Op::Copy {
                dst,
                src,
                len: bytes,
            });
            return Ok(());
        }
        self.inner
            .counters
            .copies_run
            .fetch_add(1, Ordering::Relaxed);
        st.mem.set_lane(Some(self.lane));
        let copied = st.mem.copy_as(DeviceOp::Copy, dst, src, bytes);
        st.mem.set_lane(None);
        copied
    }

    /// Copies host bytes to the device, synchronously. Fails during a capture.
    pub(crate) fn write_raw(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        let mut st = self.lock(DeviceOp::Write)?;
        st.forbid_in_capture(DeviceOp::Write)?;
        st.mem
            .range_mut(DeviceOp::Write, dst, src.len())?
            .copy_from_slice(src);
        Ok(())
    }

    /// Copies device bytes to the host, synchronously. Fails during a capture.
    pub(crate) fn read_raw(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), DeviceError> {
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
