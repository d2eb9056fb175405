//! The capture itself: classifying the inputs (static, managed, in place, copied into
//! placeholders), capturing the input copies, the body and the copies back of written inputs,
//! ending or aborting the capture, and turning the body's outputs into node output slots.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;

use crate::buffer::{Buffer, Cell};
use crate::ctx::{Ctx, Reclaim, RunKind, Scope, alloc_owned};
use crate::device::{CORE, CaptureViolation, CopyEnds, Device, DeviceError, DeviceOp, DevicePtr};
use crate::error::{BodyError, CallError, FunctionId};
use crate::graft::{Frame, Graft};
use crate::lifecycle::Phase;
use crate::pool::{Checkpoint, PoolError};
use crate::pools::lock;
use crate::reason::Decision;
use crate::tree::{InputSlot, NodeKey, NodeOutput, Output, OutputSlot, key_of};

/// What a recording prepares before the capture begins.
pub(super) struct Prepared {
    /// How the node uses each input.
    pub(super) slots: Vec<InputSlot>,
    /// The inputs the body sees: placeholders in place of copied inputs.
    pub(super) ctx_inputs: Vec<Buffer>,
    /// The placeholders' cells.
    pub(super) placeholders: Vec<Arc<Cell>>,
    /// Memory the graph writes, so far: the placeholders.
    pub(super) footprint: Vec<(u64, u64)>,
}

/// Why a capture failed, with the cells the body allocated before it did.
pub(super) type CaptureFailure<E> = (BodyError<E>, Vec<Arc<Cell>>);

/// What a successful capture produced.
pub(super) struct Captured<G, M> {
    pub(super) graph: G,
    pub(super) outputs: Vec<NodeOutput<M>>,
    /// Cells the body allocated.
    pub(super) allocs: Vec<Arc<Cell>>,
    /// The body's own handles, held until the caller's are made, so that no output block is
    /// freed in between.
    pub(super) keep: Vec<Buffer>,
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// Classifies the inputs (static: declared or marked; managed: an output of a node on the
    /// path in this generation, of this runtime; in place: marked, unless the signature copies
    /// it since it moved where a recording could not follow it, and any input that overlaps
    /// another; copied: everything else)
    /// and allocates a placeholder for each copied one. A guard's capture (`like`: the node it
    /// guards) copies what that node copies, so that the two graphs compare node for node: a
    /// node recorded with a copied input replays for a managed one too. On error, returns the
    /// placeholders made so far.
    pub(super) fn prepare_inputs<F, E>(
        &mut self,
        frame: &Frame<'_, F, M, E>,
        parent: Option<NodeKey>,
        like: Option<NodeKey>,
    ) -> Result<Prepared, (Vec<Arc<Cell>>, PoolError)> {
        let function = &self.functions[frame.function];
        let name = function.name.clone();
        let spec_static = function.spec.static_inputs.clone();
        let mutated = function.sigs[frame.sig].mutated.clone();
        let copy_in_place = function.sigs[frame.sig].copy_in_place.clone();
        let generation = self.generation;
        let path = self.tree.path_nodes(parent);
        let copied_by_like = |position: usize| {
            like.is_some_and(|key| {
                matches!(
                    self.tree[key].inputs.get(position),
                    Some(InputSlot::Copied { .. })
                )
            })
        };
        let copy: Vec<bool> = (0..frame.inputs.len()).map(copied_by_like).collect();
        // An in-place input stays in place where the signature does not copy it, or where
        // `like` took it in place (recorded before the signature began to copy it).
        let in_place = |position: usize| {
            !copy_in_place.contains(&position)
                || like.is_some_and(|key| {
                    matches!(
                        self.tree[key].inputs.get(position),
                        Some(InputSlot::InPlace { .. })
                    )
                })
        };
        let n = frame.inputs.len();
        // Inputs that overlap another input: copying one would hide the body's writes through
        // the other, so both are used in place, where they are.
        let range = |i: usize| {
            let at = frame.addrs[i].0;
            (at, at + frame.inputs[i].len() as u64)
        };
        let aliased: Vec<bool> = (0..n)
            .map(|i| {
                let (s, e) = range(i);
                s < e
                    && (0..n).any(|j| {
                        let (os, oe) = range(j);
                        j != i && os < oe && os < e && s < oe
                    })
            })
            .collect();
        let mut p = Prepared {
            slots: Vec::with_capacity(n),
            ctx_inputs: Vec::with_capacity(n),
            placeholders: Vec::new(),
            footprint: Vec::new(),
        };
        for (position, b) in frame.inputs.iter().enumerate() {
            let addr = frame.addrs[position];
            let cell = b.cell();
            // Identity first: node ids and generations of another runtime mean nothing here,
            // so a buffer of another runtime's pool is never managed (it is copied).
            let managed = cell.in_pool(self.pools.graph())
                && cell.generation() == generation
                && cell.node().is_some_and(|n| path.contains(&key_of(n)))
                && !b.is_empty()
                && !copy[position];
            let (slot, handle) = if spec_static.contains(&position) || cell.is_static() {
                (InputSlot::Static { addr }, (*b).clone())
            } else if managed {
                (InputSlot::Managed { addr }, (*b).clone())
            } else if aliased[position] || (cell.is_in_place() && in_place(position)) {
                let slot = InputSlot::InPlace {
                    recorded: addr,
                    at: addr,
                    len: b.len(),
                    follows: false,
                    overlaps: None,
                };
                (slot, (*b).clone())
            } else if b.is_empty() {
                let slot = InputSlot::Copied {
                    placeholder: DevicePtr(0),
                    len: 0,
                    source: addr,
                    write_back: None,
                    reads: None,
                };
                (slot, (*b).clone())
            } else {
                // No reclaiming here: a checkpoint is pending.
                let placed = alloc_owned(
                    self.pools.graph(),
                    &self.device,
                    b.len(),
                    name.clone(),
                    generation,
                    Reclaim::Never,
                );
                let (cell, handle) = match placed {
                    Ok(placed) => placed,
                    Err(e) => return Err((p.placeholders, e)),
                };
                let at = cell.addr();
                p.placeholders.push(cell);
                p.footprint.push((at.0, at.0 + b.len() as u64));
                let slot = InputSlot::Copied {
                    placeholder: at,
                    len: b.len(),
                    source: addr,
                    write_back: mutated.contains(&position).then_some(addr),
                    reads: None,
                };
                (slot, handle)
            };
            p.slots.push(slot);
            p.ctx_inputs.push(handle);
        }
        Ok(p)
    }

    /// The first external input (memory graft does not own) that lies inside one of graft's
    /// own pools, with its address: graft's memory passed as if it were someone else's, whose
    /// reuse graft could not see.
    pub(super) fn external_in_pool(&self, inputs: &[&Buffer]) -> Option<(usize, DevicePtr)> {
        let ranges = [self.pools.graph(), self.pools.eager()].map(|p| lock(p).reservation());
        inputs.iter().enumerate().find_map(|(position, b)| {
            let at = b.addr().ok()?;
            let (s, e) = (at.0, at.0 + b.len() as u64);
            let inside = ranges
                .iter()
                .flatten()
                .any(|&(base, size)| s < base.0 + size as u64 && base.0 < e.max(s + 1));
            (b.cell().is_external() && inside).then_some((position, at))
        })
    }

    /// Captures the body: the input copies first, then the body, then the copies back of
    /// written inputs. On failure the capture is aborted and the error returned with what the
    /// body allocated. A panicking body leaves graft as it was (capture aborted, pool rolled
    /// back, phase restored), then the panic continues. With `to_compare` (a guard's capture)
    /// the graph is ended to be compared, not prepared to launch
    /// ([`Device::end_capture_to_compare`]).
    pub(super) fn capture<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        prepared: &Prepared,
        checkpoint: &Checkpoint,
        previous: Phase,
        reuse: &mut Option<D::Graph>,
        to_compare: bool,
    ) -> Result<Captured<D::Graph, M>, CaptureFailure<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        if let Err(e) = self.device.begin_capture(CORE, self.config.capture_mode) {
            return Err((BodyError::Device(e), Vec::new()));
        }
        let name = self.functions[frame.function].name.clone();
        let mut ctx = Ctx {
            device: &self.device,
            inputs: &prepared.ctx_inputs,
            pool: self.pools.graph(),
            sibling: self.pools.eager(),
            function: &name,
            generation: self.generation,
            kind: RunKind::Recording,
            allocs: Vec::new(),
            scope: Scope::Top,
        };
        let slots = &prepared.slots;
        let ran = catch_unwind(AssertUnwindSafe(|| {
            copy_inputs(ctx.device, slots)?;
            (frame.body)(&mut ctx)
        }));
        let mut keep = Vec::new();
        let delivers = frame.dests.is_some();
        let captured = match ran {
            Ok(ran) => ran
                .and_then(|outs| classify_outputs(&mut ctx, slots, outs, delivers, &mut keep))
                .and_then(|outs| copy_back(ctx.device, slots).map(|()| outs)),
            Err(panic) => {
                let allocs = std::mem::take(&mut ctx.allocs);
                drop(ctx);
                if let Some(member) = &self.member {
                    member.abandon(self.subject(frame));
                }
                let _: bool = self.abort_capture();
                // Recording may always return to the phase it began from.
                let _: Result<(), CallError> = self.move_to(previous);
                self.undo_recording(checkpoint, &prepared.placeholders, &allocs);
                tracing::warn!(function = %name, "the body panicked during a recording; the capture was aborted and the pool rolled back");
                resume_unwind(panic);
            }
        };
        let allocs = std::mem::take(&mut ctx.allocs);
        drop(ctx);
        match captured {
            Ok(outputs) => match self.end_capture(frame.function, reuse, to_compare) {
                Ok(graph) => Ok(Captured {
                    graph,
                    outputs,
                    allocs,
                    keep,
                }),
                Err(e) => Err((BodyError::Device(e), allocs)),
            },
            Err(e) => {
                let invalidated = self.abort_capture();
                Err((violation_first(e, invalidated), allocs))
            }
        }
    }

    /// Ends a successful capture: to be compared only (`to_compare`), or updating the
    /// replaced node's executable in place when there is one and the device accepts, else
    /// instantiating.
    pub(super) fn end_capture(
        &mut self,
        function: FunctionId,
        reuse: &mut Option<D::Graph>,
        to_compare: bool,
    ) -> Result<D::Graph, DeviceError> {
        if to_compare {
            return self.device.end_capture_to_compare(CORE);
        }
        let Some(mut graph) = reuse.take() else {
            return self.device.end_capture(CORE);
        };
        match self.device.end_capture_into(CORE, &mut graph)? {
            None => {
                tracing::debug!("executable updated in place");
                self.stats.updates_in_place += 1;
            }
            Some(refusal) => {
                tracing::debug!(%refusal, "in-place update refused; instantiated instead");
                self.stats.update_refusals += 1;
                self.log(function, None, Decision::UpdateRefused { reason: refusal });
            }
        }
        Ok(graph)
    }

    /// Ends a failed capture and returns whether an operation the capture forbids had
    /// invalidated it; an error doing so cannot be returned (another one is being returned),
    /// so it goes to the sticky slot and the next call returns it.
    pub(super) fn abort_capture(&self) -> bool {
        self.device.abort_capture(CORE).unwrap_or_else(|abort| {
            self.device.record_sticky_error(CORE, abort);
            false
        })
    }
}

/// A body's error from a capture that an operation had invalidated: the capture violation,
/// whatever the body made of it. A framework that wraps the device's error in its own type
/// (`BodyError::Framework`) hides what broke the capture; the device does not, so the call
/// falls back to eager execution as it would for `BodyError::Device`.
fn violation_first<E>(error: BodyError<E>, invalidated: bool) -> BodyError<E> {
    match error {
        BodyError::Device(_) => error,
        _ if invalidated => {
            tracing::debug!("the body's error hides a capture violation: treated as the violation");
            BodyError::Device(DeviceError::Capture {
                op: DeviceOp::EndCapture,
                violation: CaptureViolation::Invalidated,
            })
        }
        _ => error,
    }
}

/// Records the input copies, the first nodes of the graph, so a replay needs no separate copy.
fn copy_inputs<D: Device, E>(device: &D, slots: &[InputSlot]) -> Result<(), BodyError<E>> {
    for slot in slots {
        if let InputSlot::Copied {
            placeholder,
            len,
            source,
            ..
        } = *slot
            && len > 0
        {
            device.copy(CORE, placeholder, source, len)?;
        }
    }
    Ok(())
}

/// Records the copies back of inputs the body writes, the last nodes of the graph.
fn copy_back<D: Device, E>(device: &D, slots: &[InputSlot]) -> Result<(), BodyError<E>> {
    for slot in slots {
        if let InputSlot::Copied {
            placeholder,
            len,
            write_back: Some(dst),
            ..
        } = *slot
        {
            device.copy(CORE, dst, placeholder, len)?;
        }
    }
    Ok(())
}

/// Turns the body's outputs into node output slots, copying (inside the capture) any
/// output that is not memory this body allocated, a static input, or empty. With `delivers`
/// every non-empty output is copied, as the graph's last nodes, into a placeholder whose copy
/// a launch re-points to the caller's memory ([`OutputSlot::Delivered`]). The body's handles
/// to external memory (what it made through its framework) are dropped here, inside the
/// capture, so that the framework's frees are captured too; the others are kept until the
/// caller's handles are made.
fn classify_outputs<D: Device, M, E>(
    ctx: &mut Ctx<'_, D>,
    slots: &[InputSlot],
    outs: Vec<Output<M>>,
    delivers: bool,
    keep: &mut Vec<Buffer>,
) -> Result<Vec<NodeOutput<M>>, BodyError<E>> {
    let mut result: Vec<NodeOutput<M>> = Vec::with_capacity(outs.len());
    let mut seen: Vec<Arc<Cell>> = Vec::with_capacity(outs.len());
    for o in outs {
        let cell = o.buffer.cell().clone();
        let slot = if o.buffer.is_empty() {
            OutputSlot::Empty(cell.clone())
        } else if delivers {
            let src = o.buffer.addr()?;
            let placeholder = ctx.alloc(o.buffer.len())?;
            let dst = placeholder.addr()?;
            ctx.device.copy(CORE, dst, src, o.buffer.len())?;
            keep.push(placeholder);
            OutputSlot::Delivered {
                ends: CopyEnds { dst, src },
                len: o.buffer.len(),
                after: false,
            }
        } else if let Some(p) = ctx.inputs.iter().enumerate().position(|(p, b)| {
            matches!(slots[p], InputSlot::Static { .. }) && b.same_storage(&o.buffer)
        }) {
            OutputSlot::StaticInput(p)
        } else if let Some(j) = seen.iter().position(|c| Arc::ptr_eq(c, &cell)) {
            OutputSlot::Alias(j)
        } else if ctx.allocs.iter().any(|c| Arc::ptr_eq(c, &cell)) {
            OutputSlot::Tracked {
                cell: cell.clone(),
                spares: Vec::new(),
            }
        } else {
            let src = o.buffer.addr()?;
            let copy = ctx.alloc(o.buffer.len())?;
            ctx.device.copy(CORE, copy.addr()?, src, o.buffer.len())?;
            let slot = OutputSlot::Tracked {
                cell: copy.cell().clone(),
                spares: Vec::new(),
            };
            keep.push(copy);
            slot
        };
        if !cell.is_external() {
            keep.push(o.buffer);
        }
        seen.push(cell);
        result.push(NodeOutput { slot, meta: o.meta });
    }
    Ok(result)
}
