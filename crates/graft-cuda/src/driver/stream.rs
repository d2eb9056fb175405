//! Streams, events and stream capture: creating, synchronizing, querying and destroying streams and events, and beginning, inspecting and ending a stream's capture.

use std::ffi::c_uint;
use std::ptr;

use cudarc::driver::sys;
use graft_core::{CaptureViolation, DeviceError, DeviceOp};

use crate::error::{check, is_capture_error};

/// `CU_STREAM_CAPTURE_STATUS_NONE` as the number [`capture_status`] returns.
pub(crate) const CAPTURE_NONE: u32 =
    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;

/// `CU_STREAM_CAPTURE_STATUS_INVALIDATED` as the number [`capture_status`] returns.
pub(crate) const CAPTURE_INVALIDATED: u32 =
    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED as u32;

/// A new non-blocking stream in the current context (`cuStreamCreate`), owned by the caller,
/// who destroys it once with [`destroy`].
pub(crate) fn create(op: DeviceOp) -> Result<sys::CUstream, DeviceError> {
    let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
    let mut stream: sys::CUstream = ptr::null_mut();
    // SAFETY: the caller made the context current; `stream` is a valid out-pointer.
    check(op, unsafe {
        sys::cuStreamCreate(&mut stream, non_blocking)
    })?;
    Ok(stream)
}

/// Destroys a stream made by [`create`] (`cuStreamDestroy`), swapped out of `slot` so it is
/// destroyed once (null: nothing).
pub(crate) fn destroy(op: DeviceOp, slot: &mut sys::CUstream) -> Result<(), DeviceError> {
    let stream = std::mem::replace(slot, ptr::null_mut());
    if stream.is_null() {
        return Ok(());
    }
    // SAFETY: created by cuStreamCreate (`create`), synchronized by the caller, destroyed
    // exactly once (swapped out).
    check(op, unsafe { sys::cuStreamDestroy_v2(stream) })
}

/// Waits until all work on `stream` has finished (`cuStreamSynchronize`).
pub(crate) fn synchronize(op: DeviceOp, stream: sys::CUstream) -> Result<(), DeviceError> {
    // SAFETY: `stream` is a live stream of the current context.
    check(op, unsafe { sys::cuStreamSynchronize(stream) })
}

/// Whether all work on `stream` has finished (`cuStreamQuery`: success is true, not ready is
/// false).
#[cfg(any(feature = "test-support", feature = "nccl"))]
pub(crate) fn query(op: DeviceOp, stream: sys::CUstream) -> Result<bool, DeviceError> {
    // SAFETY: `stream` is a live stream of the current context.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(crate::error::map(op, other, 0)),
    }
}

/// Makes `stream` wait for `event` (`cuStreamWaitEvent`, flags `CU_EVENT_WAIT_DEFAULT`).
pub(crate) fn wait_event(
    op: DeviceOp,
    stream: sys::CUstream,
    event: sys::CUevent,
) -> Result<(), DeviceError> {
    // SAFETY: the stream and the event are live handles of the current context; flags 0 is
    // CU_EVENT_WAIT_DEFAULT.
    check(op, unsafe { sys::cuStreamWaitEvent(stream, event, 0) })
}

/// A new event without timing (`cuEventCreate`, `CU_EVENT_DISABLE_TIMING`) in the current
/// context, owned by the caller, who destroys it once with [`destroy_event`].
pub(crate) fn create_event(op: DeviceOp) -> Result<sys::CUevent, DeviceError> {
    let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    let mut event: sys::CUevent = ptr::null_mut();
    // SAFETY: the caller made the context current; `event` is a valid out-pointer.
    check(op, unsafe { sys::cuEventCreate(&mut event, no_timing) })?;
    Ok(event)
}

/// Records `event` on `stream` (`cuEventRecord`).
pub(crate) fn record_event(
    op: DeviceOp,
    event: sys::CUevent,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the event and the stream are live handles of the current context.
    check(op, unsafe { sys::cuEventRecord(event, stream) })
}

/// Whether the work `event` last recorded has finished (`cuEventQuery`: success is true, not
/// ready is false).
#[cfg(feature = "nccl")]
pub(crate) fn query_event(op: DeviceOp, event: sys::CUevent) -> Result<bool, DeviceError> {
    // SAFETY: `event` is a live event of the current context.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(crate::error::map(op, other, 0)),
    }
}

/// Destroys an event made by [`create_event`] (`cuEventDestroy`), swapped out of `slot` so it
/// is destroyed once (null: nothing).
pub(crate) fn destroy_event(op: DeviceOp, slot: &mut sys::CUevent) -> Result<(), DeviceError> {
    let event = std::mem::replace(slot, ptr::null_mut());
    if event.is_null() {
        return Ok(());
    }
    // SAFETY: created by cuEventCreate (`create_event`), destroyed exactly once (swapped out).
    check(op, unsafe { sys::cuEventDestroy_v2(event) })
}

/// `stream`'s capture status (`cuStreamIsCapturing`), `CU_STREAM_CAPTURE_STATUS_*` as a
/// number.
pub(crate) fn capture_status(op: DeviceOp, stream: sys::CUstream) -> Result<u32, DeviceError> {
    let mut status: u32 = CAPTURE_NONE;
    // SAFETY: `stream` is a live stream of the current context; `status` is a valid, aligned
    // out-pointer for the 4-byte repr(u32) status enum, read as a plain number so an
    // unexpected value is not undefined behaviour.
    check(op, unsafe {
        sys::cuStreamIsCapturing(
            stream,
            (&raw mut status).cast::<sys::CUstreamCaptureStatus>(),
        )
    })?;
    Ok(status)
}

/// Begins capturing `stream` in `mode` (`cuStreamBeginCapture`).
pub(crate) fn begin_capture(
    op: DeviceOp,
    stream: sys::CUstream,
    mode: sys::CUstreamCaptureMode,
) -> Result<(), DeviceError> {
    // SAFETY: `stream` is a live stream of the current context, not capturing (the caller
    // checked or the driver refuses); `mode` is a valid enum value.
    check(op, unsafe { sys::cuStreamBeginCapture_v2(stream, mode) })
}

/// Begins capturing `stream` into the existing `graph`, after its nodes `deps`
/// (`cuStreamBeginCaptureToGraph`, no edge data).
pub(crate) fn begin_capture_to_graph(
    op: DeviceOp,
    stream: sys::CUstream,
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    mode: sys::CUstreamCaptureMode,
) -> Result<(), DeviceError> {
    // SAFETY: the stream is live and not capturing; `graph` is a live graph of this context
    // owned by the caller; `deps` are nodes of it, `deps.len()` of them at `deps` (null when
    // empty); edge data null.
    check(op, unsafe {
        sys::cuStreamBeginCaptureToGraph(
            stream,
            graph,
            if deps.is_empty() {
                ptr::null()
            } else {
                deps.as_ptr()
            },
            ptr::null(),
            deps.len(),
            mode,
        )
    })
}

/// The raw `cuStreamEndCapture`: the graph it returns (null or partial on failure, owned by
/// the caller either way) and its result.
fn end_capture_raw(stream: sys::CUstream) -> (sys::CUgraph, sys::CUresult) {
    let mut graph: sys::CUgraph = ptr::null_mut();
    // SAFETY: `stream` is a live stream of the current context, whose capture this thread
    // began (the driver refuses otherwise); `graph` is a valid out-pointer.
    let result = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    (graph, result)
}

/// Ends `stream`'s capture (`cuStreamEndCapture`): the graph it returned (null, or partial on
/// failure: the caller owns and destroys it either way) and whether the end succeeded.
pub(crate) fn end_capture(
    op: DeviceOp,
    stream: sys::CUstream,
) -> (sys::CUgraph, Result<(), DeviceError>) {
    let (graph, result) = end_capture_raw(stream);
    (graph, check(op, result))
}

/// Ends `stream`'s capture as aborting a broken one does: like [`end_capture`], except that
/// the stream-capture family of errors (an invalidated or unjoined capture) counts as ended.
pub(crate) fn end_broken_capture(
    op: DeviceOp,
    stream: sys::CUstream,
) -> (sys::CUgraph, Result<(), DeviceError>) {
    let (graph, result) = end_capture_raw(stream);
    if is_capture_error(result) {
        return (graph, Ok(()));
    }
    (graph, check(op, result))
}

/// The graph `stream` is capturing into and the capture's current dependencies (the nodes
/// the next work would follow), from `cuStreamGetCaptureInfo`; a capture that is not active
/// (invalidated) is `Capture { Invalidated }`.
pub(crate) fn capture_info(
    op: DeviceOp,
    stream: sys::CUstream,
) -> Result<(sys::CUgraph, Vec<sys::CUgraphNode>), DeviceError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = ptr::null();
    let mut count: usize = 0;
    // SAFETY: the stream is a live stream of the current context; every out-pointer is valid;
    // edge data is not asked for (null).
    check(op, unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            ptr::null_mut(),
            &mut count,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Err(DeviceError::Capture {
            op,
            violation: CaptureViolation::Invalidated,
        });
    }
    let deps: Vec<sys::CUgraphNode> = if count == 0 || deps.is_null() {
        Vec::new()
    } else {
        // SAFETY: the driver returned `count` node handles at `deps`, valid until the next
        // call on the stream; they are copied out at once.
        unsafe { std::slice::from_raw_parts(deps, count) }.to_vec()
    };
    Ok((graph, deps))
}

/// Sets the calling thread's capture mode to `mode` (`cuThreadExchangeStreamCaptureMode`),
/// writing the previous mode back into `mode`.
pub(crate) fn exchange_capture_mode(
    op: DeviceOp,
    mode: &mut sys::CUstreamCaptureMode,
) -> Result<(), DeviceError> {
    // SAFETY: exchanges this thread's capture mode with a valid enum value; `mode` is a valid
    // in-out pointer.
    check(op, unsafe { sys::cuThreadExchangeStreamCaptureMode(mode) })
}
