//! How a candle error raised during a capture is recognized as an operation that cannot be
//! captured (so the step falls back to eager instead of failing), and the device operation
//! graft-core is told broke the capture.
//!
//! With candle's graph upload cache on (graft-candle turns it on around every call), candle
//! itself refuses a host copy during a capture ("clone_dtoh during CUDA graph capture ...")
//! and an upload its cache does not hold ("CUDA graph capture cannot upload uncached host
//! data"); a read that bypasses that check (`Tensor::to_vec1` and friends copy on the stream
//! directly) is refused by CUDA with one of the stream-capture error codes, which candle wraps
//! as `candle_core::Error::Cuda` and the backend reads.

use candle_core::Error as CandleError;
use graft_core::DeviceOp;

use crate::refusal::Uncapturable;

/// The error candle wraps in `candle_core::Error::Cuda` (a CUDA driver error, on CUDA).
pub(crate) type DriverSource = dyn std::error::Error + Send + Sync + 'static;

impl Uncapturable {
    /// The device operation graft-core is told broke the capture.
    pub(crate) fn device_op(&self) -> DeviceOp {
        match self {
            Uncapturable::HostRead { .. } | Uncapturable::CudaCall { .. } => DeviceOp::Read,
            Uncapturable::Upload { .. } => DeviceOp::Write,
            Uncapturable::FreedOutside { .. } => DeviceOp::RawAlloc,
        }
    }
}

/// The uncapturable operation a candle error reports, if it reports one, through candle's
/// wrappers; `driver` reads the CUDA errors candle wraps (the backend's, which knows CUDA's
/// codes).
pub(crate) fn classify(
    error: &CandleError,
    driver: fn(&DriverSource) -> Option<Uncapturable>,
) -> Option<Uncapturable> {
    match error {
        CandleError::WithBacktrace { inner, .. }
        | CandleError::Context { inner, .. }
        | CandleError::WithPath { inner, .. } => classify(inner, driver),
        CandleError::Msg(message) => classify_message(message),
        CandleError::Cuda(source) => driver(source.as_ref()),
        _ => None,
    }
}

/// candle's own refusals, by their text (candle-core 0.11.1, `cuda_backend/device.rs` and
/// `cuda_backend/mod.rs`). Uploads first: the kernel-parameter cache's miss ("h2d param
/// cache miss during CUDA graph capture") shares its ending with the host reads' refusal
/// ("clone_dtoh during CUDA graph capture").
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

#[cfg(test)]
mod tests {
    use super::*;

    fn no_driver(_: &DriverSource) -> Option<Uncapturable> {
        None
    }

    #[test]
    fn candles_own_refusals_are_recognized_through_wrappers() {
        let read = CandleError::Msg(
            "clone_dtoh during CUDA graph capture: host/device copies are not permitted while capturing (use param cache for kernel parameters)".into(),
        )
        .bt()
        .context("in the step");
        let op = classify(&read, no_driver).expect("a host read");
        assert_eq!(
            op,
            Uncapturable::HostRead {
                call: "clone_dtoh".into()
            }
        );
        assert_eq!(op.device_op(), graft_core::DeviceOp::Read);
        assert!(op.to_string().contains("clone_dtoh"), "{op}");

        let upload = CandleError::Msg("CUDA graph capture cannot upload uncached host data".into());
        let op = classify(&upload, no_driver).expect("an upload");
        assert!(matches!(op, Uncapturable::Upload { .. }));
        assert_eq!(op.device_op(), graft_core::DeviceOp::Write);
        assert!(op.to_string().contains("outside the body"), "{op}");
    }

    #[test]
    fn a_parameter_upload_is_an_upload_not_a_host_read() {
        let miss = CandleError::Msg(
            "h2d param cache miss during CUDA graph capture: warmup did not populate all required parameter vectors".into(),
        );
        let op = classify(&miss, no_driver).expect("an upload");
        assert!(matches!(op, Uncapturable::Upload { .. }), "{op:?}");
        assert_eq!(op.device_op(), graft_core::DeviceOp::Write);
        assert!(!op.to_string().contains("device-to-host"), "{op}");
        let storage = CandleError::Msg(
            "to_cpu_storage during CUDA graph capture: host/device copies are not permitted while capturing".into(),
        );
        assert_eq!(
            classify(&storage, no_driver),
            Some(Uncapturable::HostRead {
                call: "to_cpu_storage".into()
            })
        );
    }

    #[test]
    fn other_errors_are_not_capture_refusals() {
        let shape = CandleError::Msg("shape mismatch in matmul".into());
        assert_eq!(classify(&shape, no_driver), None);
        assert_eq!(classify(&CandleError::UnwrapNone, no_driver), None);
    }

    #[test]
    fn wrapped_driver_errors_go_to_the_backend() {
        fn freed(_: &DriverSource) -> Option<Uncapturable> {
            Some(Uncapturable::FreedOutside {
                error: "CUDA_ERROR_INVALID_VALUE".into(),
            })
        }
        let wrapped = CandleError::Cuda(Box::new(std::fmt::Error)).context("in the step");
        assert!(matches!(
            classify(&wrapped, freed),
            Some(Uncapturable::FreedOutside { .. })
        ));
        assert_eq!(classify(&wrapped, no_driver), None);
    }
}
