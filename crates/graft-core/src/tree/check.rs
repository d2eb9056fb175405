//! The replay invariant check: whether a node may replay for a call's input addresses, and if
//! not, why (one pass when everything holds; the ordered checks only to name a failure).

use super::{ANY_ADDRESS, InputSlot, Node, NodeKey, OutputSlot, Tree};
use crate::device::DevicePtr;
use crate::reason::RecordReason;

impl<G, M> Tree<G, M> {
    /// Checks the replay invariants of the node at `key` for these inputs (see [`Tree::check_each`]): one pass
    /// over the inputs when they all hold, the ordered checks only to name a failure.
    #[inline]
    pub(crate) fn check(&self, key: NodeKey, addrs: &[DevicePtr]) -> Result<(), RecordReason> {
        let node = &self[key];
        if self.holds(node, addrs) {
            return Ok(());
        }
        self.check_each(node, addrs)
    }

    /// Whether every replay invariant holds: static and managed addresses in one pass, the
    /// outputs expected dead, then the copied inputs alone.
    #[inline]
    fn holds(&self, node: &Node<G, M>, addrs: &[DevicePtr]) -> bool {
        if node.retired.is_some() || addrs.len() != node.fixed.len() {
            return false;
        }
        if !node
            .fixed
            .iter()
            .zip(addrs)
            .all(|(&f, a)| f == ANY_ADDRESS || f == a.0)
        {
            return false;
        }
        for &(key, output) in node.expected_dead.iter() {
            if let Some(anc) = self.get(key)
                && let OutputSlot::Tracked { cell, .. } = &anc.outputs[output as usize].slot
                && cell.is_held()
            {
                return false;
            }
        }
        (node.copied.is_empty() || copied_hold(node, addrs))
            && (node.in_place.is_empty() || in_place_hold(node, addrs))
            && node.aliases.iter().all(|&(i, j)| addrs[i] == addrs[j])
    }

    /// Checks the replay invariants of `node` for these inputs, cheapest first: managed input
    /// addresses, outputs expected dead, static input addresses, then copied inputs against the
    /// placeholders written before them. No allocation, no formatting: a failure returns plain data.
    fn check_each(&self, node: &Node<G, M>, addrs: &[DevicePtr]) -> Result<(), RecordReason> {
        if let Some(position) = node.retired {
            return Err(RecordReason::InputMutated { position });
        }
        for (position, (slot, &now)) in node.inputs.iter().zip(addrs).enumerate() {
            if let InputSlot::Managed { addr } = *slot
                && addr != now
            {
                return Err(RecordReason::ManagedAddressChanged {
                    position,
                    recorded: addr,
                    now,
                });
            }
        }
        for &(key, output) in node.expected_dead.iter() {
            if let Some(anc) = self.get(key)
                && let OutputSlot::Tracked { cell, .. } = &anc.outputs[output as usize].slot
                && cell.is_held()
            {
                return Err(RecordReason::ExpectedDeadAlive {
                    node: key.id(),
                    output: output as usize,
                });
            }
        }
        if let Some(&(other, position)) = node.aliases.iter().find(|&&(i, j)| addrs[i] != addrs[j])
        {
            return Err(RecordReason::AliasesParted { position, other });
        }
        for (position, (slot, &now)) in node.inputs.iter().zip(addrs).enumerate() {
            match *slot {
                InputSlot::Static { addr } if addr != now => {
                    return Err(RecordReason::StaticAddressChanged {
                        position,
                        recorded: addr,
                        now,
                    });
                }
                InputSlot::InPlace {
                    recorded,
                    follows: false,
                    overlaps,
                    ..
                } if recorded != now => {
                    return Err(match overlaps {
                        Some(other) => RecordReason::OverlappingInputMoved {
                            position,
                            other,
                            recorded,
                            now,
                        },
                        None => RecordReason::InPlaceInputMoved {
                            position,
                            recorded,
                            now,
                        },
                    });
                }
                InputSlot::InPlace {
                    len, follows: true, ..
                } if node.footprint_overlaps(now.0, now.0 + len as u64) => {
                    return Err(RecordReason::InPlaceInputOverlapsFootprint { position });
                }
                _ => {}
            }
        }
        // The graph starts with the input copies, in input order: a source must not overlap its
        // own placeholder or any placeholder written before it is read. CUDA leaves overlapping
        // copies undefined, so such a candidate cannot replay.
        for (i, (slot, &src)) in node.inputs.iter().zip(addrs).enumerate() {
            let InputSlot::Copied { len, .. } = *slot else {
                continue;
            };
            if len == 0 {
                continue;
            }
            let (s, e) = (src.0, src.0 + len as u64);
            for earlier in &node.inputs[..=i] {
                if let InputSlot::Copied {
                    placeholder: p,
                    len: l,
                    ..
                } = *earlier
                    && p.0 < e
                    && s < p.0 + l as u64
                {
                    return Err(RecordReason::InputOverlapsPlaceholder { position: i });
                }
            }
        }
        // A copied input must not overlap another input recorded apart from it: the copy
        // would hide the body's writes through the other.
        for &i in node.copied.iter() {
            if let InputSlot::Copied { len, .. } = node.inputs[i] {
                let s = addrs[i].0;
                if let Some(other) = overlapped_by(node, addrs, i, s, s + len as u64) {
                    return Err(RecordReason::InputsOverlap { position: i, other });
                }
            }
        }
        // A written input is copied back at the end of the graph: its buffer must not lie in
        // memory the graph writes, or the copy would overwrite the graph's results (or they it).
        for (position, (slot, &src)) in node.inputs.iter().zip(addrs).enumerate() {
            if let InputSlot::Copied {
                len,
                write_back: Some(_),
                ..
            } = *slot
                && node.footprint_overlaps(src.0, src.0 + len as u64)
            {
                return Err(RecordReason::MutatedInputOverlapsFootprint { position });
            }
        }
        Ok(())
    }
}

/// The in-place invariant of [`Tree::check_each`], over the in-place inputs only: a followed
/// input's buffer lies outside the memory the graph writes (its address is in `fixed`
/// otherwise).
fn in_place_hold<G, M>(node: &Node<G, M>, addrs: &[DevicePtr]) -> bool {
    node.in_place.iter().all(|&i| match node.inputs[i] {
        InputSlot::InPlace {
            len, follows: true, ..
        } => !node.footprint_overlaps(addrs[i].0, addrs[i].0 + len as u64),
        _ => true,
    })
}

/// The copied-input invariants of [`Tree::check_each`], over the copied inputs only.
fn copied_hold<G, M>(node: &Node<G, M>, addrs: &[DevicePtr]) -> bool {
    for (k, &i) in node.copied.iter().enumerate() {
        let InputSlot::Copied {
            len, write_back, ..
        } = node.inputs[i]
        else {
            continue;
        };
        let (s, e) = (addrs[i].0, addrs[i].0 + len as u64);
        let overlaps_placeholder = node.copied[..=k].iter().any(|&j| {
            matches!(node.inputs[j], InputSlot::Copied { placeholder: p, len: l, .. } if p.0 < e && s < p.0 + l as u64)
        });
        if overlaps_placeholder
            || (write_back.is_some() && node.footprint_overlaps(s, e))
            || overlapped_by(node, addrs, i, s, e).is_some()
        {
            return false;
        }
    }
    true
}

/// The first copied or in-place input other than `i` whose buffer overlaps `[s, e)` (copied
/// input `i`'s caller buffer) in this call: O(copied + in-place inputs), the inputs that may
/// move between calls.
fn overlapped_by<G, M>(
    node: &Node<G, M>,
    addrs: &[DevicePtr],
    i: usize,
    s: u64,
    e: u64,
) -> Option<usize> {
    // An overlap needs two inputs that move: most nodes have one (the tokens) or none.
    if s == e || node.copied.len() + node.in_place.len() < 2 {
        return None;
    }
    node.copied
        .iter()
        .chain(node.in_place.iter())
        .copied()
        .find(|&j| {
            let len = match node.inputs[j] {
                InputSlot::Copied { len, .. } | InputSlot::InPlace { len, .. } => len as u64,
                _ => 0,
            };
            let at = addrs[j].0;
            j != i && len > 0 && at < e && s < at + len
        })
}
