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
                aliases: Box::new([]),
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

    fn plan_sig(&self, phase: Phase, backward_pending: bool, sig: usize, addr: DevicePtr) -> Plan {
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
