//! What CUDA says about a body whose capture broke: the driver errors candle wraps, the error
//! cudarc defers to its next call, and a capture invalidated without an error returned.

use std::sync::Arc;

use candle_core::cuda_backend::CudaError;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::driver::sys::CUresult;
use graft_cuda::CudaDevice as GraftCuda;

use crate::graphed::classify::DriverSource;
use crate::refusal::Uncapturable;

/// A CUDA driver error raised during a capture, wrapped by candle (see [`deferred`]): what
/// `graphed::classify` is given for `candle_core::Error::Cuda`.
pub(super) fn classify_driver(source: &DriverSource) -> Option<Uncapturable> {
    let Some(CudaError::Cuda(driver)) = source.downcast_ref::<CudaError>() else {
        return None;
    };
    deferred(driver.0)
}

/// What a CUDA error raised during a capture says about the body: a free of memory made
/// outside the capture (the only invalid value a captured candle body produces: its
/// kernels' arguments were valid when it ran eagerly), or a call the capture refused.
fn deferred(code: CUresult) -> Option<Uncapturable> {
    if code == CUresult::CUDA_ERROR_INVALID_VALUE {
        return Some(Uncapturable::FreedOutside {
            error: format!("{code:?}"),
        });
    }
    let capture = matches!(
        code,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | CUresult::CUDA_ERROR_CAPTURED_EVENT
            | CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    );
    capture.then(|| Uncapturable::CudaCall {
        error: format!("{code:?}"),
    })
}

/// An operation that broke the capture of a body that returned normally: cudarc records the
/// errors of calls that cannot return one (the synchronize after a host read, a free) and the
/// capture may be invalidated (asked of graft-cuda's handle on the same stream). Called at the
/// end of a recorded body, so what cudarc holds is this body's. A failed query says nothing
/// about the body: graft-core's end of the capture reports what is wrong.
pub(super) fn silent_capture_failure(
    stream: &Arc<CudaStream>,
    cuda: &GraftCuda,
) -> Option<Uncapturable> {
    if let Err(error) = stream.context().check_err() {
        return Some(deferred(error.0).unwrap_or(Uncapturable::CudaCall {
            error: format!("{:?}", error.0),
        }));
    }
    cuda.capture_invalidated()
        .unwrap_or(false)
        .then(|| Uncapturable::CudaCall {
            error: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED".to_string(),
        })
}

/// After a capture candle's body broke, cudarc may hold an error it recorded on the way
/// (a free or synchronize inside the invalidated capture) and would return it from the next
/// unrelated call. That error belongs to the failed capture: it is taken here, and what it
/// says about the body returned.
pub(super) fn take_deferred_error(stream: &Arc<CudaStream>) -> Option<Uncapturable> {
    let error = stream.context().check_err().err()?;
    tracing::debug!(%error, "took cudarc's error left by the failed capture");
    Some(deferred(error.0).unwrap_or(Uncapturable::CudaCall {
        error: format!("{:?}", error.0),
    }))
}
