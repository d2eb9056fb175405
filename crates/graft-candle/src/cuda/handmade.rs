//! A hand-made single CUDA graph of a candle step, captured once on candle's stream with
//! cudarc and relaunched: what candle users write by hand today, and what graft-candle's
//! benchmark compares against. Same contract as graft-candle (the caller's input is copied
//! into the graph's input tensor before each launch, the output copied into a tensor the
//! caller owns after), but one shape, no tree, no liveness checks, no fallback.

use std::sync::Arc;

use candle_core::Tensor;
use candle_core::cuda_backend::CudaDevice as CandleCuda;
use candle_core::cuda_backend::cudarc::driver::{CudaGraph, CudaStream, sys};

use super::copy::{checked_range, copy, tensor_range, uninit_tensor};
use crate::error::Error;

const NAME: &str = "hand-made graph";

/// One captured step and its input and output tensors.
pub struct HandmadeGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
    device: CandleCuda,
    input: Tensor,
    output: Tensor,
}

impl std::fmt::Debug for HandmadeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandmadeGraph")
            .field("input", &self.input.shape())
            .field("output", &self.output.shape())
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

fn driver(
    what: &'static str,
) -> impl Fn(candle_core::cuda_backend::cudarc::driver::DriverError) -> Error {
    move |source| Error::Driver { what, source }
}

/// The device range of a tensor known to be a standard-dtype CUDA tensor.
fn range(t: &Tensor, stream: &Arc<CudaStream>, role: &'static str) -> Result<(u64, usize), Error> {
    let t = t
        .contiguous()
        .map_err(candle("making a tensor contiguous"))?;
    checked_range(&t, stream, &Arc::from(NAME), role, 0)
}

impl HandmadeGraph {
    /// Runs `step` once eagerly on `example` (a warmup: it loads candle's kernels and fills
    /// candle's upload cache; its effects on the step's state happen), then captures it once
    /// on an input tensor of `example`'s shape, the output copied into a tensor of the graph's
    /// own inside the graph. Every tensor `step` makes must be dropped before it returns.
    pub fn capture<F>(
        device: &CandleCuda,
        example: &Tensor,
        mut step: F,
    ) -> Result<HandmadeGraph, Error>
    where
        F: FnMut(&Tensor) -> candle_core::Result<Tensor>,
    {
        let stream = device.cuda_stream();
        let _cache = device.enable_cuda_graph_htod_cache();
        let warm = step(example).map_err(candle("the warmup run"))?;
        let input = uninit_tensor(device, example.dtype(), example.shape())
            .map_err(candle("allocating the input tensor"))?;
        let (dst, bytes) = range(&input, &stream, "input")?;
        let (src, _) = range(example, &stream, "input")?;
        copy(dst, src, bytes, &stream).map_err(driver("copying the example input"))?;
        let output = uninit_tensor(device, warm.dtype(), warm.shape())
            .map_err(candle("allocating the output tensor"))?;
        drop(warm);
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning the capture"))?;
        let captured = step(&input).and_then(|result| {
            let (src, bytes) = tensor_range(&result, &stream)
                .ok_or_else(|| candle_core::Error::Msg("unsupported output dtype".into()))?;
            let (dst, _) = tensor_range(&output, &stream)
                .ok_or_else(|| candle_core::Error::Msg("unsupported output dtype".into()))?;
            copy(dst, src, bytes, &stream)
                .map_err(|e| candle_core::Error::Msg(format!("copying the output: {e}")))
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
            device: device.clone(),
            input,
            output,
        })
    }

    /// Copies `input` into the graph's input tensor, launches the graph, and returns the
    /// output copied into a new tensor the caller owns.
    pub fn launch(&self, input: &Tensor) -> Result<Tensor, Error> {
        let (dst, bytes) = range(&self.input, &self.stream, "input")?;
        let (src, given) = range(input, &self.stream, "input")?;
        if given != bytes {
            return Err(candle("checking the input")(candle_core::Error::Msg(
                format!(
                    "the hand-made graph was captured for a {bytes}-byte input, got {given} bytes"
                ),
            )));
        }
        copy(dst, src, bytes, &self.stream).map_err(driver("copying the input"))?;
        self.graph.launch().map_err(driver("launching the graph"))?;
        let out = uninit_tensor(&self.device, self.output.dtype(), self.output.shape())
            .map_err(candle("allocating the output tensor"))?;
        let (dst, bytes) = range(&out, &self.stream, "output")?;
        let (src, _) = range(&self.output, &self.stream, "output")?;
        copy(dst, src, bytes, &self.stream).map_err(driver("copying the output"))?;
        Ok(out)
    }
}
