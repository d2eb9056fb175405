//! The plain values the device layer passes: addresses, device identities, capture modes, conditional kinds, copy ends, graph summaries and update refusals.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A device address. Plain integer arithmetic on it is meaningful: ranges, overlap, offsets.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` past this one.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Identifies one device instance, so that core can reject a buffer of another device.
///
/// A backend takes one per device from [`DeviceId::fresh`], a counter shared by every backend
/// of the process, so no two devices ever have the same id. Nothing else makes one: an id
/// cannot be forged to pass a buffer off as another device's.
///
/// ```
/// use graft_core::DeviceId;
///
/// assert_ne!(DeviceId::fresh(), DeviceId::fresh());
/// ```
///
/// ```compile_fail
/// // The field is private: an id cannot be made up.
/// let forged = graft_core::DeviceId(3);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct DeviceId(u64);

impl DeviceId {
    /// A new id, never handed out before in this process. Backends call it once per device
    /// they open.
    pub fn fresh() -> DeviceId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        DeviceId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device#{}", self.0)
    }
}

/// How a capture treats potentially unsafe API calls made by other threads (CUDA's
/// `CUstreamCaptureMode`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum CaptureMode {
    /// Unsafe calls from any thread fail while the capture is underway.
    Global,
    /// Unsafe calls fail only on the capturing thread (the default: a data-loading thread can keep working).
    #[default]
    ThreadLocal,
    /// Nothing is checked; the caller promises to make no unsafe call.
    Relaxed,
}

/// Why a device refused to update an executable graph in place (CUDA's
/// `CUgraphExecUpdateResult`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum UpdateRefusal {
    /// Nodes were added or removed, or their dependencies changed.
    TopologyChanged,
    /// A node has another kind (kernel, copy, ...).
    NodeTypeChanged,
    /// A kernel node runs another function.
    FunctionChanged,
    /// A parameter that cannot change in place changed (a copy's length, ...).
    ParametersChanged,
    /// The device cannot update in place at all, or not this kind of node.
    NotSupported,
    /// An attribute of a node changed.
    AttributesChanged,
    /// The driver reported another reason.
    Other,
}

impl fmt::Display for UpdateRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UpdateRefusal::TopologyChanged => "the graph's topology changed",
            UpdateRefusal::NodeTypeChanged => "a node changed kind",
            UpdateRefusal::FunctionChanged => "a kernel node runs another function",
            UpdateRefusal::ParametersChanged => "a parameter changed that cannot change in place",
            UpdateRefusal::NotSupported => "the device does not update this graph in place",
            UpdateRefusal::AttributesChanged => "a node's attributes changed",
            UpdateRefusal::Other => "the driver refused for another reason",
        })
    }
}

/// The two ends of a device-to-device copy recorded in a graph (see
/// [`Device::repoint_copy`](super::Device::repoint_copy)).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CopyEnds {
    /// Where the copy writes.
    pub dst: DevicePtr,
    /// Where it reads.
    pub src: DevicePtr,
}

/// How many nodes of each kind a captured graph holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct GraphSummary {
    /// Kernel nodes (of the graph itself, not of its conditional bodies).
    pub kernels: usize,
    /// Memory copy nodes.
    pub copies: usize,
    /// Memset nodes.
    pub memsets: usize,
    /// Conditional nodes (loops and branches, see [`Conditional`]).
    pub conditionals: usize,
    /// Every other node kind.
    pub other: usize,
    /// Kernels, anywhere in the graph, of a random-number library whose generator state lives
    /// on the host (cuRAND's host API, which candle's `rand` and `randn` use): the host
    /// advances that state when the kernel is enqueued, so a replay would draw numbers out of
    /// step with eager execution. Graft launches such a graph once and never replays it.
    pub host_random: usize,
    /// Programmatic edges (of the graph itself): a kernel launched as a programmatic
    /// dependent of the kernel before it, which may start while that kernel still runs and
    /// waits on the device before it touches what that kernel touches.
    pub programmatic_edges: usize,
}

/// A conditional node of a graph: work the device runs, repeats or skips by a `u32` it reads
/// from device memory when the node runs (the *selector*), so that the host never waits for
/// it. CUDA 12.4's conditional nodes; the selector's value is set on the device by a kernel
/// just before the node (and, for a loop, again at the end of every iteration).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Conditional {
    /// One body, run again and again while the selector is not 0 (tested before every
    /// iteration, the first included).
    While,
    /// One body, run once if the selector is not 0.
    If,
    /// Two bodies: the first if the selector is not 0, else the second.
    IfElse,
    /// `n` bodies: body `selector` if it is below `n`, else none.
    Switch(u32),
}

impl Conditional {
    /// How many bodies the node has.
    pub fn branches(self) -> usize {
        match self {
            Conditional::While | Conditional::If => 1,
            Conditional::IfElse => 2,
            Conditional::Switch(n) => n as usize,
        }
    }

    /// Which body runs for `selector`, if any; a loop's body runs while this is `Some`.
    pub fn branch(self, selector: u32) -> Option<usize> {
        match self {
            Conditional::While | Conditional::If => (selector != 0).then_some(0),
            Conditional::IfElse => Some(usize::from(selector == 0)),
            Conditional::Switch(n) => (selector < n).then_some(selector as usize),
        }
    }
}

impl fmt::Display for Conditional {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Conditional::While => f.write_str("while loop"),
            Conditional::If => f.write_str("if"),
            Conditional::IfElse => f.write_str("if-else"),
            Conditional::Switch(n) => write!(f, "switch of {n}"),
        }
    }
}
