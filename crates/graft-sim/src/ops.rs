//! Recorded work: the operations a capture records ([`Op`]), running them, and what CUDA would
//! say of updating one recording with another.

use std::fmt;
use std::sync::Arc;

use graft_core::backend::CopyEnds;
use graft_core::{Conditional, DeviceError, DeviceOp, DevicePtr, GraphSummary, UpdateRefusal};

use crate::memory::{Lane, SimMemory};

/// A kernel body: runs against device memory, reports bad accesses as errors.
pub type KernelFn = dyn Fn(&mut SimMemory) -> Result<(), DeviceError> + Send + Sync + 'static;

/// One operation recorded during a capture.
#[derive(Clone)]
pub(crate) enum Op {
    /// A kernel launch.
    Kernel {
        name: &'static str,
        /// The arguments' bytes as the launch passed them (scalars and addresses alike):
        /// what `Device::compare` compares; the body `f` has them baked in. `None` for a
        /// kernel launched without declaring them (`SimQueue::launch_kernel`): a graph holding
        /// one cannot be compared, as CUDA cannot compare a kernel whose parameters the driver
        /// does not show.
        args: Option<Arc<[Box<[u8]>]>>,
        /// A programmatic dependent's part before its wait (`SimQueue::launch_dependent`);
        /// `None` for a plain kernel.
        before: Option<Arc<KernelFn>>,
        f: Arc<KernelFn>,
    },
    /// A device-to-device copy.
    Copy {
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
    },
    /// A graph launched into the capture (a child graph node in CUDA).
    Child(Arc<[Op]>),
    /// Work forked onto the side stream and joined back: the side stream's operations and the
    /// runtime stream's between the fork and the join. Run side first, then main, with the
    /// accesses of each checked against the other's (`DeviceError::StreamRace`).
    Fork { side: Arc<[Op]>, main: Arc<[Op]> },
    /// A conditional node: its bodies, run by the `u32` at `selector` when the node runs.
    Conditional {
        kind: Conditional,
        selector: DevicePtr,
        bodies: Arc<[Arc<[Op]>]>,
    },
}

/// The most iterations a simulated loop runs before it is reported: a GPU would run for ever.
pub(crate) const MAX_ITERATIONS: u64 = 1 << 24;

/// Whether a kernel belongs to a random-number library whose state lives on the host: cuRAND
/// names its kernels after its generator states, and the simulator models that by name.
pub(crate) fn is_host_random(name: &str) -> bool {
    name.to_ascii_lowercase().contains("curand")
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Kernel { name, .. } => write!(f, "kernel {name}"),
            Op::Copy { dst, src, len } => write!(f, "copy {len} bytes {src} -> {dst}"),
            Op::Child(ops) => f.debug_list().entries(ops.iter()).finish(),
            Op::Fork { side, main } => write!(f, "fork side {side:?} main {main:?}"),
            Op::Conditional {
                kind,
                selector,
                bodies,
            } => write!(f, "{kind} on {selector} {bodies:?}"),
        }
    }
}

/// How many operations of each kind one launch ran.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) kernels: u64,
    pub(crate) copies: u64,
}

/// Runs `ops` in order against `mem`, stopping at the first error (earlier ops keep their effect).
pub(crate) fn run_ops(
    mem: &mut SimMemory,
    ops: &[Op],
    disabled: &[CopyEnds],
    tally: &mut Tally,
) -> Result<(), DeviceError> {
    for op in ops {
        match op {
            Op::Copy { dst, src, .. }
                if disabled.iter().any(|c| c.dst == *dst && c.src == *src) => {}
            Op::Kernel {
                name, before, f, ..
            } => {
                tally.kernels += 1;
                run_kernel(mem, DeviceOp::GraphLaunch, name, before.as_deref(), &**f)?;
            }
            Op::Copy { dst, src, len } => {
                tally.copies += 1;
                mem.copy_as(DeviceOp::Copy, *dst, *src, *len)?;
            }
            Op::Child(ops) => {
                mem.break_chain();
                run_ops(mem, ops, &[], tally)?;
                mem.break_chain();
            }
            Op::Fork { side, main } => {
                mem.break_chain();
                mem.open_window();
                mem.set_lane(Some(Lane::Side));
                let ran = run_ops(mem, side, disabled, tally).and_then(|()| {
                    mem.set_lane(Some(Lane::Main));
                    run_ops(mem, main, disabled, tally)
                });
                mem.set_lane(None);
                mem.break_chain();
                let raced = mem.close_window(DeviceOp::GraphLaunch);
                ran?;
                raced?;
            }
            Op::Conditional {
                kind,
                selector,
                bodies,
            } => {
                let mut iterations = 0u64;
                loop {
                    let mut value = [0u32];
                    mem.read_u32(*selector, &mut value)?;
                    let Some(i) = kind.branch(value[0]) else {
                        break;
                    };
                    mem.break_chain();
                    run_ops(mem, &bodies[i], &[], tally)?;
                    mem.break_chain();
                    iterations += 1;
                    if *kind != Conditional::While {
                        break;
                    }
                    if iterations == MAX_ITERATIONS {
                        return Err(DeviceError::InvalidArgument {
                            op: DeviceOp::GraphLaunch,
                            what: "a device-side loop ran 2^24 iterations: its body never clears its flag",
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs kernel `name`: `before` (a dependent's part before its wait, checked against the
/// kernels it may overlap when it reaches the wait), then `f`; reported as `op`.
pub(crate) fn run_kernel(
    mem: &mut SimMemory,
    op: DeviceOp,
    name: &'static str,
    before: Option<&KernelFn>,
    f: &KernelFn,
) -> Result<(), DeviceError> {
    mem.begin_kernel(name, before.is_some());
    let ran = match before {
        Some(before) => before(mem)
            .and_then(|()| mem.check_wait(op))
            .and_then(|()| f(mem)),
        None => f(mem),
    };
    mem.end_kernel();
    ran
}

/// Why `new` cannot update an executable made from `old`, or `None` when it can: the same
/// operations in the same order, kernels with the same name (the function), copies of the
/// same length (CUDA updates only the addresses of a 1-D copy), child graphs recursively.
pub(crate) fn update_refusal(old: &[Op], new: &[Op]) -> Option<UpdateRefusal> {
    if old.len() != new.len() {
        return Some(UpdateRefusal::TopologyChanged);
    }
    old.iter().zip(new).find_map(|pair| match pair {
        (Op::Kernel { name: a, .. }, Op::Kernel { name: b, .. }) => {
            (a != b).then_some(UpdateRefusal::FunctionChanged)
        }
        (Op::Copy { len: a, .. }, Op::Copy { len: b, .. }) => {
            (a != b).then_some(UpdateRefusal::ParametersChanged)
        }
        (Op::Child(a), Op::Child(b)) => update_refusal(a, b),
        (Op::Fork { side: a, main: m }, Op::Fork { side: b, main: n }) => {
            update_refusal(a, b).or_else(|| update_refusal(m, n))
        }
        // As graft-cuda: a graph with conditional nodes is instantiated again, not updated.
        (Op::Conditional { .. }, Op::Conditional { .. }) => Some(UpdateRefusal::NotSupported),
        _ => Some(UpdateRefusal::NodeTypeChanged),
    })
}

pub(crate) fn summarize(ops: &[Op]) -> GraphSummary {
    let mut s = GraphSummary::default();
    let mut previous: Option<&Op> = None;
    for op in ops {
        match op {
            Op::Kernel { before, .. } => {
                s.kernels += 1;
                // An edge from the kernel before it, when there is one.
                if before.is_some() && matches!(previous, Some(Op::Kernel { .. })) {
                    s.programmatic_edges += 1;
                }
            }
            Op::Copy { .. } => s.copies += 1,
            Op::Child(_) => s.other += 1,
            Op::Conditional { .. } => s.conditionals += 1,
            Op::Fork { side, main } => {
                for part in [summarize(side), summarize(main)] {
                    s.kernels += part.kernels;
                    s.copies += part.copies;
                    s.other += part.other;
                    s.conditionals += part.conditionals;
                    s.programmatic_edges += part.programmatic_edges;
                }
            }
        }
        previous = Some(op);
    }
    s.host_random = walk_kernels(ops)
        .into_iter()
        .filter(|name| is_host_random(name))
        .count();
    s
}

/// The names of the kernels `ops` launch, in order, child graphs and conditional bodies
/// flattened.
pub(crate) fn walk_kernels(ops: &[Op]) -> Vec<&'static str> {
    fn walk(ops: &[Op], out: &mut Vec<&'static str>) {
        for op in ops {
            match op {
                Op::Kernel { name, .. } => out.push(name),
                Op::Copy { .. } => {}
                Op::Child(ops) => walk(ops, out),
                Op::Fork { side, main } => {
                    walk(side, out);
                    walk(main, out);
                }
                Op::Conditional { bodies, .. } => bodies.iter().for_each(|b| walk(b, out)),
            }
        }
    }
    let mut out = Vec::new();
    walk(ops, &mut out);
    out
}
