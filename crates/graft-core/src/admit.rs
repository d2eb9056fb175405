//! Admission to the graph budget, decided by the planner: which graphs a recording evicts,
//! or why it runs eagerly instead.
//!
//! Every call is counted exactly once, without adding anything to the replay path: a replay
//! by its node's `replays` (which the replay path increments anyway), any other call
//! (warmup, recording, eager run) by its signature's `calls` (`Function::touch`). Both raw
//! counts only grow; [`Uses`](crate::uses::Uses) keeps the aged estimate next to them, and
//! the runtime ages them all together once per
//! [`Config::budget_window`](crate::Config::budget_window) calls, on a call that does not
//! replay (`Policy::count_off_replay`). [`room`] decides with the counts as they will be once
//! the call is counted, so the executor carries its decision out as it is.

use std::collections::HashSet;

use crate::error::FunctionId;
use crate::reason::{EagerReason, EvictReason};
use crate::tree::NodeKey;
use crate::view::View;

/// Whether a signature used `candidate` times (aged) may take the place of a graph used
/// `resident` times: only if it is used clearly more often, by a quarter more and by at least
/// two calls, so that two signatures used about equally never evict each other in turn.
pub(crate) fn admits(candidate: u64, resident: u64) -> bool {
    candidate >= resident + (resident / 4).max(2)
}

/// The graph budget's decision for a recording.
#[derive(Clone, PartialEq, Debug, Default)]
pub(crate) struct Room {
    /// The nodes to evict first, in order (each with every node under it).
    pub(crate) evicts: Vec<(NodeKey, EvictReason)>,
    /// Why the recording runs eagerly instead, after those evictions; `None`: it records.
    pub(crate) refused: Option<EagerReason>,
}

/// Before recording a node of `function` with signature `sig` under `parent`, once
/// `replaces` (the node the recording replaces, if any) is evicted: the least used graphs
/// (ties: the least recently used) to evict until the function's and the tree's budgets have
/// room for one more. Nodes on the path to `parent` are never evicted (the recording
/// continues from them). With `admission` (a new signature at this place), each graph is
/// evicted only if the signature is used clearly more often (see [`admits`]). Refused when
/// only path nodes are left, or the signature is not admitted. The counts are those the
/// call sees once counted: aged if it ends a window, its signature's calls plus one, the
/// calls of the graphs evicted before handed back to their signatures. O(graphs) per evicted
/// graph.
pub(crate) fn room<G, M>(
    view: &View<'_, G, M>,
    function: FunctionId,
    sig: usize,
    parent: Option<NodeKey>,
    replaces: Option<NodeKey>,
    admission: bool,
) -> Room {
    let mut room = Room::default();
    if let Some(k) = replaces {
        room.evicts.push((k, EvictReason::Replaced));
    }
    let per_function = view.functions[function].spec.max_graphs;
    let overall = view.config.max_graphs;
    if per_function.is_none() && overall.is_none() {
        return room;
    }
    let windows = view
        .policy
        .windows_due(view.replays, view.config.budget_window);
    let tree = view.tree;
    // The nodes evicted so far, and the calls they served, handed back to their signatures.
    let mut gone: HashSet<NodeKey> = HashSet::new();
    let mut credit: Vec<((FunctionId, usize), u64)> = Vec::new();
    if let Some(k) = replaces {
        evict(view, k, windows, &mut gone, &mut credit);
    }
    let path = tree.path_nodes(parent);
    loop {
        let sig_uses = |f: FunctionId, s: usize| {
            let own = u64::from((f, s) == (function, sig));
            let handed_back = credit
                .iter()
                .find(|(at, _)| *at == (f, s))
                .map_or(0, |&(_, c)| c);
            view.functions[f].sigs[s].uses_aged(windows) + own + handed_back
        };
        let live = || tree.iter().filter(|(k, _)| !gone.contains(k));
        let of_function = live().filter(|(_, n)| n.function == function).count();
        let over_function = per_function.filter(|&l| of_function >= l);
        let over_all = overall.filter(|&l| tree.len() - gone.len() >= l);
        let Some(limit) = over_all.or(over_function) else {
            return room;
        };
        // Over the overall budget any graph may go; over the function's only its own.
        let victim = live()
            .filter(|(k, n)| !path.contains(k) && (over_all.is_some() || n.function == function))
            .map(|(k, n)| {
                let uses = n.uses.estimate_aged(n.replays, windows) + sig_uses(n.function, n.sig);
                (k, uses, n.last_used)
            })
            .min_by_key(|&(_, uses, last_used)| (uses, last_used));
        let Some((k, resident, _)) = victim else {
            room.refused = Some(EagerReason::GraphBudget { limit });
            return room;
        };
        let uses = sig_uses(function, sig);
        if admission && !admits(uses, resident) {
            room.refused = Some(EagerReason::NotAdmitted {
                limit,
                uses,
                resident,
            });
            return room;
        }
        room.evicts.push((k, EvictReason::Budget { limit }));
        evict(view, k, windows, &mut gone, &mut credit);
    }
}

/// Counts `k` and every node under it as evicted: the calls each served go back to its
/// signature, as `Graft::evict` does.
fn evict<G, M>(
    view: &View<'_, G, M>,
    k: NodeKey,
    windows: u64,
    gone: &mut HashSet<NodeKey>,
    credit: &mut Vec<((FunctionId, usize), u64)>,
) {
    for k in view.tree.subtree(k) {
        let n = &view.tree[k];
        let served = n.uses.estimate_aged(n.replays, windows);
        match credit.iter_mut().find(|(s, _)| *s == (n.function, n.sig)) {
            Some((_, c)) => *c += served,
            None => credit.push(((n.function, n.sig), served)),
        }
        gone.insert(k);
    }
}

#[cfg(test)]
mod tests {
    //! The admission margin, without a runtime (the budget's decisions: `plan.rs`' tests).

    use super::*;

    #[test]
    fn admission_needs_a_margin() {
        assert!(admits(2, 0));
        assert!(!admits(1, 0));
        assert!(!admits(10, 9) && admits(11, 9));
        assert!(!admits(124, 100) && admits(125, 100));
    }
}
