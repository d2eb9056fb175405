//! A guarded call (see `guard.rs` for the schedule): the body is captured again, the device
//! compares the capture with the recording node by node, and core keeps the differences its
//! own address bookkeeping does not predict. None: the recording replays and the capture is
//! dropped. Some: the capture replaces the recording and runs (this call's result is right),
//! and the difference is reported.

use crate::ctx::Ctx;
use crate::device::{Device, DevicePtr, GraphDifference};
use crate::error::{BodyError, CallError};
use crate::graft::{Frame, Graft, Outcome};
use crate::guard::{Found, Guard, GuardFinding, transition};
use crate::reason::{EvictReason, RecordReason};
use crate::tree::{InputSlot, Node, NodeKey, NodeOutput, Output, OutputSlot, key_of};

use super::vote::Pending;
use super::{Failure, fallback_reason};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Carries out a guarded call of `key`'s signature (the plan chose to replay `key`). The
    /// body runs once, in the capture, whatever the result.
    pub(crate) fn guard<F, E>(
        &mut self,
        key: NodeKey,
        frame: &mut Frame<'_, F, M, E>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        self.check_owned_outputs(key, frame)?;
        self.guard_requested = false;
        let name = self.functions[frame.function].name.clone();
        let _span = tracing::debug_span!("guard", function = %name, node = %key.id()).entered();
        let parent = self.tree.parent(key);
        let call = self.tree[key].replays + 1;
        self.stats.guards += 1;
        self.diverge_if_replayed(frame.function);
        let pending = match self.capture_once(frame, parent, &mut None) {
            Ok(pending) => pending,
            Err(Failure::Call(error)) => return Err(error),
            Err(Failure::Capture(error)) => match fallback_reason(error) {
                Ok(why) => {
                    tracing::warn!(reason = %why, "a guard could not capture the body: the recording is no longer guarded");
                    self.move_guard(key, Found::CannotCompare);
                    return self.replay(key, frame);
                }
                Err(source) => {
                    return Err(CallError::Body {
                        function: name,
                        source,
                    });
                }
            },
            Err(Failure::OutOfMemory(source)) => {
                tracing::warn!(error = %source, "a guard ran out of device memory capturing the body: the recording is no longer guarded");
                self.move_guard(key, Found::CannotCompare);
                return self.replay(key, frame);
            }
        };
        let compared = self
            .device
            .compare(&self.tree[key].graph, &pending.captured.graph);
        let differences = match compared {
            Ok(Some(differences)) => differences,
            Ok(None) => {
                tracing::warn!(device = %self.device.describe(), "the device cannot compare graphs: guards are off for this recording");
                self.discard(pending)?;
                self.move_guard(key, Found::CannotCompare);
                return self.replay(key, frame);
            }
            Err(source) => {
                self.discard(pending)?;
                return Err(CallError::Device {
                    function: name,
                    source,
                });
            }
        };
        let expected = Expected::new(&self.tree[key], &pending, frame.addrs);
        let found: Vec<GraphDifference> = differences
            .into_iter()
            .filter(|d| !expected.explains(d))
            .collect();
        if found.is_empty() {
            tracing::trace!(call, "guard: the capture equals the recording");
            self.discard(pending)?;
            self.move_guard(key, Found::Equal { call });
            return self.replay(key, frame);
        }
        self.stats.guard_differences += 1;
        let first = self.tree[key].guard != Guard::Always;
        for difference in found {
            let finding = GuardFinding {
                function: name.to_string(),
                node: key.id(),
                call,
                difference,
            };
            if self.guard_findings.iter().any(|f| same_place(f, &finding)) {
                continue;
            }
            if first {
                tracing::warn!("{finding}");
            }
            self.guard_findings.push(finding);
        }
        drop(self.evict(key, EvictReason::Replaced));
        let outcome = self.keep_capture(frame, parent, RecordReason::HostValueChanged, pending)?;
        if let Outcome::Recorded(id) = outcome
            && self.tree.get(key_of(id)).is_some()
        {
            self.move_guard(key_of(id), Found::Different);
        }
        Ok(outcome)
    }

    /// Moves `key`'s guard state; a node that is not guarded stays so.
    fn move_guard(&mut self, key: NodeKey, found: Found) {
        let guards = self.config.guards.unwrap_or_default();
        let node = &mut self.tree[key];
        // An unguarded node (guards turned off in between, or a replacement in a group)
        // stays unguarded.
        let _ = transition(&mut node.guard, found, guards);
    }
}

/// Two findings of the same value: the same function, kernel and argument (or the same
/// other difference), found at any call.
fn same_place(a: &GuardFinding, b: &GuardFinding) -> bool {
    use GraphDifference::Argument;
    a.function == b.function
        && match (&a.difference, &b.difference) {
            (
                Argument {
                    node: n, index: i, ..
                },
                Argument {
                    node: m, index: j, ..
                },
            ) => n == m && i == j,
            (x, y) => std::mem::discriminant(x) == std::mem::discriminant(y),
        }
}

/// The address changes graft expects between a recording and a new capture of its body:
/// `(start, len, now)` moves `[start, start + len)` to `now`. The capture allocates the same
/// sequence as the recording (its i-th allocation is the recording's i-th, at whatever
/// address the pool gives it now); the caller's copied and in-place inputs are where this
/// call passes them; delivered outputs' copies write the capture's own placeholders.
struct Expected {
    moves: Vec<(u64, u64, u64)>,
}

impl Expected {
    fn new<G, M>(node: &Node<G, M>, fresh: &Pending<G, M>, addrs: &[DevicePtr]) -> Expected {
        let captured = &fresh.captured;
        let fresh_allocs = captured
            .allocs
            .iter()
            .chain(&fresh.prepared.placeholders)
            .map(|c| (c.addr(), c.len()));
        let mut moves: Vec<(u64, u64, u64)> = node
            .allocated
            .iter()
            .zip(fresh_allocs)
            .filter(|(a, b)| a.1 == b.1)
            .map(|(a, b)| (a.0.0, a.1 as u64, b.0.0))
            .collect();
        for (slot, now) in node.inputs.iter().zip(addrs) {
            let now = now.0;
            match *slot {
                InputSlot::Copied {
                    source,
                    len,
                    write_back,
                    ..
                } => {
                    moves.push((source.0, len as u64, now));
                    moves.extend(write_back.map(|w| (w.0, len as u64, now)));
                }
                InputSlot::InPlace {
                    recorded, at, len, ..
                } => {
                    moves.push((recorded.0, len as u64, now));
                    moves.push((at.0, len as u64, now));
                }
                InputSlot::Static { .. } | InputSlot::Managed { .. } => {}
            }
        }
        moves.extend(delivered_moves(&node.outputs, &captured.outputs));
        Expected { moves }
    }

    /// Where graft expects the recorded address `addr` in the new capture.
    fn predict(&self, addr: u64) -> Option<u64> {
        self.moves
            .iter()
            .find(|&&(start, len, _)| addr >= start && addr < start + len.max(1))
            .map(|&(start, _, now)| now + (addr - start))
    }

    fn moved(&self, recorded: DevicePtr, now: DevicePtr) -> bool {
        recorded == now || self.predict(recorded.0) == Some(now.0)
    }

    /// Whether graft's bookkeeping predicts this difference (an address that moved as
    /// expected).
    fn explains(&self, difference: &GraphDifference) -> bool {
        match difference {
            GraphDifference::Argument { .. } => difference
                .as_addresses()
                .is_some_and(|(recorded, now)| self.predict(recorded) == Some(now)),
            GraphDifference::Copy { recorded, now, .. } => {
                recorded.1 == now.1
                    && self.moved(recorded.0.dst, now.0.dst)
                    && self.moved(recorded.0.src, now.0.src)
            }
            GraphDifference::Memset { recorded, now, .. } => self.moved(*recorded, *now),
            GraphDifference::Shape { .. }
            | GraphDifference::Function { .. }
            | GraphDifference::Launch { .. } => false,
        }
    }
}

/// A delivered output's copy writes the caller's memory of the last call in the recording
/// and the capture's placeholder in the capture.
fn delivered_moves<'a, M>(
    recorded: &'a [NodeOutput<M>],
    now: &'a [NodeOutput<M>],
) -> impl Iterator<Item = (u64, u64, u64)> + 'a {
    recorded
        .iter()
        .zip(now)
        .filter_map(|(a, b)| match (&a.slot, &b.slot) {
            (
                OutputSlot::Delivered { ends, len, .. },
                OutputSlot::Delivered { ends: fresh, .. },
            ) => Some((ends.dst.0, *len as u64, fresh.dst.0)),
            _ => None,
        })
}
