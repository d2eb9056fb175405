//! The decision of a call, as a pure function of the tree, the path and the call's signature.
//!
//! [`plan`] reads a [`View`] of the runtime (no device, nothing mutable) and returns a
//! [`Plan`]; the executor in `graft.rs` carries it out as it is, the graph budget's
//! decision included (`admit.rs`). The order of the rules is the call algorithm of
//! docs/architecture.md.

use crate::admit::{Room, room};
use crate::config::Mode;
use crate::device::DevicePtr;
use crate::error::FunctionId;
use crate::lifecycle::Phase;
use crate::reason::{EagerReason, EvictReason, RecordReason, WarmupReason};
use crate::signature::call_hash;
use crate::tree::{InputSlot, NodeKey, key_of};
use crate::view::View;

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
    /// Evict `evicts` (in order, each with the nodes under it), then capture the body under
    /// `parent` (a root when none). The first evicted node of the function, if any, lends
    /// its graph for the recording to update in place.
    Record {
        parent: Option<NodeKey>,
        reason: RecordReason,
        evicts: Vec<(NodeKey, EvictReason)>,
    },
    /// A recording was due (for `reason`, under `parent`) but the graph budget refuses it:
    /// evict `evicts` all the same (the node the recording would replace, graphs evicted
    /// before the refusal), then run the body eagerly outside the graph pool, this time.
    OverBudget {
        parent: Option<NodeKey>,
        reason: RecordReason,
        evicts: Vec<(NodeKey, EvictReason)>,
        why: EagerReason,
    },
    /// Run the body eagerly outside the graph pool. `new_fallback`: the (parent, function)
    /// pair falls back for good from now on (the re-record limit was just exceeded).
    Eager {
        reason: EagerReason,
        new_fallback: bool,
    },
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
    // start a new generation, unless a `Forward`'s backward is pending. So may a `Forward`
    // function wherever it was first called: with no backward pending it begins a training
    // step, as a PyTorch forward starts a generation unless backwards are pending.
    let due = f.root_level || f.spec.mode == Mode::Forward;
    let may_start = due && !view.backward_pending;
    let blocked = due && view.backward_pending;
    // The loop rule: an inference call that repeats an earlier call of this generation (the
    // same function, signature and static inputs) begins the next step where the path cannot
    // continue, as each new top-level call does in PyTorch's trees: a decode loop after a
    // prefill needs no marks. Calls on other static inputs (a block called per layer with its
    // layer's weights) continue the path.
    let loops = |tip| {
        !due && !view.backward_pending
            && f.spec.mode == Mode::Inference
            && repeats(view, tip, function, sig, addrs)
    };
    let needed = f.spec.warmups.unwrap_or(view.config.warmups);
    let warmed = s.warmups_done >= needed;
    let (mut new_generation, mut tip) = match view.phase {
        Phase::Warmup if may_start || loops(None) => (true, None),
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
    // The path cannot continue here: a root-level function starts the next generation (a
    // plain loop needs no `mark_step_begin`), and so does a call that repeats an earlier one.
    if tip.is_some() && (may_start || loops(tip)) {
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
    if let Some(reason) = view.policy.eager_pair(tip, function) {
        let action = Action::Eager {
            reason: reason.clone(),
            new_fallback: false,
        };
        return plan(new_generation, blocked, action);
    }
    if reason.is_unexpected() {
        let limit = f.spec.rerecord_limit.unwrap_or(view.config.rerecord_limit);
        let count = view.policy.rerecords(tip, function);
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
    plan(
        new_generation,
        blocked,
        record(view, function, sig, tip, reason, addrs),
    )
}

/// Whether a call of `function` with signature `sig` and inputs at `addrs` repeats an earlier
/// call of `function` in this generation: the same signature and the same static inputs. With
/// a `tip`, the earlier calls are the nodes of `function` on the path to it; while the path
/// warms up, the function's warmups of this generation.
fn repeats<G, M>(
    view: &View<'_, G, M>,
    tip: Option<NodeKey>,
    function: FunctionId,
    sig: usize,
    addrs: &[DevicePtr],
) -> bool {
    let f = &view.functions[function];
    let Some(tip) = tip else {
        return f.warmed.holds(view.generation, call_hash(f, sig, addrs));
    };
    let statics = &f.spec.static_inputs;
    let mut at = Some(tip);
    while let Some(key) = at {
        let node = &view.tree[key];
        if node.function == function
            && node.sig == sig
            && statics
                .iter()
                .all(|&p| node.inputs.get(p).map(InputSlot::recorded_at) == addrs.get(p).copied())
        {
            return true;
        }
        at = view.tree.parent(key);
    }
    false
}

/// A recording under `parent` for `reason`, as the graph budget has room for it (see
/// [`room`]): a new signature here must earn its place; a re-recording of a graph that is
/// here takes one.
fn record<G, M>(
    view: &View<'_, G, M>,
    function: FunctionId,
    sig: usize,
    parent: Option<NodeKey>,
    reason: RecordReason,
    addrs: &[DevicePtr],
) -> Action {
    let replaces = replaced(view, function, sig, parent, &reason, addrs);
    let admission = matches!(
        reason,
        RecordReason::FirstRecording | RecordReason::NewSignature
    );
    let Room { evicts, refused } = room(view, function, sig, parent, replaces, admission);
    match refused {
        None => Action::Record {
            parent,
            reason,
            evicts,
        },
        Some(why) => Action::OverBudget {
            parent,
            reason,
            evicts,
            why,
        },
    }
}

/// With [`Config::replace_moved_static`](crate::Config::replace_moved_static), the node a
/// re-recording for a moved static input replaces: the candidate that failed for that reason.
fn replaced<G, M>(
    view: &View<'_, G, M>,
    function: FunctionId,
    sig: usize,
    parent: Option<NodeKey>,
    reason: &RecordReason,
    addrs: &[DevicePtr],
) -> Option<NodeKey> {
    let moved = matches!(reason, RecordReason::StaticAddressChanged { .. });
    if !view.config.replace_moved_static || !moved {
        return None;
    }
    let tree = view.tree;
    tree.candidates(parent, function, sig)
        .iter()
        .copied()
        .find(|&k| tree.check(k, addrs).err().as_ref() == Some(reason))
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
    use crate::config::{Config, FunctionSpec};
    use crate::policy::Policy;
    use crate::signature::{Functions, Signature};
    use crate::tree::{InputSlot, Node, Tree};

    struct World {
        config: Config,
        functions: Functions,
        tree: Tree<(), ()>,
        policy: Policy,
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
            policy: Policy::new(0),
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
                    guard: crate::guard::Guard::Off,
                    allocated: Box::new([]),
                    last_used: 0,
                    retired: None,
                    recorded_generation: 1,
                    reason: RecordReason::FirstRecording,
                    summary: Default::default(),
                },
            )
        }

        /// A root node of `F` and a child of it, with the phase at the child.
        fn two_deep(&mut self) -> (NodeKey, NodeKey, Phase) {
            let root = self.node(None, ADDR);
            let child = self.node(Some(root), ADDR);
            (root, child, Phase::Replaying { tip: child.id() })
        }

        fn plan(&self, phase: Phase, backward_pending: bool, addr: DevicePtr) -> Plan {
            self.plan_sig(phase, backward_pending, 0, addr)
        }

        fn plan_sig(
            &self,
            phase: Phase,
            backward_pending: bool,
            sig: usize,
            addr: DevicePtr,
        ) -> Plan {
            let view = View {
                phase,
                config: &self.config,
                functions: &self.functions,
                tree: &self.tree,
                policy: &self.policy,
                backward_pending,
                generation: 1,
                replays: 0,
            };
            plan(&view, F, sig, &[addr])
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
                reason: RecordReason::FirstRecording,
                evicts: Vec::new(),
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
                reason: RecordReason::FirstRecording,
                evicts: Vec::new(),
            }
        );
    }

    #[test]
    fn a_forward_begins_a_step_though_not_root_level() {
        let mut w = world(1);
        w.functions[F].spec.mode = Mode::Forward;
        let (root, _, at_child) = w.two_deep();
        let p = w.plan(at_child, false, ADDR);
        assert!(p.new_generation);
        assert_eq!(p.action, Action::Replay(root));
        let p = w.plan(Phase::Warmup, false, ADDR);
        assert!(p.new_generation);
        // A backward still pending keeps the path going.
        let p = w.plan(at_child, true, ADDR);
        assert!(!p.new_generation && p.backward_blocked);
    }

    #[test]
    fn a_call_that_repeats_one_of_its_generation_begins_a_step() {
        // Not root-level (first called mid-path, as a decode after a prefill), but the call
        // repeats the node at the tip: the loop starts over at the roots.
        let mut w = world(1);
        w.functions[F].spec.static_inputs = vec![0];
        let (root, child, at_child) = w.two_deep();
        let p = w.plan(at_child, false, ADDR);
        assert!(p.new_generation);
        assert_eq!(p.action, Action::Replay(root));
        // On other static inputs (a block called per layer), the path goes on.
        let p = w.plan(at_child, false, MOVED);
        assert!(!p.new_generation);
        assert!(matches!(p.action, Action::Record { parent: Some(c), .. } if c == child));
        // A backward pending keeps the path going.
        let p = w.plan(at_child, true, ADDR);
        assert!(!p.new_generation);
        // So does a training function: its steps follow the pending-backward rule.
        w.functions[F].spec.mode = Mode::Backward;
        assert!(!w.plan(at_child, false, ADDR).new_generation);
    }

    #[test]
    fn a_warming_path_ends_at_a_repeated_warmup() {
        let mut w = world(1);
        w.functions[F].spec.static_inputs = vec![0];
        let p = w.plan(Phase::Warmup, false, ADDR);
        assert_eq!(p.action, Action::Warmup(WarmupReason::PathWarmingUp));
        let call = call_hash(&w.functions[F], 0, &[ADDR]);
        w.functions[F].warmed.note(1, call);
        let p = w.plan(Phase::Warmup, false, ADDR);
        assert!(p.new_generation);
        // A warmup of an earlier generation, or on other static inputs, is no repeat.
        assert!(!w.plan(Phase::Warmup, false, MOVED).new_generation);
        w.functions[F].warmed.note(0, call);
        assert!(!w.plan(Phase::Warmup, false, ADDR).new_generation);
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
                reason: miss.clone(),
                evicts: Vec::new(),
            }
        );
        let limit = w.config.rerecord_limit;
        for _ in 0..limit {
            w.policy.count_rerecord(None, F);
        }
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

    /// The static input moved from `ADDR`: the miss a call at `MOVED` records for.
    const MOVED: DevicePtr = DevicePtr(0x2000);
    const MISS: RecordReason = RecordReason::StaticAddressChanged {
        position: 0,
        recorded: ADDR,
        now: MOVED,
    };

    #[test]
    fn a_full_budget_evicts_the_least_used_graph_first() {
        let mut w = world(1);
        w.config.max_graphs = Some(1);
        let old = w.node(None, ADDR);
        assert_eq!(
            w.plan(Phase::Idle, false, MOVED).action,
            Action::Record {
                parent: None,
                reason: MISS,
                evicts: vec![(old, EvictReason::Budget { limit: 1 })],
            }
        );
    }

    #[test]
    fn a_moved_static_input_replaces_its_graph() {
        let mut w = world(1);
        w.config.replace_moved_static = true;
        let old = w.node(None, ADDR);
        assert_eq!(
            w.plan(Phase::Idle, false, MOVED).action,
            Action::Record {
                parent: None,
                reason: MISS,
                evicts: vec![(old, EvictReason::Replaced)],
            }
        );
    }

    #[test]
    fn a_budget_of_path_nodes_only_runs_eagerly() {
        let mut w = world(1);
        w.config.max_graphs = Some(1);
        // The second call is on other static inputs (a block's next layer): it continues the
        // path, and the only graph is on that path.
        w.functions[F].spec.static_inputs = vec![0];
        let root = w.node(None, ADDR);
        let at_root = Phase::Replaying { tip: root.id() };
        assert_eq!(
            w.plan(at_root, false, MOVED).action,
            Action::OverBudget {
                parent: Some(root),
                reason: RecordReason::FirstRecording,
                evicts: Vec::new(),
                why: EagerReason::GraphBudget { limit: 1 },
            }
        );
    }

    #[test]
    fn a_new_signature_used_less_than_the_resident_graph_is_not_admitted() {
        let mut w = world(1);
        w.config.max_graphs = Some(1);
        let mut other = Signature::new(vec![8].into(), Box::new([]), None);
        other.warmups_done = 1;
        w.functions[F].sigs.push(other);
        let resident = w.node(None, ADDR);
        w.tree[resident].replays = 10;
        assert_eq!(
            w.plan_sig(Phase::Idle, false, 1, ADDR).action,
            Action::OverBudget {
                parent: None,
                reason: RecordReason::NewSignature,
                evicts: Vec::new(),
                why: EagerReason::NotAdmitted {
                    limit: 1,
                    uses: 1,
                    resident: 10,
                },
            }
        );
        // One call is no margin over an unused graph; two calls are.
        w.tree[resident].replays = 0;
        assert!(matches!(
            w.plan_sig(Phase::Idle, false, 1, ADDR).action,
            Action::OverBudget { .. }
        ));
        w.functions[F].touch(1);
        assert_eq!(
            w.plan_sig(Phase::Idle, false, 1, ADDR).action,
            Action::Record {
                parent: None,
                reason: RecordReason::NewSignature,
                evicts: vec![(resident, EvictReason::Budget { limit: 1 })],
            }
        );
    }

    #[test]
    fn an_eager_signature_runs_eagerly() {
        let mut w = world(1);
        w.functions[F].sigs[0].eager = Some(EagerReason::Registered);
        assert_eq!(
            w.plan(Phase::Idle, false, ADDR).action,
            Action::Eager {
                reason: EagerReason::Registered,
                new_fallback: false
            }
        );
    }

    #[test]
    fn a_place_that_fell_back_runs_eagerly_on_a_miss() {
        let mut w = world(1);
        w.node(None, ADDR);
        let why = EagerReason::RerecordLimit {
            limit: 1,
            last: MISS,
        };
        w.policy.fall_back(None, F, why.clone());
        assert_eq!(
            w.plan(Phase::Idle, false, MOVED).action,
            Action::Eager {
                reason: why,
                new_fallback: false
            }
        );
        // A hit still replays.
        assert!(matches!(
            w.plan(Phase::Idle, false, ADDR).action,
            Action::Replay(_)
        ));
    }
}
