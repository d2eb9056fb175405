//! The capture lifecycle: where the path stands, and the one function that moves it.

use crate::node_id::NodeId;

/// Where the path of the current generation stands. Owned by the runtime and moved only by
/// `transition`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Phase {
    /// Nothing has run in this generation: the next call starts at the roots.
    Idle,
    /// A call of this generation warmed up; the rest of the generation runs eagerly in the
    /// graph pool.
    Warmup,
    /// A body is being captured, to become a child of `parent` (a root when none).
    Recording {
        /// The node the recording attaches under.
        parent: Option<NodeId>,
    },
    /// The path is on the tree: `tip` is the node recorded or replayed last.
    Replaying {
        /// The node recorded or replayed last.
        tip: NodeId,
    },
}

impl Phase {
    /// The node the path stands at: the tip, or the parent a recording attaches under.
    pub fn tip(self) -> Option<NodeId> {
        match self {
            Phase::Replaying { tip } => Some(tip),
            Phase::Recording { parent } => parent,
            Phase::Idle | Phase::Warmup => None,
        }
    }
}

/// A move the lifecycle does not have (a bug in graft): the runtime returns it as
/// `CallError::State`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Refused {
    /// Where the path stood (and still stands).
    pub(crate) from: Phase,
    /// Where it was asked to move.
    pub(crate) to: Phase,
}

/// Moves `phase` to `to`, refusing moves the lifecycle does not have and leaving `phase`
/// untouched then. The lifecycle:
///
/// - a recording begins from `Idle` or `Replaying` (after a warmup, addresses differ from any
///   recording, so the rest of the generation warms up too) and ends in `Replaying` at the new
///   node, or, when it fails, back where it began;
/// - a warmup can follow anything but a recording;
/// - a replay can follow anything but a warmup;
/// - `Idle` (a new generation) can follow anything.
pub(crate) fn transition(phase: &mut Phase, to: Phase) -> Result<(), Refused> {
    let allowed = match (*phase, to) {
        (_, Phase::Idle) => true,
        (Phase::Recording { .. }, Phase::Recording { .. } | Phase::Warmup) => false,
        (Phase::Warmup, Phase::Recording { .. } | Phase::Replaying { .. }) => false,
        _ => true,
    };
    if allowed {
        *phase = to;
        Ok(())
    } else {
        Err(Refused { from: *phase, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_moves_leave_the_phase_untouched() {
        let tip = NodeId(7);
        let cases = [
            (Phase::Recording { parent: None }, Phase::Warmup),
            (
                Phase::Recording { parent: None },
                Phase::Recording { parent: None },
            ),
            (Phase::Warmup, Phase::Replaying { tip }),
            (Phase::Warmup, Phase::Recording { parent: Some(tip) }),
        ];
        for (from, to) in cases {
            let mut phase = from;
            assert_eq!(transition(&mut phase, to), Err(Refused { from, to }));
            assert_eq!(phase, from);
        }
    }

    #[test]
    fn the_lifecycle_moves() {
        let tip = NodeId(3);
        let mut phase = Phase::Idle;
        for to in [
            Phase::Recording { parent: None },
            Phase::Replaying { tip },
            Phase::Recording { parent: Some(tip) },
            Phase::Replaying { tip },
            Phase::Replaying { tip },
            Phase::Warmup,
            Phase::Warmup,
            Phase::Idle,
        ] {
            transition(&mut phase, to).unwrap();
            assert_eq!(phase, to);
        }
    }
}
