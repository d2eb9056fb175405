//! [`Refusals`]: per step and signature keys, the operation that made a signature run eagerly,
//! so the outcomes of its later calls name it.

use std::collections::HashMap;

use graft_core::EagerReason;

use crate::refusal::{EagerCause, Uncapturable};

/// The most eager signatures whose refusal is remembered.
const MAX_REFUSALS: usize = 64;

/// The operations that made signatures eager, per step and keys.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    map: HashMap<(usize, Vec<u64>), Uncapturable>,
}

impl Refusals {
    /// Keeps `op` as what made the signature `keys` of `step` eager. At most [`MAX_REFUSALS`]
    /// are kept (a step whose keys change on every call would otherwise grow the map
    /// forever); a signature whose entry was dropped still runs eagerly, with graft-core's
    /// reason.
    pub(crate) fn remember(&mut self, step: usize, keys: &[u64], op: Uncapturable) {
        let key = (step, keys.to_vec());
        if self.map.len() >= MAX_REFUSALS && !self.map.contains_key(&key) {
            let victim = self.map.keys().next().cloned();
            if let Some(victim) = victim {
                self.map.remove(&victim);
            }
        }
        self.map.insert(key, op);
    }

    /// Why graft ran a call of `step` with `keys` eagerly: the candle operation that broke the
    /// capture when graft-core's reason is that failure (`refused_now`, remembered then, or
    /// the one remembered for the signature), else graft-core's reason.
    pub(crate) fn eager_cause(
        &mut self,
        step: usize,
        keys: &[u64],
        reason: EagerReason,
        refused_now: Option<Uncapturable>,
    ) -> EagerCause {
        if !matches!(reason, EagerReason::CaptureFailed { .. }) {
            return EagerCause::Graft(reason);
        }
        if let Some(op) = refused_now {
            self.remember(step, keys, op.clone());
            return EagerCause::Uncapturable(op);
        }
        match self.map.get(&(step, keys.to_vec())) {
            Some(op) => EagerCause::Uncapturable(op.clone()),
            None => EagerCause::Graft(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use graft_core::{CaptureViolation, DeviceOp};

    use super::*;

    fn failed() -> EagerReason {
        EagerReason::CaptureFailed {
            op: DeviceOp::Read,
            violation: CaptureViolation::Unsupported,
        }
    }

    fn read(call: &str) -> Uncapturable {
        Uncapturable::HostRead { call: call.into() }
    }

    #[test]
    fn a_refusal_names_the_later_eager_calls_of_its_signature_only() {
        let mut refusals = Refusals::default();
        let cause = refusals.eager_cause(0, &[8], failed(), Some(read("clone_dtoh")));
        assert_eq!(cause, EagerCause::Uncapturable(read("clone_dtoh")));
        // Later calls of the signature: the remembered operation.
        let cause = refusals.eager_cause(0, &[8], failed(), None);
        assert_eq!(cause, EagerCause::Uncapturable(read("clone_dtoh")));
        // Another signature, another step: graft-core's reason.
        assert_eq!(
            refusals.eager_cause(0, &[16], failed(), None),
            EagerCause::Graft(failed())
        );
        assert_eq!(
            refusals.eager_cause(1, &[8], failed(), None),
            EagerCause::Graft(failed())
        );
        // A reason that is not a capture failure is graft-core's, refusal or not.
        assert_eq!(
            refusals.eager_cause(0, &[8], EagerReason::Registered, Some(read("x"))),
            EagerCause::Graft(EagerReason::Registered)
        );
    }

    #[test]
    fn at_most_max_refusals_are_kept_and_a_known_signature_evicts_nothing() {
        let mut refusals = Refusals::default();
        for key in 0..MAX_REFUSALS as u64 + 10 {
            refusals.remember(0, &[key], read("clone_dtoh"));
            assert!(refusals.map.len() <= MAX_REFUSALS);
        }
        assert_eq!(refusals.map.len(), MAX_REFUSALS);
        let kept: Vec<u64> = refusals.map.keys().map(|(_, k)| k[0]).collect();
        refusals.remember(0, &[kept[0]], read("memcpy_dtoh"));
        assert_eq!(refusals.map.len(), MAX_REFUSALS);
        assert_eq!(
            refusals.map.get(&(0, vec![kept[0]])),
            Some(&read("memcpy_dtoh"))
        );
    }
}
