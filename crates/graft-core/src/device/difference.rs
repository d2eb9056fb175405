//! What a backend reports when it compares two graphs node by node ([`Device::compare`]):
//! every difference it sees, raw; core decides which ones matter.
//!
//! [`Device::compare`]: super::Device::compare

use std::fmt;

use super::types::{CopyEnds, DevicePtr};

/// One difference between a recorded graph and a new capture of the same body, at node
/// `node` (the nodes numbered in the order the backend walks them, the same for both).
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum GraphDifference {
    /// The graphs have different numbers or kinds of nodes: nothing further is compared.
    Shape {
        /// Nodes of the recorded graph.
        recorded: usize,
        /// Nodes of the new capture.
        now: usize,
    },
    /// A kernel node launches another function.
    Function {
        /// The node.
        node: usize,
        /// The recorded kernel's name.
        recorded: String,
        /// The new kernel's name.
        now: String,
    },
    /// A kernel node's launch configuration (grid, block, shared memory) differs.
    Launch {
        /// The node.
        node: usize,
        /// The kernel's name.
        kernel: String,
    },
    /// The bytes of one kernel argument differ (a scalar, or an address: core tells which
    /// address changes it expected).
    Argument {
        /// The node.
        node: usize,
        /// The kernel's name.
        kernel: String,
        /// The argument's index.
        index: usize,
        /// Its bytes in the recorded graph.
        recorded: Box<[u8]>,
        /// Its bytes in the new capture.
        now: Box<[u8]>,
    },
    /// A copy node's ends or length differ.
    Copy {
        /// The node.
        node: usize,
        /// The recorded copy's ends and length.
        recorded: (CopyEnds, usize),
        /// The new copy's ends and length.
        now: (CopyEnds, usize),
    },
    /// A memset node's destination, value or shape differs.
    Memset {
        /// The node.
        node: usize,
        /// The recorded destination.
        recorded: DevicePtr,
        /// The new destination.
        now: DevicePtr,
    },
}

impl GraphDifference {
    /// Whether an executable can take the new value in place of the recorded one: a kernel
    /// argument, a copy's or a memset's parameters. A different graph shape, kernel or launch
    /// configuration cannot.
    pub fn patchable(&self) -> bool {
        matches!(
            self,
            GraphDifference::Argument { .. }
                | GraphDifference::Copy { .. }
                | GraphDifference::Memset { .. }
        )
    }
}

impl fmt::Display for GraphDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphDifference::Shape { recorded, now } => write!(
                f,
                "the work changed: {recorded} nodes were recorded, {now} captured now"
            ),
            GraphDifference::Function {
                node,
                recorded,
                now,
            } => {
                write!(f, "node {node} launches `{now}` instead of `{recorded}`")
            }
            GraphDifference::Launch { node, kernel } => {
                write!(
                    f,
                    "`{kernel}` (node {node}) has another launch configuration"
                )
            }
            GraphDifference::Argument {
                kernel,
                index,
                recorded,
                now,
                ..
            } => write!(
                f,
                "`{kernel}` argument {index} was {} and is {}",
                Hex(recorded),
                Hex(now)
            ),
            GraphDifference::Copy {
                node,
                recorded,
                now,
            } => write!(
                f,
                "copy node {node} was {} bytes {} -> {} and is {} bytes {} -> {}",
                recorded.1, recorded.0.src, recorded.0.dst, now.1, now.0.src, now.0.dst
            ),
            GraphDifference::Memset {
                node,
                recorded,
                now,
            } => write!(f, "memset node {node} was at {recorded} and is at {now}"),
        }
    }
}

/// Bytes as little-endian hex, e.g. `0x3f800000`.
struct Hex<'a>(&'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("0x")?;
        self.0.iter().rev().try_for_each(|b| write!(f, "{b:02x}"))
    }
}
