//! Why a step ran eagerly ([`EagerCause`]), and the operations candle cannot perform inside a
//! CUDA graph capture ([`Uncapturable`]; `graphed::classify` recognizes them in candle's
//! errors).

use std::fmt;

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
                "the body freed a tensor made outside the step inside the capture ({error} from cudarc's next call): it replaced state it keeps, such as a kv cache grown with Tensor::cat and stored back; keep such state in tensors allocated once and written in place (graft_candle_models::KvCache)"
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

#[cfg(test)]
mod tests {
    use super::*;

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
