//! Why a step ran eagerly, and how a candle error raised during a capture is recognized as an
//! operation that cannot be captured (so the step falls back to eager instead of failing).
//!
//! With candle's graph upload cache on (graft-candle turns it on around every call), candle
//! itself refuses a host copy during a capture ("clone_dtoh during CUDA graph capture ...")
//! and an upload its cache does not hold ("CUDA graph capture cannot upload uncached host
//! data"); a read that bypasses that check (`Tensor::to_vec1` and friends copy on the stream
//! directly) is refused by CUDA with one of the stream-capture error codes.

use std::fmt;

#[cfg(any(test, feature = "cuda"))]
use candle_core::Error as CandleError;

/// An operation candle cannot perform inside a CUDA graph capture.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Uncapturable {
    /// A copy from the device to the host that candle refused during the capture; `call` is
    /// the copy candle named (`clone_dtoh`, `memcpy_dtoh`).
    HostRead {
        /// candle's name of the copy.
        call: String,
    },
    /// An upload of host data that candle's graph upload cache does not hold (larger than
    /// its 4 KiB limit, or not seen during the warmup).
    Upload {
        /// candle's message.
        detail: String,
    },
    /// A CUDA call candle made was refused by the capture: a host read (`to_vec*`,
    /// `to_scalar`), a synchronize, or work on another stream.
    CudaCall {
        /// CUDA's error name.
        error: String,
    },
    /// The body freed, inside the capture, a tensor made outside it: CUDA refuses such a free
    /// (`CUDA_ERROR_INVALID_VALUE`), and cudarc raises the error at its next call. The body
    /// replaced state it keeps (a KV cache grown with `Tensor::cat` and stored back), and the
    /// replacement's work never ran.
    FreedOutside {
        /// CUDA's error name.
        error: String,
    },
}

#[cfg(any(test, feature = "cuda"))]
impl Uncapturable {
    /// The device operation graft-core is told broke the capture.
    pub(crate) fn device_op(&self) -> graft_core::DeviceOp {
        match self {
            Uncapturable::HostRead { .. } | Uncapturable::CudaCall { .. } => {
                graft_core::DeviceOp::Read
            }
            Uncapturable::Upload { .. } => graft_core::DeviceOp::Write,
            Uncapturable::FreedOutside { .. } => graft_core::DeviceOp::RawAlloc,
        }
    }
}

impl fmt::Display for Uncapturable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Uncapturable::HostRead { call } => write!(
                f,
                "a device-to-host copy ({call}) inside the step; read results after the call, not inside the body"
            ),
            Uncapturable::Upload { detail } => write!(
                f,
                "an upload of host data inside the step ({detail}); create such tensors outside the body and capture them by reference"
            ),
            Uncapturable::CudaCall { error } => write!(
                f,
                "a CUDA call refused during capture ({error}): a host read (to_vec, to_scalar), a synchronize, or work on another stream inside the step; move it out of the body"
            ),
            Uncapturable::FreedOutside { error } => write!(
                f,
                "the body freed a tensor made outside the step inside the capture ({error} from cudarc's next call): it replaced state it keeps, such as a kv cache grown with Tensor::cat and stored back; keep such state in tensors allocated once and written in place (graft_candle::models::KvCache)"
            ),
        }
    }
}

/// Why a call of a step ran eagerly.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum EagerCause {
    /// The runtime's candle device is not a CUDA device (or graft-candle was built without
    /// its `cuda` feature): every step runs eagerly.
    NotCuda {
        /// candle's device location, e.g. "Cpu".
        location: String,
    },
    /// The body did something that cannot be captured: this signature of the step runs
    /// eagerly from now on.
    Uncapturable(Uncapturable),
    /// graft decided (registered eager-only, not allow-listed, re-record limit, a capture
    /// or instantiation failure graft-core saw itself), with graft-core's typed reason.
    Graft(graft_core::EagerReason),
}

impl fmt::Display for EagerCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerCause::NotCuda { location } => write!(
                f,
                "the candle device is {location}, not CUDA (or graft-candle was built without its cuda feature): steps run eagerly"
            ),
            EagerCause::Uncapturable(op) => write!(f, "not capturable: {op}"),
            EagerCause::Graft(reason) => write!(f, "{reason}"),
        }
    }
}

/// The uncapturable operation a candle error reports, if it reports one.
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn classify(error: &CandleError) -> Option<Uncapturable> {
    match error {
        CandleError::WithBacktrace { inner, .. }
        | CandleError::Context { inner, .. }
        | CandleError::WithPath { inner, .. } => classify(inner),
        CandleError::Msg(message) => classify_message(message),
        #[cfg(feature = "cuda")]
        CandleError::Cuda(source) => classify_cuda(source.as_ref()),
        _ => None,
    }
}

/// candle's own refusals, by their text (candle-core 0.11.1, `cuda_backend/device.rs` and
/// `cuda_backend/mod.rs`). Uploads first: the kernel-parameter cache's miss ("h2d param
/// cache miss during CUDA graph capture") shares its ending with the host reads' refusal
/// ("clone_dtoh during CUDA graph capture").
#[cfg(any(test, feature = "cuda"))]
fn classify_message(message: &str) -> Option<Uncapturable> {
    let upload = [
        "cannot upload uncached host data",
        "missing cached host data",
        "h2d param cache miss",
    ];
    if upload.iter().any(|u| message.contains(u)) {
        return Some(Uncapturable::Upload {
            detail: message.to_string(),
        });
    }
    let reads = ["clone_dtoh", "memcpy_dtoh", "to_cpu_storage"];
    if let Some(at) = message.find(" during CUDA graph capture") {
        let call = message[..at].rsplit(' ').next().unwrap_or("host copy");
        if reads.contains(&call) {
            return Some(Uncapturable::HostRead {
                call: call.to_string(),
            });
        }
        return Some(Uncapturable::CudaCall {
            error: message.to_string(),
        });
    }
    None
}

/// A CUDA driver error raised during a capture, wrapped by candle (see [`deferred`]).
#[cfg(feature = "cuda")]
fn classify_cuda(source: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Uncapturable> {
    use candle_core::cuda_backend::CudaError;
    let Some(CudaError::Cuda(driver)) = source.downcast_ref::<CudaError>() else {
        return None;
    };
    deferred(driver.0)
}

/// What a CUDA error raised during a capture says about the body: a free of memory made
/// outside the capture (the only invalid value a captured candle body produces: its
/// kernels' arguments were valid when it ran eagerly), or a call the capture refused.
#[cfg(feature = "cuda")]
pub(crate) fn deferred(
    code: candle_core::cuda_backend::cudarc::driver::sys::CUresult,
) -> Option<Uncapturable> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUresult;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candles_own_refusals_are_recognized_through_wrappers() {
        let read = CandleError::Msg(
            "clone_dtoh during CUDA graph capture: host/device copies are not permitted while capturing (use param cache for kernel parameters)".into(),
        )
        .bt()
        .context("in the step");
        let op = classify(&read).expect("a host read");
        assert_eq!(
            op,
            Uncapturable::HostRead {
                call: "clone_dtoh".into()
            }
        );
        assert_eq!(op.device_op(), graft_core::DeviceOp::Read);
        assert!(op.to_string().contains("clone_dtoh"), "{op}");

        let upload = CandleError::Msg("CUDA graph capture cannot upload uncached host data".into());
        let op = classify(&upload).expect("an upload");
        assert!(matches!(op, Uncapturable::Upload { .. }));
        assert_eq!(op.device_op(), graft_core::DeviceOp::Write);
        assert!(op.to_string().contains("outside the body"), "{op}");
    }

    #[test]
    fn a_parameter_upload_is_an_upload_not_a_host_read() {
        let miss = CandleError::Msg(
            "h2d param cache miss during CUDA graph capture: warmup did not populate all required parameter vectors".into(),
        );
        let op = classify(&miss).expect("an upload");
        assert!(matches!(op, Uncapturable::Upload { .. }), "{op:?}");
        assert_eq!(op.device_op(), graft_core::DeviceOp::Write);
        assert!(!op.to_string().contains("device-to-host"), "{op}");
        let storage = CandleError::Msg(
            "to_cpu_storage during CUDA graph capture: host/device copies are not permitted while capturing".into(),
        );
        assert_eq!(
            classify(&storage),
            Some(Uncapturable::HostRead {
                call: "to_cpu_storage".into()
            })
        );
    }

    #[test]
    fn other_errors_are_not_capture_refusals() {
        let shape = CandleError::Msg("shape mismatch in matmul".into());
        assert_eq!(classify(&shape), None);
        assert_eq!(classify(&CandleError::UnwrapNone), None);
    }

    #[test]
    fn causes_say_what_to_do() {
        let cause = EagerCause::NotCuda {
            location: "Cpu".into(),
        };
        assert!(cause.to_string().contains("not CUDA"), "{cause}");
        let cause = EagerCause::Graft(graft_core::EagerReason::Registered);
        assert_eq!(cause.to_string(), "registered eager-only");
    }
}
