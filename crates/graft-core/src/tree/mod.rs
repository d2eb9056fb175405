//! The graph tree: the node arena, its links (parents, children, roots) and the candidate
//! lookup, changed only through [`Tree`]'s methods.

mod check;
// The links check is for tests only (unit tests and graft's `test-support` accessors).
#[cfg(any(test, feature = "test-support"))]
mod links;
mod node;

use std::collections::HashMap;
use std::ops::{Index, IndexMut};

use slotmap::{Key, KeyData, SlotMap};

use crate::buffer::NodeId;
use crate::device::DevicePtr;
use crate::error::FunctionId;

#[cfg(any(test, feature = "test-support"))]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub use links::TreeViolation;
pub use node::Output;
pub(crate) use node::{
    ANY_ADDRESS, InputSlot, Node, NodeOutput, OutputSlot, copied_positions, fixed_addresses,
    in_place_positions, merge_ranges, overlaps,
};

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
type SlotKey = (Option<NodeKey>, FunctionId, usize);

/// A node and its links.
struct Entry<G, M> {
    node: Node<G, M>,
    parent: Option<NodeKey>,
    /// Children in recording order (for walks; lookups go through [`Tree::candidates`]).
    children: Vec<NodeKey>,
}

/// The recorded graphs, keyed by the execution path: a node's children are what ran after it.
pub(crate) struct Tree<G, M> {
    nodes: SlotMap<NodeKey, Entry<G, M>>,
    /// The root nodes of each function, in recording order.
    roots: Vec<Vec<NodeKey>>,
    /// The nodes at each (parent, function, signature), in recording order: a call finds its
    /// candidates with one hash lookup, however large the tree (a fixed hasher: no per-map
    /// seed and no SipHash on the fast path).
    slots: HashMap<SlotKey, Vec<NodeKey>, foldhash::fast::FixedState>,
}

impl<G, M> Default for Tree<G, M> {
    fn default() -> Tree<G, M> {
        Tree {
            nodes: SlotMap::with_key(),
            roots: Vec::new(),
            slots: HashMap::default(),
        }
    }
}

impl<G, M> Index<NodeKey> for Tree<G, M> {
    type Output = Node<G, M>;

    #[inline]
    fn index(&self, key: NodeKey) -> &Node<G, M> {
        &self.nodes[key].node
    }
}

impl<G, M> IndexMut<NodeKey> for Tree<G, M> {
    /// A node's own state (replay counts, re-pointed inputs, output cells); never its place.
    #[inline]
    fn index_mut(&mut self, key: NodeKey) -> &mut Node<G, M> {
        &mut self.nodes[key].node
    }
}

impl<G, M> Tree<G, M> {
    /// Makes room for the roots of one more registered function.
    pub(crate) fn add_function(&mut self) {
        self.roots.push(Vec::new());
    }

    /// The number of nodes.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The node at `key`, if it is in the tree.
    #[inline]
    pub(crate) fn get(&self, key: NodeKey) -> Option<&Node<G, M>> {
        self.nodes.get(key).map(|e| &e.node)
    }

    /// The node at `key`, if it is in the tree: its own state, never its place.
    pub(crate) fn get_mut(&mut self, key: NodeKey) -> Option<&mut Node<G, M>> {
        self.nodes.get_mut(key).map(|e| &mut e.node)
    }

    /// Every node, in arena order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (NodeKey, &Node<G, M>)> {
        self.nodes.iter().map(|(k, e)| (k, &e.node))
    }

    /// Every node, in arena order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &Node<G, M>> {
        self.nodes.values().map(|e| &e.node)
    }

    /// Every node's own state (never its place), in arena order.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Node<G, M>> {
        self.nodes.values_mut().map(|e| &mut e.node)
    }

    /// A node's parent (none at the roots).
    pub(crate) fn parent(&self, key: NodeKey) -> Option<NodeKey> {
        self.nodes[key].parent
    }

    /// A node's children, in recording order.
    pub(crate) fn children(&self, key: NodeKey) -> &[NodeKey] {
        &self.nodes[key].children
    }

    /// The root nodes of each function (in registration order), in recording order.
    pub(crate) fn roots(&self) -> &[Vec<NodeKey>] {
        &self.roots
    }

    /// Adds `node` under `parent` (a root when none): in the arena, in its parent's children
    /// (or its function's roots) and in the candidate lookup.
    pub(crate) fn insert(&mut self, parent: Option<NodeKey>, node: Node<G, M>) -> NodeKey {
        let slot = (parent, node.function, node.sig);
        let function = node.function;
        let key = self.nodes.insert(Entry {
            node,
            parent,
            children: Vec::new(),
        });
        self.slots.entry(slot).or_default().push(key);
        match parent {
            Some(p) => self.nodes[p].children.push(key),
            None => self.roots[function.0].push(key),
        }
        key
    }

    /// The nodes of `function` with signature `sig` recorded under `parent` (the roots when
    /// none), in recording order: one hash lookup.
    #[inline]
    pub(crate) fn candidates(
        &self,
        parent: Option<NodeKey>,
        function: FunctionId,
        sig: usize,
    ) -> &[NodeKey] {
        self.slots
            .get(&(parent, function, sig))
            .map_or(&[][..], Vec::as_slice)
    }

    /// Whether `function` has nodes under `parent` (the roots when none), of any signature.
    pub(crate) fn has_function_at(&self, parent: Option<NodeKey>, function: FunctionId) -> bool {
        match parent {
            Some(p) => self.nodes[p]
                .children
                .iter()
                .any(|&c| self.nodes[c].node.function == function),
            None => !self.roots[function.0].is_empty(),
        }
    }

    /// The nodes from the root to `tip`, tip last.
    pub(crate) fn path_nodes(&self, tip: Option<NodeKey>) -> Vec<NodeKey> {
        let mut path = Vec::new();
        let mut at = tip;
        while let Some(k) = at {
            path.push(k);
            at = self.nodes[k].parent;
        }
        path.reverse();
        path
    }

    /// `key` and every node under it, `key` first, then the rest breadth first (the order in
    /// which [`Tree::remove`] returns them).
    pub(crate) fn subtree(&self, key: NodeKey) -> Vec<NodeKey> {
        let mut all = vec![key];
        let mut i = 0;
        while let Some(&k) = all.get(i) {
            i += 1;
            all.extend_from_slice(&self.nodes[k].children);
        }
        all
    }

    /// Removes `key` and every node under it: unlinked from the parent (or the roots) and
    /// from the candidate lookup. Returns the removed nodes, `key` first, then the rest
    /// breadth first; nothing when `key` is not in the tree.
    pub(crate) fn remove(&mut self, key: NodeKey) -> Vec<(NodeKey, Node<G, M>)> {
        let Some(entry) = self.nodes.get(key) else {
            return Vec::new();
        };
        match entry.parent {
            Some(p) => self.nodes[p].children.retain(|&c| c != key),
            None => self.roots[entry.node.function.0].retain(|&c| c != key),
        }
        let mut removed = Vec::new();
        let mut doomed = vec![key];
        let mut i = 0;
        while let Some(&k) = doomed.get(i) {
            i += 1;
            let Some(Entry {
                node,
                parent,
                children,
            }) = self.nodes.remove(k)
            else {
                continue;
            };
            let slot = (parent, node.function, node.sig);
            if let Some(v) = self.slots.get_mut(&slot) {
                v.retain(|&c| c != k);
                if v.is_empty() {
                    self.slots.remove(&slot);
                }
            }
            doomed.extend(children);
            removed.push((k, node));
        }
        removed
    }

    /// Removes every node (their graphs are dropped); the functions' roots stay registered.
    pub(crate) fn clear(&mut self) {
        self.nodes.clear();
        self.roots.iter_mut().for_each(Vec::clear);
        self.slots.clear();
    }

    /// What every node's graph reads or writes, to stay mapped while the graphs exist.
    pub(crate) fn pins(&self) -> Vec<(DevicePtr, usize)> {
        self.values().flat_map(Node::pins).collect()
    }
}

#[cfg(test)]
mod tests {
    //! The tree's links without a device: nodes with `()` graphs.

    use super::*;
    use crate::reason::RecordReason;

    fn node(function: usize, sig: usize) -> Node<(), ()> {
        Node {
            function: FunctionId(function),
            sig,
            graph: (),
            inputs: Box::new([]),
            copied: Box::new([]),
            in_place: Box::new([]),
            aliases: Box::new([]),
            fixed: Box::new([]),
            delivers: false,
            expected_dead: Box::new([]),
            outputs: Vec::new(),
            footprint: Box::new([(0x1000, 0x2000)]),
            replays: 0,
            uses: Default::default(),
            guard: crate::guard::Guard::Off,
            allocated: Box::new([]),
            last_used: 0,
            retired: None,
            recorded_generation: 1,
            reason: RecordReason::FirstRecording,
            summary: Default::default(),
        }
    }

    #[test]
    fn insert_links_and_remove_unlinks_a_subtree() {
        let mut t = Tree::default();
        t.add_function();
        t.add_function();
        let root = t.insert(None, node(0, 0));
        let a = t.insert(Some(root), node(1, 0));
        let b = t.insert(Some(root), node(1, 1));
        let deep = t.insert(Some(a), node(0, 0));
        t.check_links().unwrap();
        assert_eq!(t.candidates(Some(root), FunctionId(1), 0), [a]);
        assert_eq!(t.candidates(None, FunctionId(0), 0), [root]);
        assert!(t.has_function_at(Some(root), FunctionId(1)));
        assert!(!t.has_function_at(None, FunctionId(1)));
        assert_eq!(t.path_nodes(Some(deep)), [root, a, deep]);
        assert_eq!(t.pins().len(), 4);

        let removed: Vec<NodeKey> = t.remove(a).into_iter().map(|(k, _)| k).collect();
        assert_eq!(removed, [a, deep]);
        t.check_links().unwrap();
        assert_eq!(t.children(root), [b]);
        assert!(t.candidates(Some(root), FunctionId(1), 0).is_empty());
        assert!(t.get(deep).is_none());
        assert!(t.remove(a).is_empty(), "gone already");

        t.remove(root);
        t.check_links().unwrap();
        assert_eq!(t.len(), 0);
        assert!(t.roots().iter().all(Vec::is_empty));
    }

    #[test]
    fn a_link_bypassing_the_methods_is_found() {
        let mut t = Tree::default();
        t.add_function();
        let root = t.insert(None, node(0, 0));
        let child = t.insert(Some(root), node(0, 0));
        t.nodes[root].children.clear();
        assert_eq!(
            t.check_links(),
            Err(TreeViolation::Unlinked { node: child.id() })
        );
    }
}
