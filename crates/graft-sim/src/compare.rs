//! Comparing two recordings node by node (`Device::compare`): the nodes are numbered in
//! launch order, child graphs inlined, each conditional node followed by its bodies.

use graft_core::GraphDifference;
use graft_core::backend::CopyEnds;

use crate::ops::Op;

/// Whether the two recordings can be compared: every kernel in them declared its arguments.
pub(crate) fn comparable(old: &[Op], new: &[Op]) -> bool {
    [old, new].into_iter().all(|ops| {
        flatten(ops)
            .iter()
            .all(|op| !matches!(op, Op::Kernel { args: None, .. }))
    })
}

/// Every difference between the recorded `old` and the new capture `new`, raw: addresses
/// included.
pub(crate) fn compare(old: &[Op], new: &[Op]) -> Vec<GraphDifference> {
    let (a, b) = (flatten(old), flatten(new));
    let same_kinds = a.len() == b.len()
        && a.iter()
            .zip(&b)
            .all(|(x, y)| std::mem::discriminant(*x) == std::mem::discriminant(*y));
    if !same_kinds {
        return vec![GraphDifference::Shape {
            recorded: a.len(),
            now: b.len(),
        }];
    }
    let mut out = Vec::new();
    for (node, pair) in a.into_iter().zip(b).enumerate() {
        match pair {
            (Op::Kernel { name: x, .. }, Op::Kernel { name: y, .. }) if x != y => {
                out.push(GraphDifference::Function {
                    node,
                    recorded: x.to_string(),
                    now: y.to_string(),
                });
            }
            (
                Op::Kernel {
                    name,
                    args: Some(x),
                    ..
                },
                Op::Kernel { args: Some(y), .. },
            ) => {
                if x.len() != y.len() {
                    out.push(GraphDifference::Launch {
                        node,
                        kernel: name.to_string(),
                    });
                    continue;
                }
                let changed = x
                    .iter()
                    .zip(y.iter())
                    .enumerate()
                    .filter(|(_, (p, q))| p != q);
                out.extend(changed.map(|(index, (p, q))| GraphDifference::Argument {
                    node,
                    kernel: name.to_string(),
                    index,
                    recorded: p.clone(),
                    now: q.clone(),
                }));
            }
            (
                Op::Copy { dst, src, len },
                Op::Copy {
                    dst: d,
                    src: s,
                    len: l,
                },
            ) if (dst, src, len) != (d, s, l) => out.push(GraphDifference::Copy {
                node,
                recorded: (
                    CopyEnds {
                        dst: *dst,
                        src: *src,
                    },
                    *len,
                ),
                now: (CopyEnds { dst: *d, src: *s }, *l),
            }),
            (
                Op::Conditional {
                    kind: k,
                    selector: s,
                    bodies: x,
                },
                Op::Conditional {
                    kind: j,
                    selector: t,
                    bodies: y,
                },
            ) => {
                if k != j || x.len() != y.len() {
                    out.push(GraphDifference::Shape {
                        recorded: x.len(),
                        now: y.len(),
                    });
                } else if s != t {
                    // The selector is the conditional node's one parameter: an address.
                    out.push(GraphDifference::Argument {
                        node,
                        kernel: "conditional".to_string(),
                        index: 0,
                        recorded: s.0.to_le_bytes().into(),
                        now: t.0.to_le_bytes().into(),
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// The nodes of `ops` in launch order: child graphs inlined, each conditional node
/// followed by its bodies' nodes.
fn flatten(ops: &[Op]) -> Vec<&Op> {
    fn walk<'a>(ops: &'a [Op], out: &mut Vec<&'a Op>) {
        for op in ops {
            match op {
                Op::Child(child) => walk(child, out),
                Op::Fork { side, main } => {
                    walk(side, out);
                    walk(main, out);
                }
                Op::Conditional { bodies, .. } => {
                    out.push(op);
                    bodies.iter().for_each(|b| walk(b, out));
                }
                Op::Kernel { .. } | Op::Copy { .. } => out.push(op),
            }
        }
    }
    let mut out = Vec::new();
    walk(ops, &mut out);
    out
}
