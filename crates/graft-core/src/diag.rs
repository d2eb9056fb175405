//! Diagnostics: what the tree holds (text and DOT dumps), what each node captured, where the
//! pool's memory is, and why a function's calls never replay. Everything here is built on
//! demand, never on the call path.

use std::fmt::Write as _;
use std::sync::Arc;

use petgraph::dot::{Config as DotConfig, Dot};
use petgraph::graph::{DiGraph, NodeIndex};

use crate::churn::Churn;
use crate::device::{Device, DevicePtr, GraphSummary};
use crate::error::FunctionId;
use crate::graft::Graft;
use crate::node_id::NodeId;
use crate::reason::RecordReason;
use crate::tree::{InputSlot, NodeKey, OutputSlot};

/// How a node uses one input.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InputKind {
    /// Used in place at a fixed address (declared or marked static).
    Static,
    /// An output of the path, used in place.
    Managed,
    /// Copied into a placeholder before every replay.
    Copied,
    /// Read in place by the graph, which was patched to read the caller's buffer (copy-free;
    /// see `Config::patch_inputs_from`).
    Patched,
    /// Used in place at the caller's address (`Buffer::mark_in_place`); `follows` when the
    /// graph is patched to each call's buffer, else it replays only at the recorded address.
    InPlace {
        /// Whether replays follow the caller's buffer.
        follows: bool,
    },
}

/// A description of one node of the tree.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NodeInfo {
    /// The node.
    pub id: NodeId,
    /// Its parent, or none for a root.
    pub parent: Option<NodeId>,
    /// Depth in the tree (roots are 0).
    pub depth: usize,
    /// The function it records.
    pub function: FunctionId,
    /// The function's name.
    pub function_name: Arc<str>,
    /// Input sizes in bytes (part of the signature).
    pub input_sizes: Vec<usize>,
    /// Integer keys (part of the signature).
    pub keys: Vec<u64>,
    /// How each input is used.
    pub inputs: Vec<InputKind>,
    /// Number of outputs.
    pub outputs: usize,
    /// Replays so far.
    pub replays: u64,
    /// Generation it was recorded in.
    pub recorded_generation: u64,
    /// Why it was recorded.
    pub reason: RecordReason,
    /// Bytes of pool memory its graph writes.
    pub footprint_bytes: u64,
    /// Outputs of ancestors that must be dead for it to replay.
    pub expects_dead: usize,
    /// What its captured graph holds.
    pub graph: GraphSummary,
}

/// Where the graph pool's memory is.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct MemoryReport {
    /// Maximal ranges of physical memory mapped into the pool: (address, bytes).
    pub mapped: Vec<(DevicePtr, usize)>,
    /// Ranges recorded graphs use, kept mapped until `Graft::reset`: (address, bytes).
    pub pinned: Vec<(DevicePtr, usize)>,
    /// Bytes of physical memory mapped into the pool (the sum of `mapped`'s ranges).
    pub mapped_bytes: usize,
    /// Bytes in allocated blocks (as the bookkeeping sees them).
    pub allocated: usize,
    /// Allocated blocks.
    pub live_blocks: usize,
    /// Free ranges over mapped memory (free blocks cut to the mapped ranges).
    pub free_blocks: usize,
    /// Largest of those free ranges.
    pub largest_free: usize,
    /// 1 - largest free block / free bytes: 0 when free memory is one block.
    pub fragmentation: f64,
    /// Outputs callers still hold, by the node that produced them: (node, buffers, bytes).
    pub held_by_node: Vec<(NodeId, usize, usize)>,
    /// Held buffers made by warmups and bodies outside any node: (buffers, bytes).
    pub held_outside_nodes: (usize, usize),
}

impl<D: Device, M: Clone> Graft<D, M> {
    fn info(&self, key: NodeKey, depth: usize) -> NodeInfo {
        let n = &self.tree[key];
        let f = &self.functions[n.function];
        let sig = &f.sigs[n.sig];
        NodeInfo {
            id: key.id(),
            parent: self.tree.parent(key).map(NodeKey::id),
            depth,
            function: n.function,
            function_name: f.name.clone(),
            input_sizes: sig.sizes.to_vec(),
            keys: sig.keys.to_vec(),
            inputs: n
                .inputs
                .iter()
                .map(|s| match s {
                    InputSlot::Static { .. } => InputKind::Static,
                    InputSlot::Managed { .. } => InputKind::Managed,
                    InputSlot::Copied { reads: Some(_), .. } => InputKind::Patched,
                    InputSlot::Copied { .. } => InputKind::Copied,
                    InputSlot::InPlace { follows, .. } => InputKind::InPlace { follows: *follows },
                })
                .collect(),
            outputs: n.outputs.len(),
            replays: n.replays,
            recorded_generation: n.recorded_generation,
            reason: n.reason.clone(),
            footprint_bytes: n.footprint_bytes(),
            expects_dead: n.expected_dead.len(),
            graph: n.summary,
        }
    }

    /// Why `function`'s calls did not replay, when graft could name it: a key, an input size
    /// or a static input's address that changed on each of 8 or more consecutive calls, each
    /// of which was a new signature (or re-recorded because the static moved). The cause found
    /// last, kept after the calls stop churning; graft warned once when it first found it.
    pub fn churn(&self, function: FunctionId) -> Option<&Churn> {
        self.functions.get(function)?.churn()
    }

    /// Every node, depth-first from the roots (functions in registration order, siblings in
    /// recording order).
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut out = Vec::with_capacity(self.tree.len());
        let mut stack: Vec<(NodeKey, usize)> = self
            .tree
            .roots()
            .iter()
            .rev()
            .flat_map(|r| r.iter().rev().map(|&k| (k, 0)))
            .collect();
        while let Some((key, depth)) = stack.pop() {
            out.push(self.info(key, depth));
            let children = self.tree.children(key);
            stack.extend(children.iter().rev().map(|&k| (k, depth + 1)));
        }
        out
    }

    /// The tree as indented text: one line per node with its function, signature, replay
    /// count, pool footprint and captured graph.
    pub fn dump_text(&self) -> String {
        let mut s = String::new();
        let stats = self.stats();
        let _ = writeln!(
            s,
            "graft tree on {}: {} nodes, generation {}, pool mapped {} B, peak allocated {} B",
            self.device.describe(),
            stats.nodes,
            self.generation,
            stats.pool.mapped,
            stats.pool.peak_allocated
        );
        for n in self.nodes() {
            let inputs: Vec<String> = n
                .input_sizes
                .iter()
                .zip(&n.inputs)
                .map(|(size, kind)| {
                    let k = match kind {
                        InputKind::Static => "static",
                        InputKind::Managed => "managed",
                        InputKind::Copied => "copied",
                        InputKind::Patched => "patched",
                        InputKind::InPlace { follows: true } => "in place",
                        InputKind::InPlace { follows: false } => "in place (fixed)",
                    };
                    format!("{size}B {k}")
                })
                .collect();
            let _ = writeln!(
                s,
                "{:indent$}{} {}({}) keys={:?} replays={} footprint={}B graph={}k/{}c/{}m/{}o recorded@gen{} ({})",
                "",
                n.id,
                n.function_name,
                inputs.join(", "),
                n.keys,
                n.replays,
                n.footprint_bytes,
                n.graph.kernels,
                n.graph.copies,
                n.graph.memsets,
                n.graph.other,
                n.recorded_generation,
                n.reason.name(),
                indent = 2 * n.depth
            );
        }
        s
    }

    /// The tree in Graphviz DOT, built through petgraph.
    pub fn dump_dot(&self) -> String {
        let infos = self.nodes();
        let mut graph: DiGraph<String, String> = DiGraph::new();
        let root = graph.add_node("roots".to_string());
        let mut index: Vec<(NodeId, NodeIndex)> = Vec::with_capacity(infos.len());
        for n in &infos {
            let label = format!(
                "{} {}\\nsizes {:?} keys {:?}\\nreplays {}  footprint {} B\\n{} kernels, {} copies",
                n.id,
                n.function_name,
                n.input_sizes,
                n.keys,
                n.replays,
                n.footprint_bytes,
                n.graph.kernels,
                n.graph.copies
            );
            let i = graph.add_node(label);
            let parent = n
                .parent
                .and_then(|p| index.iter().find(|(id, _)| *id == p).map(|(_, i)| *i))
                .unwrap_or(root);
            graph.add_edge(parent, i, n.reason.name().to_string());
            index.push((n.id, i));
        }
        format!(
            "{}",
            Dot::with_config(&graph, &[DotConfig::GraphContentOnly])
        )
        .lines()
        .fold(String::from("digraph graft {\n"), |mut acc, l| {
            acc.push_str(l);
            acc.push('\n');
            acc
        }) + "}\n"
    }

    /// Mapped memory, blocks and fragmentation of the graph pool, and who holds its memory.
    pub fn memory_report(&self) -> MemoryReport {
        let pool = crate::pools::lock(self.pools.graph());
        let stats = pool.stats();
        let blocks = pool.blocks();
        let mapped = pool.mapped();
        let pinned = pool.pinned();
        drop(pool);
        // Free memory that costs something: free blocks cut to the mapped ranges (the unmapped
        // rest of the address range is free too, but holds no memory).
        let free: Vec<usize> = blocks
            .iter()
            .filter(|(_, allocated)| !allocated)
            .flat_map(|(b, _)| {
                let (s, e) = (b.addr.0, b.addr.0 + b.size as u64);
                mapped.iter().filter_map(move |&(m, len)| {
                    let (ms, me) = (m.0.max(s), (m.0 + len as u64).min(e));
                    (ms < me).then_some((me - ms) as usize)
                })
            })
            .collect();
        let free_bytes: usize = free.iter().sum();
        let largest_free = free.iter().copied().max().unwrap_or(0);
        let mut held_by_node = Vec::new();
        for (key, n) in self.tree.iter() {
            let (mut count, mut bytes) = (0, 0);
            for o in &n.outputs {
                if let OutputSlot::Tracked { cell, spares } = &o.slot {
                    for c in std::iter::once(cell).chain(spares) {
                        if c.is_readable_by_someone() {
                            count += 1;
                            bytes += c.len();
                        }
                    }
                }
            }
            if count > 0 {
                held_by_node.push((key.id(), count, bytes));
            }
        }
        let outside = self
            .pools
            .loose()
            .iter()
            .filter(|c| c.is_readable_by_someone())
            .fold((0, 0), |(n, b), c| (n + 1, b + c.len()));
        MemoryReport {
            mapped,
            pinned,
            mapped_bytes: stats.mapped,
            allocated: stats.allocated,
            live_blocks: stats.live_blocks,
            free_blocks: free.len(),
            largest_free,
            fragmentation: if free_bytes == 0 {
                0.0
            } else {
                1.0 - largest_free as f64 / free_bytes as f64
            },
            held_by_node,
            held_outside_nodes: outside,
        }
    }
}
