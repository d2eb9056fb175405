//! `StickyError`, the per-device slot for errors that happen in a `Drop` and wait for the next fallible call.

use super::error::DeviceError;

/// The sticky per-device error slot: `Drop` impls, which cannot return errors, put them here,
/// and the next fallible call on the device returns the first one. Backends embed one.
#[derive(Debug, Default)]
pub struct StickyError(std::sync::Mutex<Option<DeviceError>>);

impl StickyError {
    /// Records `err` unless an earlier error is still waiting to be taken.
    pub fn record(&self, err: DeviceError) {
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        slot.get_or_insert(err);
    }

    /// Takes the waiting error, if any.
    pub fn take(&self) -> Option<DeviceError> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}
