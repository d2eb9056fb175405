//! A guarded call (see `guard.rs` for the schedule): the body is captured again (ended to be
//! compared, not instantiated), the device compares the capture with the recording node by
//! node, and core keeps the differences its own address bookkeeping does not predict. None:
//! the recording replays and the capture is dropped, never instantiated. Some: the capture is
//! prepared to launch and runs in the recording's place (this call's result is right) and
//! the difference is reported. A value the device can patch (a kernel argument, a copy or
//! memset parameter) keeps the capture as the node, guarded on every call from then on
//! (`Guard::Changing`: captured, or run eagerly where that took less time, until its values
//! settle); any other difference makes the signature eager for good.

use std::time::Instant;

use crate::ctx::Ctx;
use crate::device::{CORE, Device, DevicePtr, GraphDifference};
use crate::error::{BodyError, CallError};
use crate::graft::{Frame, Graft, Outcome};
use crate::guard::{Found, Guard, GuardFinding, transition};
use crate::reason::{EagerReason, EvictReason, RecordReason};
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
        let started = Instant::now();
        if let Guard::Changing(changing) = self.tree[key].guard
            && changing.runs_eagerly()
        {
            self.move_guard(key, Found::RanEagerly { at: started });
            return self.run_eager(frame, EagerReason::HostValueChanging);
        }
        let parent = self.tree.parent(key);
        let call = self.tree[key].replays + 1;
        self.stats.guards += 1;
        self.diverge_if_replayed(frame.function);
        let mut pending = match self.capture_once(frame, parent, Some(key), &mut None) {
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
        let Some(first) = found.first().cloned() else {
            tracing::trace!(call, "guard: the capture equals the recording");
            self.discard(pending)?;
            self.move_guard(key, Found::Equal { call, at: started });
            return self.replay(key, frame);
        };
        let state = self.tree[key].guard;
        let patchable = found.iter().all(GraphDifference::patchable) && state != Guard::Off;
        self.stats.guard_differences += 1;
        let finding = |difference| GuardFinding {
            function: name.to_string(),
            node: key.id(),
            call,
            difference,
        };
        // Every new difference is kept, each value once; the first names the fallback. A
        // changing node warns of each new one (a fallback warns below, with its reason).
        for f in found.into_iter().map(finding) {
            if !self.guard_findings.iter().any(|g| same_place(g, &f)) {
                if patchable {
                    tracing::warn!(
                        "{f}; every call of it is guarded from now on (captured, or run eagerly where that is faster) until the value settles"
                    );
                }
                self.guard_findings.push(f);
            }
        }
        // The capture was ended to be compared: it launches only now that it differs.
        if let Err(source) = self
            .device
            .prepare_launch(CORE, &mut pending.captured.graph)
        {
            self.discard(pending)?;
            // The recording holds a value the capture showed changed: it never replays again.
            let why = EagerReason::HostValueBaked {
                finding: Box::new(finding(first)),
            };
            tracing::warn!(reason = %why, error = %source, "the capture that differs from the recording could not be prepared to launch; the signature runs eagerly from now on");
            self.stats.fallbacks += 1;
            self.functions[frame.function].sigs[frame.sig].eager = Some(why);
            drop(self.evict(key, EvictReason::HostValueBaked));
            return Err(CallError::Device {
                function: name,
                source,
            });
        }
        drop(self.evict(key, EvictReason::Replaced));
        // This call runs the new capture (the body ran once, in it: its result is right).
        let outcome = self.keep_capture(frame, parent, RecordReason::HostValueChanged, pending)?;
        if patchable {
            // The capture stays as the node, every call guarded from now on.
            tracing::debug!(call, difference = %first, "a guard found a host value changed: the capture takes the recording's place");
            if let Outcome::Recorded(id) = outcome
                && let Some(node) = self.tree.get_mut(key_of(id))
            {
                let mut guard = state;
                let guards = self.config.guards.unwrap_or_default();
                if transition(&mut guard, Found::Changed { at: started }, guards).is_ok() {
                    node.guard = guard;
                }
            }
            return Ok(outcome);
        }
        // Any other difference: every later call of the signature runs eagerly, and the
        // capture is freed after its launch.
        let why = EagerReason::HostValueBaked {
            finding: Box::new(finding(first)),
        };
        let _span = tracing::info_span!("fallback", function = %name).entered();
        tracing::warn!(reason = %why, "a guard found a host value baked into the recording; the signature runs eagerly from now on");
        self.stats.fallbacks += 1;
        self.functions[frame.function].sigs[frame.sig].eager = Some(why);
        if let Outcome::Recorded(id) = outcome
            && self.tree.get(key_of(id)).is_some()
        {
            self.free_retired(key_of(id), parent, EvictReason::HostValueBaked)?;
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

    /// Whether graft expects the recorded address `recorded` at `now` in the new capture:
    /// the same address, or one offset into a range that moved. Any range may explain it: an
    /// address the pool reused within the recording lies in several allocations, and the
    /// capture may not reuse it the same way.
    fn moved(&self, recorded: u64, now: u64) -> bool {
        recorded == now
            || self.moves.iter().any(|&(start, len, to)| {
                recorded >= start && recorded - start < len.max(1) && now == to + (recorded - start)
            })
    }

    /// Whether graft's bookkeeping predicts this difference (addresses that moved as
    /// expected). A kernel argument is compared by 8-byte word, as pointers sit in kernel
    /// parameters (one pointer, or a parameter struct such as a library kernel's).
    fn explains(&self, difference: &GraphDifference) -> bool {
        let word = |c: &[u8]| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        match difference {
            GraphDifference::Argument { recorded, now, .. } => {
                recorded.len() == now.len()
                    && recorded.len().is_multiple_of(8)
                    && recorded
                        .chunks_exact(8)
                        .zip(now.chunks_exact(8))
                        .all(|(a, b)| self.moved(word(a), word(b)))
            }
            GraphDifference::Copy { recorded, now, .. } => {
                recorded.1 == now.1
                    && self.moved(recorded.0.dst.0, now.0.dst.0)
                    && self.moved(recorded.0.src.0, now.0.src.0)
            }
            GraphDifference::Memset { recorded, now, .. } => self.moved(recorded.0, now.0),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn argument(recorded: &[u64], now: &[u64]) -> GraphDifference {
        let bytes = |w: &[u64]| -> Box<[u8]> { w.iter().flat_map(|x| x.to_le_bytes()).collect() };
        GraphDifference::Argument {
            node: 0,
            kernel: "k".into(),
            index: 0,
            recorded: bytes(recorded),
            now: bytes(now),
        }
    }

    // The pool reused 0x1000 within the recording (two allocations there); the capture put
    // them at 0x5000 and 0x6000.
    fn expected() -> Expected {
        Expected {
            moves: vec![(0x1000, 0x100, 0x5000), (0x1000, 0x100, 0x6000)],
        }
    }

    #[test]
    fn a_parameter_struct_with_moved_pointers_is_explained_word_by_word() {
        let e = expected();
        // A library kernel's parameter struct: two pointers and a count.
        assert!(e.explains(&argument(&[0x1010, 0x9999, 7], &[0x5010, 0x9999, 7])));
        assert!(e.explains(&argument(&[0x1010, 0x1020], &[0x5010, 0x6020])));
        // A host value inside the struct is a difference.
        assert!(!e.explains(&argument(&[0x1010, 7], &[0x5010, 8])));
        // A pointer that moved where graft does not expect it is one too.
        assert!(!e.explains(&argument(&[0x1010], &[0x7010])));
        // A value that is not whole words cannot be read as addresses.
        let odd = GraphDifference::Argument {
            node: 0,
            kernel: "k".into(),
            index: 0,
            recorded: Box::new([1, 2, 3, 4]),
            now: Box::new([1, 2, 3, 5]),
        };
        assert!(!e.explains(&odd));
    }

    #[test]
    fn an_address_reused_within_the_recording_may_move_to_either_allocation() {
        let e = expected();
        assert!(e.explains(&argument(&[0x10f0], &[0x50f0])));
        assert!(e.explains(&argument(&[0x10f0], &[0x60f0])));
        assert!(
            !e.explains(&argument(&[0x1100], &[0x5100])),
            "one past the end"
        );
    }
}
