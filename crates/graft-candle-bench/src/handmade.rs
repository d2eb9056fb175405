//! A hand-made single CUDA graph of a candle decode step, captured once on candle's stream
//! with cudarc and relaunched: the smallest graph a candle user could write by hand, and
//! what graft-candle's benchmarks compare against.
//!
//! It has the shape serving engines use: one fixed token tensor the graph reads and, as its
//! last node, overwrites with the step's result, so a decode loop is one launch per token
//! with no copy before or after it and no allocation. The caller reads the tokens from that
//! tensor (they are overwritten by the next launch) and writes its own with
//! [`HandmadeGraph::set_tokens`]. One shape, no tree, no liveness checks, no fallback.

use std::sync::Arc;

use candle_core::Tensor;
use candle_core::cuda_backend::CudaDevice as CandleCuda;
use candle_core::cuda_backend::cudarc::driver::{CudaGraph, CudaStream, sys};

use graft_candle::Error;
use graft_candle::cuda::{driver, tensor_range, uninit_tensor};
use graft_cuda::CudaDevice as GraftCuda;

const NAME: &str = "hand-made graph";

/// One captured step and the fixed token tensor it reads and writes.
pub struct HandmadeGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
    /// graft-cuda's device over candle's stream: its raw copy.
    copier: GraftCuda,
    tokens: Tensor,
}

impl std::fmt::Debug for HandmadeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandmadeGraph")
            .field("tokens", &self.tokens.shape())
            .finish_non_exhaustive()
    }
}

fn candle(what: &'static str) -> impl Fn(candle_core::Error) -> Error {
    move |source| Error::Candle {
        step: Arc::from(NAME),
        what,
        source,
    }
}

/// Enqueues a copy of `bytes` from `src` to `dst` on candle's stream (graft-cuda's
/// `CudaDevice::copy_raw`, inside a capture a memcpy node).
///
/// # Safety
/// `dst` and `src` are the data of two distinct contiguous tensors of at least `bytes`, which
/// the caller holds until the stream has run the copy.
unsafe fn copy(copier: &GraftCuda, dst: u64, src: u64, bytes: usize) -> Result<(), Error> {
    // SAFETY: the caller's contract, which is `copy_raw`'s.
    unsafe { copier.copy_raw(dst, src, bytes) }.map_err(|source| Error::Device {
        what: "copying tokens (cuMemcpyDtoDAsync)",
        source,
    })
}

/// The device range of a contiguous tensor, or the error naming it when its dtype has none.
fn range(t: &Tensor, stream: &Arc<CudaStream>, role: &'static str) -> Result<(u64, usize), Error> {
    tensor_range(t, stream).ok_or_else(|| Error::UnsupportedDtype {
        step: Arc::from(NAME),
        role,
        position: 0,
        dtype: t.dtype(),
    })
}

impl HandmadeGraph {
    /// Runs `step` once eagerly on `first` (a warmup: it loads candle's kernels and fills
    /// candle's upload cache; its effects on the step's state happen), then captures it once
    /// on the fixed token tensor, holding `first`, with the step's result copied back into
    /// that tensor as the graph's last node. `step` must return a tensor of `first`'s dtype
    /// and shape and drop every other tensor it makes before it returns.
    pub fn capture<F>(
        device: &CandleCuda,
        first: &Tensor,
        mut step: F,
    ) -> Result<HandmadeGraph, Error>
    where
        F: FnMut(&Tensor) -> candle_core::Result<Tensor>,
    {
        let stream = device.cuda_stream();
        let _cache = device.enable_cuda_graph_htod_cache();
        let first = first
            .contiguous()
            .map_err(candle("making the tokens contiguous"))?;
        drop(step(&first).map_err(candle("the warmup run"))?);
        let tokens = uninit_tensor(device, first.dtype(), first.shape())
            .map_err(candle("allocating the token tensor"))?;
        let copier = GraftCuda::from_stream(stream.clone()).map_err(|source| Error::Device {
            what: "opening graft-cuda's device on candle's stream",
            source,
        })?;
        let (dst, bytes) = range(&tokens, &stream, "tokens")?;
        let (src, _) = range(&first, &stream, "tokens")?;
        // SAFETY: `tokens` (fresh) and `first` are distinct tensors of `bytes`, both held until
        // the stream has run the copy (`first` by the caller, `tokens` by the graph).
        unsafe { copy(&copier, dst, src, bytes) }?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning the capture"))?;
        let captured = step(&tokens).and_then(|next| {
            let next = next.contiguous()?;
            if next.dtype() != tokens.dtype() || next.shape() != tokens.shape() {
                candle_core::bail!("the step's result does not match its tokens' dtype and shape");
            }
            let (src, _) = range(&next, &stream, "tokens")
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            // SAFETY: `next` is the step's result, a tensor other than `tokens`, of `bytes`;
            // inside the capture the copy is a node reading `next`'s graph allocation.
            unsafe { copy(&copier, dst, src, bytes) }
                .map_err(|e| candle_core::Error::Msg(format!("copying the result: {e}")))
        });
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        if let Err(source) = captured {
            // The failed capture may have left an error in cudarc's context: it is this one.
            let _ = stream.context().check_err();
            return Err(candle("the captured run")(source));
        }
        let graph = ended
            .map_err(driver("ending the capture and instantiating the graph"))?
            .ok_or_else(|| {
                candle("ending the capture")(candle_core::Error::Msg(
                    "the capture produced no graph".into(),
                ))
            })?;
        graph.upload().map_err(driver("uploading the graph"))?;
        Ok(HandmadeGraph {
            graph,
            stream,
            copier,
            tokens,
        })
    }

    /// Launches the graph: one decode step, whose tokens replace the ones in
    /// [`HandmadeGraph::tokens`].
    pub fn launch(&self) -> Result<(), Error> {
        self.graph.launch().map_err(driver("launching the graph"))
    }

    /// The fixed token tensor: after a launch, the step's result. The next launch overwrites
    /// it, so read it (or copy it) before launching again.
    pub fn tokens(&self) -> &Tensor {
        &self.tokens
    }

    /// Writes `tokens` into the fixed token tensor (a copy on candle's stream).
    pub fn set_tokens(&self, tokens: &Tensor) -> Result<(), Error> {
        let tokens = tokens
            .contiguous()
            .map_err(candle("making the tokens contiguous"))?;
        let (dst, bytes) = range(&self.tokens, &self.stream, "tokens")?;
        let (src, given) = range(&tokens, &self.stream, "tokens")?;
        if given != bytes || tokens.dtype() != self.tokens.dtype() {
            return Err(candle("checking the tokens")(candle_core::Error::Msg(
                format!(
                    "the hand-made graph was captured for {bytes} bytes of {:?}, got {given} bytes of {:?}",
                    self.tokens.dtype(),
                    tokens.dtype()
                ),
            )));
        }
        // SAFETY: `tokens` is the caller's tensor, of the same size, held by the caller until
        // the copy has run (the stream runs it before anything launched after it).
        unsafe { copy(&self.copier, dst, src, bytes) }
    }
}
