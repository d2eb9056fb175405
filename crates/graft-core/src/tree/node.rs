//! A node of the tree: what one recording captured (graph, input and output slots, footprint,
//! liveness facts), and the address-range helpers its footprint uses.

use std::sync::Arc;

use super::NodeKey;
use crate::buffer::{Buffer, Cell};
use crate::device::DevicePtr;
use crate::error::FunctionId;
use crate::reason::RecordReason;

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
    /// caller's buffer at that address instead (`Device::redirect`); `source` then stays
    /// the copy node's, as it was when the copy was turned off.
    Copied {
        placeholder: DevicePtr,
        len: usize,
        source: DevicePtr,
        write_back: Option<DevicePtr>,
        reads: Option<DevicePtr>,
    },
    /// Used in place at whatever address the caller passes (`Buffer::mark_in_place`): the body
    /// used the caller's buffer, captured at `recorded`, and the graph's uses of it point at
    /// `at` now. With `follows` (the device could move every use, `Device::redirect`), a
    /// replay points them at the caller's buffer of its call; without, the node replays only
    /// at `recorded`. `overlaps` is an input whose range overlapped this one's at recording
    /// without being an in-place input of the same address and length: such an input is
    /// never followed, nor copied (set with `follows`, after the first launch).
    InPlace {
        recorded: DevicePtr,
        at: DevicePtr,
        len: usize,
        follows: bool,
        overlaps: Option<usize>,
    },
}

impl InputSlot {
    /// The address of the caller's buffer this slot was recorded with.
    pub(crate) fn recorded_at(&self) -> DevicePtr {
        match *self {
            InputSlot::Static { addr } | InputSlot::Managed { addr } => addr,
            InputSlot::Copied { source, .. } => source,
            InputSlot::InPlace { recorded, .. } => recorded,
        }
    }
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
    /// Delivered into memory the caller gives per call (`Graft::call_owned`): a copy at the
    /// end of the graph, with `ends` as last pointed, writes the output's `len` bytes there.
    /// With `after`, the device refused to re-point that copy to the caller's memory (CUDA:
    /// memory mapped another way than the graph's), so the copy keeps writing its
    /// placeholder and graft copies the placeholder to the caller's memory after each launch.
    Delivered {
        ends: crate::device::CopyEnds,
        len: usize,
        after: bool,
    },
}

#[derive(Debug)]
pub(crate) struct NodeOutput<M> {
    pub(crate) slot: OutputSlot,
    pub(crate) meta: M,
}

/// One recorded graph and everything needed to decide whether it may replay. Where it sits
/// (its parent, its children) is the [`super::Tree`]'s to know.
#[derive(Debug)]
pub(crate) struct Node<G, M> {
    pub(crate) function: FunctionId,
    pub(crate) sig: usize,
    pub(crate) graph: G,
    pub(crate) inputs: Box<[InputSlot]>,
    /// Positions of the copied inputs (non-empty ones), so that checks and re-pointing skip
    /// the static and managed ones.
    pub(crate) copied: Box<[usize]>,
    /// Positions of the in-place inputs (non-empty ones), for the same reason.
    pub(crate) in_place: Box<[usize]>,
    /// Pairs `(earlier, later)` of followed in-place inputs recorded as one buffer (the same
    /// address and length): a replay needs them at one address again, as the graph's uses of
    /// the buffer could be either's. Empty for almost every node.
    pub(crate) aliases: Box<[(usize, usize)]>,
    /// Per input, the address a static, managed or unfollowed in-place input must have
    /// ([`ANY_ADDRESS`] for the others): the fast path's check, dense.
    pub(crate) fixed: Box<[u64]>,
    /// The outputs go into memory the caller gives per call (`Graft::call_owned`).
    pub(crate) delivers: bool,
    /// Output slots of ancestors that were dead when this node was recorded.
    pub(crate) expected_dead: Box<[(NodeKey, u16)]>,
    pub(crate) outputs: Vec<NodeOutput<M>>,
    /// Sorted, disjoint `[start, end)` ranges this node's graph writes.
    pub(crate) footprint: Box<[(u64, u64)]>,
    /// Replays: the raw count of [`Node::uses`], the only thing the replay path counts for
    /// the graph budget.
    pub(crate) replays: u64,
    /// How often it replayed recently, aged (see `admit.rs`): of the graphs the budget may
    /// evict, the least used goes first.
    pub(crate) uses: crate::uses::Uses,
    /// When its calls are guarded (see `guard.rs`).
    pub(crate) guard: crate::guard::Guard,
    /// What the recording allocated, in order (the body's allocations, then the copied
    /// inputs' placeholders): a guard's new capture allocates the same sequence, and an
    /// address inside the i-th range is expected at the same offset of the capture's i-th.
    pub(crate) allocated: Box<[(DevicePtr, usize)]>,
    /// When the node last replayed or was recorded ([`crate::Graft`]'s clock): of the least
    /// used graphs, the budget evicts the least recently used first.
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

    /// The footprint as (address, length) ranges: what the pool keeps mapped for the graph.
    pub(crate) fn pins(&self) -> impl Iterator<Item = (DevicePtr, usize)> + '_ {
        self.footprint
            .iter()
            .map(|&(s, e)| (DevicePtr(s), (e - s) as usize))
    }

    /// Bytes of device memory this node's graph writes.
    pub(crate) fn footprint_bytes(&self) -> u64 {
        self.footprint.iter().map(|(s, e)| e - s).sum()
    }
}

/// In [`Node::fixed`]: any address will do (a copied input, a followed in-place one). No
/// device address is `u64::MAX`.
pub(crate) const ANY_ADDRESS: u64 = u64::MAX;

/// [`Node::fixed`] for these slots.
pub(crate) fn fixed_addresses(slots: &[InputSlot]) -> Box<[u64]> {
    slots
        .iter()
        .map(|s| match *s {
            InputSlot::Static { addr } | InputSlot::Managed { addr } => addr.0,
            InputSlot::InPlace {
                recorded,
                follows: false,
                ..
            } => recorded.0,
            InputSlot::Copied { .. } | InputSlot::InPlace { .. } => ANY_ADDRESS,
        })
        .collect()
}

/// The positions of the non-empty copied inputs among `slots`.
pub(crate) fn copied_positions(slots: &[InputSlot]) -> Box<[usize]> {
    positions(
        slots,
        |s| matches!(s, InputSlot::Copied { len, .. } if *len > 0),
    )
}

/// The positions of the non-empty in-place inputs among `slots`.
pub(crate) fn in_place_positions(slots: &[InputSlot]) -> Box<[usize]> {
    positions(
        slots,
        |s| matches!(s, InputSlot::InPlace { len, .. } if *len > 0),
    )
}

fn positions(slots: &[InputSlot], keep: impl Fn(&InputSlot) -> bool) -> Box<[usize]> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| keep(s))
        .map(|(i, _)| i)
        .collect()
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
