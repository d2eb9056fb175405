//! The decision of a call, as a pure function of the tree, the path and the call's signature.
//!
//! [`plan`] reads a [`View`] of the runtime (no device, nothing mutable) and returns a
//! [`Plan`]; the executor in `graft.rs` carries it out. The order of the rules is the call
//! algorithm of docs/architecture.md.

use std::collections::HashMap;

use crate::config::Config;
use crate::device::DevicePtr;
use crate::error::FunctionId;
use crate::lifecycle::Phase;
use crate::reason::{EagerReason, RecordReason, WarmupReason};
use crate::signature::Functions;
use crate::tree::{NodeKey, Tree, key_of};

/// What a call will do.
#[derive(Clone, PartialEq, Debug)]
pub(crate) struct Plan {
    /// End the path and start a new generation first.
    pub(crate) new_generation: bool,
    /// A new generation was due but a `Forward`'s backward is pending (warn once).
    pub(crate) backward_blocked: bool,
    pub(crate) action: Action,
}

#[derive(Clone, PartialEq, Debug)]
pub(crate) enum Action {
    /// Replay this node.
    Replay(NodeKey),
    /// Run the body eagerly from the graph pool.
    Warmup(WarmupReason),
    /// Capture the body under `parent` (a root when none).
    Record {
        parent: Option<NodeKey>,
        reason: RecordReason,
    },
    /// Run the body eagerly outside the graph pool. `new_fallback`: the (parent, function)
    /// pair falls back for good from now on (the re-record limit was just exceeded).
    Eager {
        reason: EagerReason,
        new_fallback: bool,
    },
}

/// What the planner may read.
pub(crate) struct View<'a, G, M> {
    pub(crate) phase: Phase,
    pub(crate) config: &'a Config,
    pub(crate) functions: &'a Functions,
    pub(crate) tree: &'a Tree<G, M>,
    pub(crate) backward_pending: bool,
    pub(crate) eager_pairs: &'a HashMap<(Option<NodeKey>, FunctionId), EagerReason>,
    pub(crate) rerecords: &'a HashMap<(Option<NodeKey>, FunctionId), u32>,
}

/// The decision for a call of `function` with signature `sig` and input addresses `addrs`.
#[inline]
pub(crate) fn plan<G, M>(
    view: &View<'_, G, M>,
    function: FunctionId,
    sig: usize,
    addrs: &[DevicePtr],
) -> Plan {
    let f = &view.functions[function];
    let s = &f.sigs[sig];
    let plan = |new_generation, backward_blocked, action| Plan {
        new_generation,
        backward_blocked,
        action,
    };
    if let Some(reason) = &s.eager {
        let action = Action::Eager {
            reason: reason.clone(),
            new_fallback: false,
        };
        return plan(false, false, action);
    }
    // A root-level function (one that started a generation before) may end the path and
    // start a new generation, unless a `Forward`'s backward is pending.
    let due = f.root_level;
    let may_start = due && !view.backward_pending;
    let blocked = due && view.backward_pending;
    let needed = f.spec.warmups.unwrap_or(view.config.warmups);
    let warmed = s.warmups_done >= needed;
    let (mut new_generation, mut tip) = match view.phase {
        Phase::Warmup if may_start => (true, None),
        Phase::Warmup => {
            let action = Action::Warmup(WarmupReason::PathWarmingUp);
            return plan(false, blocked, action);
        }
        phase => (false, phase.tip().map(key_of)),
    };
    let mut miss = match candidate(view, tip, function, sig, addrs, warmed) {
        Ok(key) => return plan(new_generation, false, Action::Replay(key)),
        Err(miss) => miss,
    };
    // The path cannot continue here: a root-level function starts the next generation (the
    // inference heuristic: a plain loop needs no `mark_step_begin`).
    if tip.is_some() && may_start {
        new_generation = true;
        tip = None;
        miss = match candidate(view, None, function, sig, addrs, warmed) {
            Ok(key) => return plan(true, false, Action::Replay(key)),
            Err(miss) => miss,
        };
    }
    let blocked = blocked && tip.is_some();
    let Some(reason) = miss else {
        let done = s.warmups_done;
        let action = Action::Warmup(WarmupReason::FirstCalls { done, needed });
        return plan(new_generation, blocked, action);
    };
    if let Some(reason) = view.eager_pairs.get(&(tip, function)) {
        let action = Action::Eager {
            reason: reason.clone(),
            new_fallback: false,
        };
        return plan(new_generation, blocked, action);
    }
    if reason.is_unexpected() {
        let limit = f.spec.rerecord_limit.unwrap_or(view.config.rerecord_limit);
        let count = view.rerecords.get(&(tip, function)).copied().unwrap_or(0);
        if count >= limit {
            let reason = EagerReason::RerecordLimit {
                limit,
                last: reason,
            };
            let action = Action::Eager {
                reason,
                new_fallback: true,
            };
            return plan(new_generation, blocked, action);
        }
    }
    let action = Action::Record {
        parent: tip,
        reason,
    };
    plan(new_generation, blocked, action)
}

/// The first node at `tip` (the roots when none) that may replay for this call, or the reason
/// to record instead: `None` while the signature is still warming up, else why the best
/// candidate failed (a new signature when there is none).
#[inline]
pub(crate) fn candidate<G, M>(
    view: &View<'_, G, M>,
    tip: Option<NodeKey>,
    function: FunctionId,
    sig: usize,
    addrs: &[DevicePtr],
    warmed: bool,
) -> Result<NodeKey, Option<RecordReason>> {
    if !warmed {
        return Err(None);
    }
    let mut first_miss = None;
    for &key in view.tree.candidates(tip, function, sig) {
        match view.tree.check(key, addrs) {
            Ok(()) => return Ok(key),
            Err(reason) => {
                first_miss.get_or_insert(reason);
            }
        }
    }
    // No node of this signature here: a first recording, or a new signature when the
    // function has nodes here already (a miss, so the walk is off the fast path).
    Err(Some(first_miss.unwrap_or_else(|| {
        if view.tree.has_function_at(tip, function) {
            RecordReason::NewSignature
        } else {
            RecordReason::FirstRecording
        }
    })))
}

#[cfg(test)]
mod tests {
    //! The planner without a device: a tree of nodes with `()` graphs.

    use super::*;
    use crate::config::FunctionSpec;
    use crate::signature::Signature;
    use crate::tree::{InputSlot, Node};

    struct World {
        config: Config,
        functions: Functions,
        tree: Tree<(), ()>,
        eager_pairs: HashMap<(Option<NodeKey>, FunctionId), EagerReason>,
        rerecords: HashMap<(Option<NodeKey>, FunctionId), u32>,
    }

    const F: FunctionId = FunctionId(0);
    const ADDR: DevicePtr = DevicePtr(0x1000);

    /// One function with one signature (one static input at `ADDR`), warmed up `warmups` times.
    fn world(warmups: u32) -> World {
        let mut functions = Functions::default();
        let mut tree = Tree::default();
        tree.add_function();
        functions.register("f", FunctionSpec::default());
        let mut sig = Signature::new(vec![4].into(), Box::new([]), None);
        sig.warmups_done = warmups;
        functions[F].sigs.push(sig);
        World {
            config: Config::default(),
            functions,
            tree,
            eager_pairs: HashMap::new(),
            rerecords: HashMap::new(),
        }
    }

    impl World {
        /// A node of `F` recorded with its static input at `addr`, under `parent`.
        fn node(&mut self, parent: Option<NodeKey>, addr: DevicePtr) -> NodeKey {
            self.tree.insert(
                parent,
                Node {
                    function: F,
                    sig: 0,
                    graph: (),
                    inputs: vec![InputSlot::Static { addr }].into(),
                    copied: Box::new([]),
                    in_place: Box::new([]),
                    fixed: Box::new([addr.0]),
                    delivers: false,
                    expected_dead: Box::new([]),
                    outputs: Vec::new(),
                    footprint: Box::new([]),
                    replays: 0,
                    uses: Default::default(),
                    last_used: 0,
                    retired: None,
                    recorded_generation: 1,
                    reason: RecordReason::FirstRecording,
                    summary: Default::default(),
                },
            )
        }

        fn plan(&self, phase: Phase, backward_pending: bool, addr: DevicePtr) -> Plan {
            let view = View {
                phase,
                config: &self.config,
                functions: &self.functions,
                tree: &self.tree,
                backward_pending,
                eager_pairs: &self.eager_pairs,
                rerecords: &self.rerecords,
            };
            plan(&view, F, 0, &[addr])
        }
    }

    #[test]
    fn a_new_signature_warms_up_then_records_at_the_roots() {
        let w = world(0);
        let p = w.plan(Phase::Idle, false, ADDR);
        assert_eq!(
            p.action,
            Action::Warmup(WarmupReason::FirstCalls { done: 0, needed: 1 })
        );
        let w = world(1);
        let p = w.plan(Phase::Idle, false, ADDR);
        assert_eq!(
            p.action,
            Action::Record {
                parent: None,
                reason: RecordReason::FirstRecording
            }
        );
    }

    #[test]
    fn a_matching_child_replays_and_a_dead_end_starts_a_generation() {
        let mut w = world(1);
        w.functions[F].root_level = true;
        let root = w.node(None, ADDR);
        let child = w.node(Some(root), ADDR);
        let at_root = Phase::Replaying { tip: root.id() };
        assert_eq!(w.plan(at_root, false, ADDR).action, Action::Replay(child));
        // At the child, nothing follows: the loop starts over at the roots.
        let at_child = Phase::Replaying { tip: child.id() };
        let p = w.plan(at_child, false, ADDR);
        assert!(p.new_generation);
        assert_eq!(p.action, Action::Replay(root));
        // ...unless a backward is pending: then the path goes on, and says so.
        let p = w.plan(at_child, true, ADDR);
        assert!(!p.new_generation && p.backward_blocked);
        assert_eq!(
            p.action,
            Action::Record {
                parent: Some(child),
                reason: RecordReason::FirstRecording
            }
        );
    }

    #[test]
    fn unexpected_misses_over_the_limit_fall_back_for_good() {
        let mut w = world(1);
        w.node(None, ADDR);
        let moved = DevicePtr(0x2000);
        let miss = RecordReason::StaticAddressChanged {
            position: 0,
            recorded: ADDR,
            now: moved,
        };
        assert_eq!(
            w.plan(Phase::Idle, false, moved).action,
            Action::Record {
                parent: None,
                reason: miss.clone()
            }
        );
        let limit = w.config.rerecord_limit;
        w.rerecords.insert((None, F), limit);
        assert_eq!(
            w.plan(Phase::Idle, false, moved).action,
            Action::Eager {
                reason: EagerReason::RerecordLimit { limit, last: miss },
                new_fallback: true
            }
        );
    }

    #[test]
    fn warmup_is_contagious_within_a_generation() {
        let mut w = world(1);
        w.node(None, ADDR);
        // Not root-level: the rest of the generation warms up.
        let p = w.plan(Phase::Warmup, false, ADDR);
        assert_eq!(p.action, Action::Warmup(WarmupReason::PathWarmingUp));
        // Root-level: it ends the warming path and replays from the roots.
        w.functions[F].root_level = true;
        let p = w.plan(Phase::Warmup, false, ADDR);
        assert!(p.new_generation);
        assert!(matches!(p.action, Action::Replay(_)));
    }
}
