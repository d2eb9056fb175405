//! The decision of a call, as a pure function of the tree, the path and the call's signature.
//!
//! [`plan`] reads a [`View`] of the runtime (no device, nothing mutable) and returns a
//! [`Plan`]; the executor in `graft.rs` carries it out. The order of the rules is the call
//! algorithm of docs/architecture.md.

use std::collections::HashMap;

use slotmap::SlotMap;

use crate::buffer::Buffer;
use crate::config::Config;
use crate::device::DevicePtr;
use crate::error::FunctionId;
use crate::graft::Function;
use crate::lifecycle::Phase;
use crate::reason::{EagerReason, RecordReason, WarmupReason};
use crate::tree::{self, Node, NodeKey, key_of};

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
    pub(crate) functions: &'a [Function],
    pub(crate) nodes: &'a SlotMap<NodeKey, Node<G, M>>,
    pub(crate) roots: &'a [Vec<NodeKey>],
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
    let f = &view.functions[function.0];
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
    let candidates = match tip {
        Some(t) => view.nodes[t].children_of(function),
        None => &view.roots[function.0],
    };
    let mut first_miss = None;
    for &key in candidates {
        let node = &view.nodes[key];
        if node.sig != sig {
            continue;
        }
        match tree::check(view.nodes, node, addrs) {
            Ok(()) => return Ok(key),
            Err(reason) => {
                first_miss.get_or_insert(reason);
            }
        }
    }
    Err(Some(first_miss.unwrap_or(if candidates.is_empty() {
        RecordReason::FirstRecording
    } else {
        RecordReason::NewSignature
    })))
}

/// Whether `inputs` match a signature: sizes and keys.
#[inline]
pub(crate) fn matches(sizes: &[usize], sig_keys: &[u64], inputs: &[&Buffer], keys: &[u64]) -> bool {
    // Element loops, not slice equality: that calls memcmp, which costs more than the
    // handful of integers compared here.
    sig_keys.len() == keys.len()
        && sig_keys.iter().zip(keys).all(|(a, b)| a == b)
        && sizes.len() == inputs.len()
        && sizes.iter().zip(inputs).all(|(&s, b)| s == b.len())
}
