//! Skipping a multi-GPU test on a machine with fewer GPUs: the decision, as a pure function,
//! and the check that prints it.

use graft_cuda::CudaDevice;

/// Why a test that needs `needed` CUDA GPUs cannot run where `found` are present, or `None`
/// when it can (`found >= needed`: a machine with enough GPUs never skips).
fn missing_gpus(needed: usize, found: usize) -> Option<String> {
    (found < needed).then(|| format!("skipped: needs {needed} CUDA GPUs, found {found}"))
}

/// Whether a test that needs `needed` CUDA GPUs must be skipped on this machine: when it has
/// fewer, prints [`missing_gpus`]'s message to stderr and returns `true`; the test then returns
/// without running, so the GPU suite stays green on a one-GPU machine.
///
/// # Panics
/// If the driver cannot count the GPUs (no driver, or it fails): that is no reason to skip,
/// and every other GPU test fails on such a machine too.
pub fn skip_without_cuda_gpus(needed: usize) -> bool {
    let found = CudaDevice::device_count()
        .unwrap_or_else(|e| panic!("the CUDA GPUs cannot be counted: {e}"));
    match missing_gpus(needed, found) {
        Some(why) => {
            eprintln!("{why}");
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_gpus_than_needed_skip_with_the_counts() {
        assert_eq!(
            missing_gpus(2, 1).as_deref(),
            Some("skipped: needs 2 CUDA GPUs, found 1")
        );
        assert_eq!(
            missing_gpus(2, 0).as_deref(),
            Some("skipped: needs 2 CUDA GPUs, found 0")
        );
    }

    #[test]
    fn enough_gpus_never_skip() {
        for found in [2, 3, 8] {
            assert_eq!(missing_gpus(2, found), None, "{found} GPUs");
        }
        assert_eq!(missing_gpus(1, 1), None);
    }
}
