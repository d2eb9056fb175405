//! The group's vote on a recording: how this rank's recording ended (`Local`), what the
//! ranks vote on (`subject`), turning the vote into the group's outcome (`agree`), and
//! undoing a capture the group outvoted (`discard`).

use crate::device::Device;
use crate::error::CallError;
use crate::graft::{Frame, Graft};
use crate::group::{Subject, Verdict, Vote};
use crate::lifecycle::Phase;
use crate::pool::Checkpoint;
use crate::reason::EagerReason;
use crate::signature::shape_hash;

use super::capture::{Captured, Prepared};

/// A capture that succeeded, not yet attached or launched: what the group votes on.
pub(super) struct Pending<G, M> {
    pub(super) prepared: Prepared,
    pub(super) captured: Captured<G, M>,
    pub(super) checkpoint: Checkpoint,
    /// The phase the recording began from.
    pub(super) previous: Phase,
}

/// How this rank's recording ended, before (and after) the group's vote.
pub(super) enum Local<G, M, E> {
    Captured(Pending<G, M>),
    FallBack(EagerReason),
    Failed(CallError<E>),
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// In a group: votes this rank's outcome and turns it into the group's. A rank that
    /// captured but is outvoted discards its capture (the pool and the phase as they were).
    /// Alone: the outcome as it is.
    pub(super) fn agree<F, E>(
        &mut self,
        frame: &Frame<'_, F, M, E>,
        local: Local<D::Graph, M, E>,
    ) -> Local<D::Graph, M, E> {
        let Some(member) = &self.member else {
            return local;
        };
        let vote = match &local {
            Local::Captured(_) => Vote::Recorded,
            Local::FallBack(_) => Vote::FellBack,
            Local::Failed(_) => Vote::Failed,
        };
        let _span = tracing::debug_span!("agree", rank = member.rank()).entered();
        let verdict = member.agree(vote, self.subject(frame));
        self.stats.agreements += 1;
        let function = self.functions[frame.function].name.clone();
        let agreed = match verdict {
            Ok(v) if v.vote == vote => return local,
            Ok(Verdict {
                vote: Vote::FellBack,
                rank,
            }) => Local::FallBack(EagerReason::PeerCaptureFailed { rank }),
            Ok(Verdict { rank, .. }) => Local::Failed(CallError::PeerFailed { function, rank }),
            Err(source) => Local::Failed(CallError::Group { function, source }),
        };
        tracing::debug!(?vote, "outvoted by the group");
        match local {
            Local::Captured(pending) => match self.discard(pending) {
                Ok(()) => agreed,
                Err(e) => Local::Failed(e),
            },
            _ => agreed,
        }
    }

    /// What the group votes this call records: the function and its signature's shape.
    pub(super) fn subject<F, E>(&self, frame: &Frame<'_, F, M, E>) -> Subject {
        let sig = &self.functions[frame.function].sigs[frame.sig];
        (
            frame.function.0,
            shape_hash(sig.sizes.iter().copied(), &sig.keys),
        )
    }

    /// Undoes a capture that will never be attached: phase, pool and graph as before it.
    pub(super) fn discard<E>(&mut self, pending: Pending<D::Graph, M>) -> Result<(), CallError<E>> {
        let Pending {
            prepared,
            captured,
            checkpoint,
            previous,
        } = pending;
        self.move_to(previous)?;
        self.undo_recording(&checkpoint, &prepared.placeholders, &captured.allocs);
        drop(captured);
        Ok(())
    }
}
