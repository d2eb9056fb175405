//! [`Inner`], one device composed of its parts: the [`Context`] (primary context, runtime stream, sticky slot) and the subsystems that each own their state — pool memory ([`Vmm`]), the cuBLAS handle ([`Blas`]), conditional nodes ([`Conditionals`]) and the side stream — with opening them in order and releasing them in reverse.

use std::ops::Deref;
use std::sync::Arc;

use graft_core::{DeviceError, DeviceOp, DevicePtr};

use crate::blas::Blas;
use crate::conditional::Conditionals;
use crate::context::Context;
use crate::side::SideStream;
use crate::vmm::Vmm;

/// One device: what `CudaDevice`, its queue, its graphs and its modules share (an `Arc`).
/// It dereferences to its [`Context`], which every subsystem works through.
pub(crate) struct Inner {
    /// The side stream (`Device::side_queue`) and its fork/join events, made on the device's
    /// context with the device (also for `CudaDevice::from_stream`).
    pub(crate) side: SideStream,
    /// The capture's conditional nodes and the kernel that sets their handles.
    pub(crate) conditionals: Conditionals,
    /// The cuBLAS handle and its workspace, made once.
    pub(crate) blas: Blas,
    /// Pool memory: reservations and mapped granules.
    pub(crate) vmm: Vmm,
    /// Declared last, so dropped last: the context and stream outlive every subsystem.
    pub(crate) context: Context,
}

impl Deref for Inner {
    type Target = Context;

    fn deref(&self) -> &Context {
        &self.context
    }
}

impl Inner {
    /// Opens device `ordinal` ([`Context::open`]), reads its allocation granularity, and with
    /// `test-support` creates the side stream. Failures are reported with `DeviceOp::Init`; what
    /// was created is released again.
    pub(crate) fn open(
        ordinal: usize,
        adopted: Option<Arc<cudarc::driver::CudaStream>>,
    ) -> Result<Inner, DeviceError> {
        let op = DeviceOp::Init;
        let context = Context::open(ordinal, adopted)?;
        let vmm = Vmm::new(op, context.cu_device)?;
        let side = {
            let mut side = SideStream::default();
            if let Err(e) = side.create() {
                side.release();
                return Err(e);
            }
            side
        };
        Ok(Inner {
            side,
            conditionals: Conditionals::default(),
            blas: Blas::default(),
            vmm,
            context,
        })
    }

    /// Synchronizes the device's streams (the runtime stream and the side stream): what unmapping memory waits for.
    fn sync_streams(&self, op: DeviceOp) -> Result<(), DeviceError> {
        self.context.sync(op)?;
        self.side.sync(op)?;
        Ok(())
    }

    /// Unmaps `addr..addr+bytes` of the pool once the device's streams are idle (see
    /// [`Vmm::unmap`]).
    pub(crate) fn unmap(&self, addr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
        self.vmm
            .unmap(&self.context, addr, bytes, |op| self.sync_streams(op))
    }
}

impl Drop for Inner {
    /// Releases the subsystems once the runtime stream is idle, in this order: the side
    /// stream, open conditional nodes, the set-conditional kernel, the cuBLAS handle, memory
    /// pools did not give back; then the context (its own `Drop`: the stream and the primary
    /// context). Errors here have nowhere to go and are ignored, so teardown continues.
    fn drop(&mut self) {
        self.context.settle();
        self.side.release();
        self.conditionals.discard(&self.context);
        self.conditionals.unload();
        // The stream is synchronized above, so no GEMM still uses the workspace.
        self.blas.destroy();
        self.vmm.release();
    }
}
