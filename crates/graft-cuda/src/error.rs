//! The one layer between the CUDA driver and graft's errors: driver results (`CUresult`) mapped to graft's backend-neutral [`DeviceError`], and the error for arguments refused before the driver sees them.
//!
//! Nothing here calls the driver: the error's name comes from cudarc's `CUresult` enum (its
//! variants are named exactly as CUDA names its codes), so mapping works, and is tested, on a
//! machine without libcuda.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::driver::sys::CUresult;
use graft_core::{CaptureViolation, DeviceError, DeviceOp};

/// The operation reported for failures while inspecting a captured graph ([`crate::CudaDevice`]'s
/// `summarize`). `DeviceOp` has no "graph inspect" variant; the graph being inspected is the one
/// instantiation produced, so `Instantiate` is the closest.
pub(crate) const INSPECT_OP: DeviceOp = DeviceOp::Instantiate;

/// The error for arguments the backend refuses before the driver sees them.
pub(crate) fn invalid_argument(op: DeviceOp, what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument { op, what }
}

/// Turns a driver result into `Ok(())` or the mapped error. `OutOfMemory` reports 0 bytes: use
/// [`check_alloc`] where the size is known.
#[inline]
pub(crate) fn check(op: DeviceOp, result: CUresult) -> Result<(), DeviceError> {
    check_alloc(op, result, 0)
}

/// Like [`check`], for calls that allocate `bytes`.
#[inline]
pub(crate) fn check_alloc(op: DeviceOp, result: CUresult, bytes: usize) -> Result<(), DeviceError> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(map(op, other, bytes)),
    }
}

/// Maps a failing driver result to the core error for `op`.
///
/// - `CUDA_ERROR_OUT_OF_MEMORY` becomes `OutOfMemory` (with `bytes`).
/// - The stream-capture family (`CUDA_ERROR_STREAM_CAPTURE_*`, `CUDA_ERROR_CAPTURED_EVENT`)
///   becomes `Capture` with the matching [`CaptureViolation`], except `_UNMATCHED` ("the capture
///   was not begun on this stream"), which is a lifecycle misuse and becomes `CaptureState`.
/// - Everything else becomes `Driver` with CUDA's numeric code and name.
#[cold]
pub(crate) fn map(op: DeviceOp, result: CUresult, bytes: usize) -> DeviceError {
    use CUresult as R;
    let violation = match result {
        R::CUDA_ERROR_OUT_OF_MEMORY => return DeviceError::OutOfMemory { op, bytes },
        R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => {
            return DeviceError::CaptureState {
                op,
                state: "the capture was not begun on the runtime stream",
            };
        }
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => CaptureViolation::Unsupported,
        R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => CaptureViolation::Invalidated,
        R::CUDA_ERROR_STREAM_CAPTURE_MERGE => CaptureViolation::Merge,
        R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => CaptureViolation::Unjoined,
        R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION => CaptureViolation::Isolation,
        R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => CaptureViolation::Implicit,
        R::CUDA_ERROR_CAPTURED_EVENT => CaptureViolation::CapturedEvent,
        R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => CaptureViolation::WrongThread,
        other => {
            return DeviceError::Driver {
                op,
                code: other as u32,
                name: error_name(other),
            };
        }
    };
    DeviceError::Capture { op, violation }
}

/// Whether `result` belongs to the stream-capture family (what aborting a broken capture expects
/// and ignores).
pub(crate) fn is_capture_error(result: CUresult) -> bool {
    use CUresult as R;
    matches!(
        result,
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | R::CUDA_ERROR_STREAM_CAPTURE_MERGE
            | R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | R::CUDA_ERROR_CAPTURED_EVENT
            | R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    )
}

/// CUDA's name for `result` ("CUDA_ERROR_INVALID_VALUE"), as a `&'static str`.
///
/// The name is the enum variant's `Debug` text, interned once per distinct code in a
/// process-wide table; CUDA has about a hundred codes, so the table (and what it leaks) is
/// bounded. Errors are the cold path, so the lock costs nothing that matters.
pub(crate) fn error_name(result: CUresult) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<u32, &'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    names
        .entry(result as u32)
        .or_insert_with(|| Box::leak(format!("{result:?}").into_boxed_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_keeps_the_size() {
        assert_eq!(
            check_alloc(DeviceOp::Map, CUresult::CUDA_ERROR_OUT_OF_MEMORY, 4096),
            Err(DeviceError::OutOfMemory {
                op: DeviceOp::Map,
                bytes: 4096
            })
        );
    }

    #[test]
    fn success_is_ok() {
        assert_eq!(check(DeviceOp::Copy, CUresult::CUDA_SUCCESS), Ok(()));
    }

    #[test]
    fn capture_family_maps_to_violations() {
        let cases = [
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                CaptureViolation::Unsupported,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                CaptureViolation::Invalidated,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE,
                CaptureViolation::Merge,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
                CaptureViolation::Unjoined,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                CaptureViolation::Isolation,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                CaptureViolation::Implicit,
            ),
            (
                CUresult::CUDA_ERROR_CAPTURED_EVENT,
                CaptureViolation::CapturedEvent,
            ),
            (
                CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
                CaptureViolation::WrongThread,
            ),
        ];
        for (code, violation) in cases {
            assert!(is_capture_error(code));
            assert_eq!(
                map(DeviceOp::Synchronize, code, 0),
                DeviceError::Capture {
                    op: DeviceOp::Synchronize,
                    violation
                }
            );
        }
        assert!(matches!(
            map(
                DeviceOp::EndCapture,
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
                0
            ),
            DeviceError::CaptureState {
                op: DeviceOp::EndCapture,
                ..
            }
        ));
    }

    #[test]
    fn other_codes_keep_code_and_name() {
        let err = map(DeviceOp::Copy, CUresult::CUDA_ERROR_INVALID_VALUE, 0);
        assert_eq!(
            err,
            DeviceError::Driver {
                op: DeviceOp::Copy,
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE"
            }
        );
        assert!(!is_capture_error(CUresult::CUDA_ERROR_INVALID_VALUE));
        // Interned: the same code gives the same static string.
        let a = error_name(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        let b = error_name(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(a, "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(std::ptr::eq(a, b));
    }
}
