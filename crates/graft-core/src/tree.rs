//! The graph tree: nodes in a slotmap arena, what each recorded, and its invariant check.

use std::collections::HashMap;
use std::sync::Arc;

use slotmap::{Key, KeyData, SlotMap};

use crate::buffer::{Buffer, Cell};
use crate::device::DevicePtr;
use crate::error::FunctionId;
use crate::node_id::NodeId;
use crate::reason::RecordReason;

slotmap::new_key_type! {
    /// Key of a node in the arena.
    pub(crate) struct NodeKey;
}

impl NodeKey {
    pub(crate) fn id(self) -> NodeId {
        NodeId(self.data().as_ffi())
    }
}

/// The arena key of a node id (ids are keys in their FFI form).
pub(crate) fn key_of(id: NodeId) -> NodeKey {
    KeyData::from_ffi(id.0).into()
}

/// Where a node sits for lookups: its parent (none at the roots), function and signature.
pub(crate) type SlotKey = (Option<NodeKey>, FunctionId, usize);

/// The nodes at each (parent, function, signature), in recording order: a call finds its
/// candidates with one hash lookup, however large the tree (a fixed hasher: no per-map seed
/// and no SipHash on the fast path).
pub(crate) type Slots = HashMap<SlotKey, Vec<NodeKey>, foldhash::fast::FixedState>;

/// How a node uses the input at one position.
#[derive(Clone, Copy, Debug)]
pub(crate) enum InputSlot {
    /// Used in place; the address must stay the recorded one.
    Static { addr: DevicePtr },
    /// An output of the path, used in place; the address must stay the recorded one.
    Managed { addr: DevicePtr },
    /// Copied into a placeholder (part of the node's footprint) by a copy node at the start
    /// of the graph. `source` is the address that copy node reads now: a replay re-points it
    /// only when the caller passes a buffer at another address. With `write_back` (the body
    /// writes this input), a copy node at the end of the graph copies the placeholder back to
    /// the caller's buffer, so it is updated as an eager run would update it; the address is
    /// the one that copy node writes now (re-pointed with `source`). With `reads` (copy-free:
    /// the graph only reads this input), the copy node is off and the graph's readers read the
    /// caller's buffer at that address instead (`Device::redirect_reads`); `source` then stays
    /// the copy node's, as it was when the copy was turned off.
    Copied {
        placeholder: DevicePtr,
        len: usize,
        source: DevicePtr,
        write_back: Option<DevicePtr>,
        reads: Option<DevicePtr>,
    },
}

/// What one output of a node hands back.
#[derive(Debug)]
pub(crate) enum OutputSlot {
    /// Memory the graph writes, tracked for liveness. `cell` is the latest handed-out cell;
    /// `spares` are earlier cells, invalidated, kept for reuse once their holders drop them.
    Tracked {
        cell: Arc<Cell>,
        spares: Vec<Arc<Cell>>,
    },
    /// The output is the static input at this position: handed back as that input.
    StaticInput(usize),
    /// The output shares storage with an earlier output.
    Alias(usize),
    /// A zero-length output: not tracked.
    Empty(Arc<Cell>),
}

#[derive(Debug)]
pub(crate) struct NodeOutput<M> {
    pub(crate) slot: OutputSlot,
    pub(crate) meta: M,
}

/// One recorded graph and everything needed to decide whether it may replay.
#[derive(Debug)]
pub(crate) struct Node<G, M> {
    pub(crate) function: FunctionId,
    pub(crate) sig: usize,
    pub(crate) parent: Option<NodeKey>,
    /// Children in recording order (for walks; lookups go through [`Slots`]).
    pub(crate) children: Vec<NodeKey>,
    pub(crate) graph: G,
    pub(crate) inputs: Box<[InputSlot]>,
    /// Positions of the copied inputs (non-empty ones), so that checks and re-pointing skip
    /// the static and managed ones.
    pub(crate) copied: Box<[usize]>,
    /// Per input, the address a static or managed input must have ([`ANY_ADDRESS`] for a
    /// copied one): the fast path's check, dense.
    pub(crate) fixed: Box<[u64]>,
    /// Output slots of ancestors that were dead when this node was recorded.
    pub(crate) expected_dead: Box<[(NodeKey, u16)]>,
    pub(crate) outputs: Vec<NodeOutput<M>>,
    /// Sorted, disjoint `[start, end)` ranges this node's graph writes.
    pub(crate) footprint: Box<[(u64, u64)]>,
    pub(crate) replays: u64,
    /// When the node last replayed or was recorded ([`crate::Graft`]'s clock): the graph
    /// budget evicts the smallest first.
    pub(crate) last_used: u64,
    /// Set when the recording found that the body writes the copied input at this position
    /// and the graph does not copy it back: the node never replays.
    pub(crate) retired: Option<usize>,
    pub(crate) recorded_generation: u64,
    pub(crate) reason: RecordReason,
    pub(crate) summary: crate::device::GraphSummary,
}

impl<G, M> Node<G, M> {
    /// Whether `[start, end)` overlaps this node's footprint.
    pub(crate) fn footprint_overlaps(&self, start: u64, end: u64) -> bool {
        overlaps(&self.footprint, start, end)
    }

    /// Bytes of device memory this node's graph writes.
    pub(crate) fn footprint_bytes(&self) -> u64 {
        self.footprint.iter().map(|(s, e)| e - s).sum()
    }
}

/// Links the node at `key` into its parent's children (or the roots) and the lookup index.
pub(crate) fn link<G, M>(
    nodes: &mut SlotMap<NodeKey, Node<G, M>>,
    roots: &mut [Vec<NodeKey>],
    slots: &mut Slots,
    key: NodeKey,
) {
    let node = &nodes[key];
    let (parent, function, sig) = (node.parent, node.function, node.sig);
    slots.entry((parent, function, sig)).or_default().push(key);
    match parent {
        Some(p) => nodes[p].children.push(key),
        None => roots[function.0].push(key),
    }
}

/// In [`Node::fixed`]: any address will do (a copied input). No device address is `u64::MAX`.
pub(crate) const ANY_ADDRESS: u64 = u64::MAX;

/// [`Node::fixed`] for these slots.
pub(crate) fn fixed_addresses(slots: &[InputSlot]) -> Box<[u64]> {
    slots
        .iter()
        .map(|s| match *s {
            InputSlot::Static { addr } | InputSlot::Managed { addr } => addr.0,
            InputSlot::Copied { .. } => ANY_ADDRESS,
        })
        .collect()
}

/// The positions of the non-empty copied inputs among `slots`.
pub(crate) fn copied_positions(slots: &[InputSlot]) -> Box<[usize]> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, InputSlot::Copied { len, .. } if *len > 0))
        .map(|(i, _)| i)
        .collect()
}

/// Checks the replay invariants of `node` for these inputs (see [`check_each`]): one pass
/// over the inputs when they all hold, the ordered checks only to name a failure.
#[inline]
pub(crate) fn check<G, M>(
    nodes: &SlotMap<NodeKey, Node<G, M>>,
    node: &Node<G, M>,
    addrs: &[DevicePtr],
) -> Result<(), RecordReason> {
    if holds(nodes, node, addrs) {
        return Ok(());
    }
    check_each(nodes, node, addrs)
}

/// Whether every replay invariant holds: static and managed addresses in one pass, the
/// outputs expected dead, then the copied inputs alone.
#[inline]
fn holds<G, M>(
    nodes: &SlotMap<NodeKey, Node<G, M>>,
    node: &Node<G, M>,
    addrs: &[DevicePtr],
) -> bool {
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
        if let Some(anc) = nodes.get(key)
            && let OutputSlot::Tracked { cell, .. } = &anc.outputs[output as usize].slot
            && cell.is_held()
        {
            return false;
        }
    }
    node.copied.is_empty() || copied_hold(node, addrs)
}

/// The copied-input invariants of [`check_each`], over the copied inputs only.
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
        if overlaps_placeholder || (write_back.is_some() && node.footprint_overlaps(s, e)) {
            return false;
        }
    }
    true
}

/// Checks the replay invariants of `node` for these inputs, cheapest first: managed input
/// addresses, outputs expected dead, static input addresses, then copied inputs against the
/// placeholders written before them. No allocation, no formatting: a failure returns plain data.
fn check_each<G, M>(
    nodes: &SlotMap<NodeKey, Node<G, M>>,
    node: &Node<G, M>,
    addrs: &[DevicePtr],
) -> Result<(), RecordReason> {
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
        if let Some(anc) = nodes.get(key)
            && let OutputSlot::Tracked { cell, .. } = &anc.outputs[output as usize].slot
            && cell.is_held()
        {
            return Err(RecordReason::ExpectedDeadAlive {
                node: key.id(),
                output: output as usize,
            });
        }
    }
    for (position, (slot, &now)) in node.inputs.iter().zip(addrs).enumerate() {
        if let InputSlot::Static { addr } = *slot
            && addr != now
        {
            return Err(RecordReason::StaticAddressChanged {
                position,
                recorded: addr,
                now,
            });
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

/// Whether `[start, end)` overlaps any of `ranges` (sorted and disjoint).
pub(crate) fn overlaps(ranges: &[(u64, u64)], start: u64, end: u64) -> bool {
    let i = ranges.partition_point(|&(_, e)| e <= start);
    ranges.get(i).is_some_and(|&(s, _)| s < end)
}

/// Merges `[start, end)` ranges into sorted, disjoint ranges.
pub(crate) fn merge_ranges(mut ranges: Vec<(u64, u64)>) -> Box<[(u64, u64)]> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out.into_boxed_slice()
}

/// An output handed back by a call: graft's buffer and the framework's metadata for it.
#[derive(Debug, Clone)]
pub struct Output<M> {
    /// The memory.
    pub buffer: Buffer,
    /// Opaque framework metadata (shape, dtype, ...), stored per node and handed back on replay.
    pub meta: M,
}

impl<M> Output<M> {
    /// Pairs a buffer with its metadata.
    pub fn new(buffer: Buffer, meta: M) -> Output<M> {
        Output { buffer, meta }
    }
}
