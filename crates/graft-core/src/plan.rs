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
mod tests;
