//! `SideStream`: a second CUDA stream beside a candle device's own, for work of these kernels
//! that can overlap the device stream's (a shared expert beside the routed experts). candle
//! runs every op on its device's one stream, so only this crate's matrix-vector launches go to
//! the side stream, each after an edge from the device stream (recorded after its output was
//! allocated there), and the op that uses it joins the side stream back before it returns its
//! result or frees anything the side stream reads. Inside a CUDA-graph capture the edges
//! become the graph's fork and join, so the recording holds both branches.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{Device, Result};

/// A side stream of one CUDA device, or none (a CPU device, or work meant for the device's
/// own stream): work given to a `SideStream` without a stream runs on the device's stream, in
/// order. Clones share the stream.
#[derive(Debug, Clone, Default)]
pub struct SideStream {
    #[cfg(feature = "cuda")]
    cuda: Option<std::sync::Arc<cuda::Side>>,
}

impl SideStream {
    /// A new side stream of `device` (a non-blocking stream of its CUDA context, with the two
    /// events of its fork and join); on any other device, none.
    pub fn new(device: &Device) -> Result<SideStream> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => Ok(SideStream {
                cuda: Some(std::sync::Arc::new(cuda::Side::new(cuda)?)),
            }),
            _ => Ok(SideStream::none()),
        }
    }

    /// No side stream: work runs on the device's own.
    pub fn none() -> SideStream {
        SideStream::default()
    }

    /// Runs `side` (launches of this crate's ops given this side stream, which go to it) and
    /// then `main` (the device stream's work that overlaps them), and joins the side stream
    /// back into the device's: everything enqueued after this returns waits for both. The join
    /// happens whether or not either closure fails; the first error is returned. `side`'s
    /// result (and every tensor it holds, which the side stream may still read) is returned
    /// only after the join, so nothing it uses is freed or read on the device stream before.
    pub(crate) fn beside<A, B>(
        &self,
        side: impl FnOnce() -> Result<A>,
        main: impl FnOnce() -> Result<B>,
    ) -> Result<(A, B)> {
        let a = match side() {
            Ok(a) => a,
            Err(e) => {
                // Still joined: the side may have enqueued work on tensors about to be freed.
                self.join()?;
                return Err(e);
            }
        };
        let b = main();
        self.join()?;
        Ok((a, b?))
    }

    /// Makes the device stream wait for everything enqueued on the side stream.
    fn join(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(side) = &self.cuda {
            return side.join();
        }
        Ok(())
    }

    /// The stream an op of this crate launches on: the side stream, after an edge from the
    /// device stream (so the launch follows everything enqueued there, its output's
    /// allocation included), or the device's own.
    #[cfg(feature = "cuda")]
    pub(crate) fn launch_stream(
        &self,
        device: &candle_core::cuda_backend::CudaDevice,
    ) -> Result<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>> {
        match &self.cuda {
            Some(side) => side.after_main(),
            None => Ok(device.cuda_stream()),
        }
    }
}
