//! Recording: classify the inputs, capture the body into a graph, attach it to the tree as a
//! node, launch it once. A failed capture rolls everything back and falls back to eager.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;

use crate::buffer::{Buffer, Cell};
use crate::ctx::{Ctx, Reclaim, RunKind, alloc_owned, release_unused};
use crate::device::{CORE, Device, DeviceError, DeviceOp, DevicePtr};
use crate::error::{BodyError, CallError, FunctionId};
use crate::graft::{Frame, Graft, Outcome, lock, shape_hash};
use crate::group::{Subject, Verdict, Vote};
use crate::lifecycle::Phase;
use crate::pool::{Checkpoint, PoolError};
use crate::reason::{Decision, EagerReason, RecordReason};
use crate::tree::{self, InputSlot, Node, NodeKey, NodeOutput, Output, OutputSlot, key_of};

/// What a recording prepares before the capture begins.
struct Prepared {
    /// How the node uses each input.
    slots: Vec<InputSlot>,
    /// The inputs the body sees: placeholders in place of copied inputs.
    ctx_inputs: Vec<Buffer>,
    /// The placeholders' cells.
    placeholders: Vec<Arc<Cell>>,
    /// Memory the graph writes, so far: the placeholders.
    footprint: Vec<(u64, u64)>,
}

/// Why a capture failed, with the cells the body allocated before it did.
type CaptureFailure = (BodyError, Vec<Arc<Cell>>);

/// What a successful capture produced.
struct Captured<G, M> {
    graph: G,
    outputs: Vec<NodeOutput<M>>,
    /// Cells the body allocated.
    allocs: Vec<Arc<Cell>>,
    /// The body's own handles, held until the caller's are made, so that no output block is
    /// freed in between.
    keep: Vec<Buffer>,
}

/// How one try at a capture failed, with the recording already undone.
enum Failure {
    /// The device ran out of memory: worth one more try after releasing unused memory.
    OutOfMemory(PoolError),
    /// The body or the device failed the capture: a fallback or an error, by its kind.
    Capture(BodyError),
    /// An error the call returns as it is.
    Call(CallError),
}

/// A capture that succeeded, not yet attached or launched: what the group votes on.
struct Pending<G, M> {
    prepared: Prepared,
    captured: Captured<G, M>,
    checkpoint: Checkpoint,
    /// The phase the recording began from.
    previous: Phase,
}

/// How this rank's recording ended, before (and after) the group's vote.
enum Local<G, M> {
    Captured(Pending<G, M>),
    FallBack(EagerReason),
    Failed(CallError),
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// Records the body under `parent` (a root when none) and launches the graph once.
    /// `reuse` is the graph of the node this recording replaces: its executable is updated in
    /// place when the device accepts the new capture (see [`Device::end_capture_into`]). When
    /// the device runs out of memory while recording, the recording is undone, memory no
    /// block and no graph uses is released from both pools, and the recording is tried once
    /// more (releasing is illegal during a capture and while the pool's checkpoint is pending).
    /// In a group, the ranks then agree on the outcome before anything is launched.
    pub(crate) fn record<F>(
        &mut self,
        frame: &mut Frame<'_, F, M>,
        parent: Option<NodeKey>,
        reason: RecordReason,
        mut reuse: Option<D::Graph>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let name = self.functions[frame.function.0].name.clone();
        let span = tracing::debug_span!("record", function = %name, reason = %reason);
        let _span = span.enter();
        self.diverge_if_replayed(frame.function);
        let attempt = match self.capture_once(frame, parent, &mut reuse) {
            Err(Failure::OutOfMemory(_)) => {
                let released = release_unused(&mut lock(&self.graph_pool), &self.device)
                    + release_unused(&mut lock(&self.eager_pool), &self.device);
                tracing::debug!(
                    released,
                    "out of device memory while recording: released unused pool memory, retrying"
                );
                self.capture_once(frame, parent, &mut reuse)
            }
            attempt => attempt,
        };
        let local = match attempt {
            Ok(pending) => Local::Captured(pending),
            Err(Failure::OutOfMemory(source)) => Local::Failed(CallError::Pool {
                function: name.clone(),
                source,
            }),
            Err(Failure::Capture(error)) => match fallback_reason(error) {
                Ok(why) => Local::FallBack(why),
                Err(source) => Local::Failed(CallError::Body {
                    function: name.clone(),
                    source,
                }),
            },
            Err(Failure::Call(error)) => Local::Failed(error),
        };
        match self.agree(frame, local) {
            Local::Captured(Pending {
                prepared, captured, ..
            }) => {
                let (key, keep) = self.attach(frame, parent, reason, prepared, captured);
                let outcome = self.first_launch(key, frame);
                drop(keep);
                outcome
            }
            Local::FallBack(why) => self.capture_failed(frame, parent, why),
            Local::Failed(error) => Err(error),
        }
    }

    /// In a group: votes this rank's outcome and turns it into the group's. A rank that
    /// captured but is outvoted discards its capture (the pool and the phase as they were).
    /// Alone: the outcome as it is.
    fn agree<F>(
        &mut self,
        frame: &Frame<'_, F, M>,
        local: Local<D::Graph, M>,
    ) -> Local<D::Graph, M> {
        let Some(member) = &self.member else {
            return local;
        };
        let vote = match &local {
            Local::Captured(_) => Vote::Recorded,
            Local::FallBack(_) => Vote::FellBack,
            Local::Failed(_) => Vote::Failed,
        };
        let _span = tracing::debug_span!("agree", rank = member.rank()).entered();
        let verdict = member.agree(vote, self.subject(frame));
        self.stats.agreements += 1;
        let function = self.functions[frame.function.0].name.clone();
        let agreed = match verdict {
            Ok(v) if v.vote == vote => return local,
            Ok(Verdict {
                vote: Vote::FellBack,
                rank,
            }) => Local::FallBack(EagerReason::PeerCaptureFailed { rank }),
            Ok(Verdict { rank, .. }) => Local::Failed(CallError::PeerFailed { function, rank }),
            Err(source) => Local::Failed(CallError::Group { function, source }),
        };
        tracing::debug!(?vote, "outvoted by the group");
        match local {
            Local::Captured(pending) => match self.discard(pending) {
                Ok(()) => agreed,
                Err(e) => Local::Failed(e),
            },
            _ => agreed,
        }
    }

    /// What the group votes this call records: the function and its signature's shape.
    fn subject<F>(&self, frame: &Frame<'_, F, M>) -> Subject {
        let sig = &self.functions[frame.function.0].sigs[frame.sig];
        (
            frame.function.0,
            shape_hash(sig.sizes.iter().copied(), &sig.keys),
        )
    }

    /// Undoes a capture that will never be attached: phase, pool and graph as before it.
    fn discard(&mut self, pending: Pending<D::Graph, M>) -> Result<(), CallError> {
        let Pending {
            prepared,
            captured,
            checkpoint,
            previous,
        } = pending;
        self.move_to(previous)?;
        self.undo_recording(&checkpoint, &prepared.placeholders, &captured.allocs);
        drop(captured);
        Ok(())
    }

    /// One try at a capture, leaving it pending (not attached, not launched). On failure the
    /// recording is undone.
    fn capture_once<F>(
        &mut self,
        frame: &mut Frame<'_, F, M>,
        parent: Option<NodeKey>,
        reuse: &mut Option<D::Graph>,
    ) -> Result<Pending<D::Graph, M>, Failure>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let checkpoint = lock(&self.graph_pool).checkpoint();
        let prepared = match self.prepare_inputs(frame, parent) {
            Ok(prepared) => prepared,
            Err((placeholders, source)) => {
                self.undo_recording(&checkpoint, &placeholders, &[]);
                if matches!(source, PoolError::OutOfMemory { .. }) {
                    return Err(Failure::OutOfMemory(source));
                }
                let function = self.functions[frame.function.0].name.clone();
                return Err(Failure::Call(CallError::Pool { function, source }));
            }
        };
        let previous = self.phase;
        self.move_to(Phase::Recording {
            parent: parent.map(NodeKey::id),
        })
        .map_err(Failure::Call)?;
        match self.capture(frame, &prepared, &checkpoint, previous, reuse) {
            Ok(captured) => Ok(Pending {
                prepared,
                captured,
                checkpoint,
                previous,
            }),
            Err((error, allocs)) => {
                self.move_to(previous).map_err(Failure::Call)?;
                self.undo_recording(&checkpoint, &prepared.placeholders, &allocs);
                drop(prepared);
                match error {
                    BodyError::Pool(source @ PoolError::OutOfMemory { .. }) => {
                        Err(Failure::OutOfMemory(source))
                    }
                    error => Err(Failure::Capture(error)),
                }
            }
        }
    }

    /// Classifies the inputs (static: declared or marked; managed: an output of a node on the
    /// path in this generation, of this runtime; copied: everything else) and allocates a
    /// placeholder for each copied one. On error, returns the placeholders made so far.
    fn prepare_inputs<F>(
        &mut self,
        frame: &Frame<'_, F, M>,
        parent: Option<NodeKey>,
    ) -> Result<Prepared, (Vec<Arc<Cell>>, PoolError)> {
        let function = &self.functions[frame.function.0];
        let name = function.name.clone();
        let spec_static = function.spec.static_inputs.clone();
        let mutated = function.sigs[frame.sig].mutated.clone();
        let generation = self.generation;
        let path = self.path_nodes(parent);
        let n = frame.inputs.len();
        let mut p = Prepared {
            slots: Vec::with_capacity(n),
            ctx_inputs: Vec::with_capacity(n),
            placeholders: Vec::new(),
            footprint: Vec::new(),
        };
        for (position, b) in frame.inputs.iter().enumerate() {
            let addr = self.addrs[position];
            let cell = b.cell();
            // Identity first: node ids and generations of another runtime mean nothing here,
            // so a buffer of another runtime's pool is never managed (it is copied).
            let managed = cell.in_pool(&self.graph_pool)
                && cell.generation() == generation
                && cell.node().is_some_and(|n| path.contains(&key_of(n)))
                && !b.is_empty();
            let (slot, handle) = if spec_static.contains(&position) || cell.is_static() {
                (InputSlot::Static { addr }, (*b).clone())
            } else if managed {
                (InputSlot::Managed { addr }, (*b).clone())
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
                    &self.graph_pool,
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

    /// Captures the body: the input copies first, then the body, then the copies back of
    /// written inputs. On failure the capture is aborted and the error returned with what the
    /// body allocated. A panicking body leaves graft as it was (capture aborted, pool rolled
    /// back, phase restored), then the panic continues.
    fn capture<F>(
        &mut self,
        frame: &mut Frame<'_, F, M>,
        prepared: &Prepared,
        checkpoint: &Checkpoint,
        previous: Phase,
        reuse: &mut Option<D::Graph>,
    ) -> Result<Captured<D::Graph, M>, CaptureFailure>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        if let Err(e) = self.device.begin_capture(CORE, self.config.capture_mode) {
            return Err((BodyError::Device(e), Vec::new()));
        }
        let name = self.functions[frame.function.0].name.clone();
        let mut ctx = Ctx {
            device: &self.device,
            inputs: &prepared.ctx_inputs,
            pool: &self.graph_pool,
            sibling: &self.eager_pool,
            function: &name,
            generation: self.generation,
            kind: RunKind::Recording,
            allocs: Vec::new(),
        };
        let slots = &prepared.slots;
        let ran = catch_unwind(AssertUnwindSafe(|| {
            copy_inputs(ctx.device, slots)?;
            (frame.body)(&mut ctx)
        }));
        let mut keep = Vec::new();
        let captured = match ran {
            Ok(ran) => ran
                .and_then(|outs| classify_outputs(&mut ctx, slots, outs, &mut keep))
                .and_then(|outs| copy_back(ctx.device, slots).map(|()| outs)),
            Err(panic) => {
                let allocs = std::mem::take(&mut ctx.allocs);
                drop(ctx);
                if let Some(member) = &self.member {
                    member.abandon(self.subject(frame));
                }
                self.abort_capture();
                // Recording may always return to the phase it began from.
                let _ = self.move_to(previous);
                self.undo_recording(checkpoint, &prepared.placeholders, &allocs);
                tracing::warn!(function = %name, "the body panicked during a recording; the capture was aborted and the pool rolled back");
                resume_unwind(panic);
            }
        };
        let allocs = std::mem::take(&mut ctx.allocs);
        drop(ctx);
        match captured {
            Ok(outputs) => match self.end_capture(frame.function, reuse) {
                Ok(graph) => Ok(Captured {
                    graph,
                    outputs,
                    allocs,
                    keep,
                }),
                Err(e) => Err((BodyError::Device(e), allocs)),
            },
            Err(e) => {
                self.abort_capture();
                Err((e, allocs))
            }
        }
    }

    /// Ends a successful capture: updates the replaced node's executable in place when there
    /// is one and the device accepts, else instantiates.
    fn end_capture(
        &mut self,
        function: FunctionId,
        reuse: &mut Option<D::Graph>,
    ) -> Result<D::Graph, DeviceError> {
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

    /// Ends a failed capture; an error doing so cannot be returned (another one is being
    /// returned), so it goes to the sticky slot and the next call returns it.
    fn abort_capture(&self) {
        if let Err(abort) = self.device.abort_capture(CORE) {
            self.device.record_sticky_error(CORE, abort);
        }
    }

    /// Makes the captured graph a node of the tree: its footprint, the outputs of the path
    /// that must stay dead for it to replay, its outputs; the path moves to it.
    fn attach<F>(
        &mut self,
        frame: &Frame<'_, F, M>,
        parent: Option<NodeKey>,
        reason: RecordReason,
        prepared: Prepared,
        captured: Captured<D::Graph, M>,
    ) -> (NodeKey, Vec<Buffer>) {
        let Captured {
            graph,
            outputs,
            allocs,
            keep,
        } = captured;
        let mut footprint = prepared.footprint;
        footprint.extend(
            allocs
                .iter()
                .filter(|c| c.len() > 0)
                .map(|c| (c.addr().0, c.end())),
        );
        let mut expected_dead = Vec::new();
        for anc in self.path_nodes(parent) {
            for (i, o) in self.nodes[anc].outputs.iter().enumerate() {
                if let OutputSlot::Tracked { cell, .. } = &o.slot
                    && !cell.is_held()
                {
                    expected_dead.push((anc, i as u16));
                }
            }
        }
        // The counts are diagnostics only: a failure to read them must not fail the call.
        let summary = self.device.summarize(&graph).unwrap_or_else(|error| {
            tracing::warn!(%error, "could not count the nodes of a recorded graph");
            Default::default()
        });
        self.clock += 1;
        let key = self.nodes.insert(Node {
            function: frame.function,
            sig: frame.sig,
            parent,
            children: Vec::new(),
            graph,
            copied: tree::copied_positions(&prepared.slots),
            fixed: tree::fixed_addresses(&prepared.slots),
            inputs: prepared.slots.into_boxed_slice(),
            expected_dead: expected_dead.into_boxed_slice(),
            outputs,
            footprint: tree::merge_ranges(footprint),
            replays: 0,
            last_used: self.clock,
            retired: None,
            recorded_generation: self.generation,
            reason: reason.clone(),
            summary,
        });
        self.register_node(key, allocs, prepared.placeholders, reason);
        (key, keep)
    }

    /// Links a new node into the tree and the registries, and moves the path to it.
    fn register_node(
        &mut self,
        key: NodeKey,
        allocs: Vec<Arc<Cell>>,
        placeholders: Vec<Arc<Cell>>,
        reason: RecordReason,
    ) {
        let id = key.id();
        let function = self.nodes[key].function;
        // What a graph reads or writes stays mapped as long as the graph exists.
        let pins: Vec<(DevicePtr, usize)> = self.nodes[key]
            .footprint
            .iter()
            .map(|&(s, e)| (DevicePtr(s), (e - s) as usize))
            .collect();
        lock(&self.graph_pool).pin(&pins);
        let mut output_cells: Vec<*const Cell> = Vec::new();
        for o in &self.nodes[key].outputs {
            if let OutputSlot::Tracked { cell, .. } = &o.slot {
                cell.set_node(id);
                output_cells.push(Arc::as_ptr(cell));
            }
        }
        tree::link(&mut self.nodes, &mut self.roots, &mut self.slots, key);
        let loose: Vec<Arc<Cell>> = allocs
            .into_iter()
            .chain(placeholders)
            .filter(|c| !output_cells.contains(&Arc::as_ptr(c)))
            .collect();
        crate::graft::list_held(&mut self.handed, &loose);
        self.loose.extend(loose);
        // Recording always ends at its node.
        let _ = self.move_to(Phase::Replaying { tip: id });
        self.stats.recordings += 1;
        self.stats.rerecords.count(&reason);
        tracing::debug!(node = %id, "recorded");
        self.log(function, Some(key), Decision::Record(reason));
    }

    /// Launches a new node once (the recording only captured the work), checks whether the
    /// body wrote a copied input, and hands out the outputs.
    fn first_launch<F>(
        &mut self,
        key: NodeKey,
        frame: &mut Frame<'_, F, M>,
    ) -> Result<Outcome, CallError> {
        let name = self.functions[frame.function.0].name.clone();
        let device_err = |source| CallError::Device {
            function: name.clone(),
            source,
        };
        self.device
            .launch(CORE, &self.nodes[key].graph)
            .map_err(device_err)?;
        self.catch_mutated_inputs(key, frame.sig)
            .map_err(device_err)?;
        self.patch_inputs(key).map_err(device_err)?;
        for o in &self.nodes[key].outputs {
            let buffer = match &o.slot {
                OutputSlot::Tracked { cell, .. } => {
                    let buffer = Buffer::from_cell(cell);
                    crate::graft::list_held(&mut self.handed, [cell]);
                    buffer
                }
                OutputSlot::Empty(cell) => Buffer::from_cell(cell),
                OutputSlot::StaticInput(p) => (*frame.inputs[*p]).clone(),
                OutputSlot::Alias(j) => frame.out[*j].buffer.clone(),
            };
            frame.out.push(Output {
                buffer,
                meta: o.meta.clone(),
            });
        }
        Ok(Outcome::Recorded(key.id()))
    }

    /// After a recording's first launch: a copied input whose placeholder no longer equals the
    /// caller's buffer was written by the body, and the graph left the caller's buffer as it
    /// was. Copies the result back now (so this call behaves as an eager run), retires the
    /// node (it never replays), and makes every later recording of the signature copy the
    /// input back inside its graph.
    fn catch_mutated_inputs(&mut self, key: NodeKey, sig: usize) -> Result<(), DeviceError> {
        let function = self.nodes[key].function;
        let mut found = Vec::new();
        for (position, slot) in self.nodes[key].inputs.iter().enumerate() {
            if let InputSlot::Copied {
                placeholder,
                len,
                source,
                write_back: None,
                ..
            } = *slot
                && len > 0
            {
                let mut now = vec![0u8; len];
                let mut caller = vec![0u8; len];
                self.device.read(CORE, placeholder, &mut now)?;
                self.device.read(CORE, source, &mut caller)?;
                if now != caller {
                    self.device.copy(CORE, source, placeholder, len)?;
                    found.push(position);
                }
            }
        }
        let Some(&first) = found.first() else {
            return Ok(());
        };
        self.nodes[key].retired = Some(first);
        for position in found {
            tracing::warn!(
                function = %self.functions[function.0].name, position,
                "the body writes a copied input in place; graft copies it back to the caller's buffer inside the graph from now on"
            );
            self.functions[function.0].sigs[sig].mutated.push(position);
            self.stats.mutated_inputs += 1;
            self.log(function, Some(key), Decision::InputMutated { position });
        }
        Ok(())
    }

    /// Copy-free inputs: after the first launch showed which copied inputs the body leaves
    /// unchanged, asks the device to patch the graph to read the large ones (at least
    /// `Config::patch_inputs_from` bytes) in the caller's buffer instead of copying them, where
    /// that buffer lies outside the memory the graph writes. A retired node is left alone.
    /// Warns once per input that stays copied and is larger than
    /// `Config::large_copy_warn_bytes`.
    fn patch_inputs(&mut self, key: NodeKey) -> Result<(), DeviceError> {
        let min = self.config.patch_inputs_from.unwrap_or(usize::MAX);
        let node = &mut self.nodes[key];
        if node.retired.is_some() {
            return Ok(());
        }
        for slot in node.inputs.iter_mut() {
            if let InputSlot::Copied {
                placeholder,
                len,
                source,
                write_back: None,
                reads,
            } = slot
                && *len >= min.max(1)
                && !tree::overlaps(&node.footprint, source.0, source.0 + *len as u64)
            {
                let copy = crate::device::CopyEnds {
                    dst: *placeholder,
                    src: *source,
                };
                if self
                    .device
                    .redirect_reads(CORE, &mut node.graph, copy, *len, Some(*source))?
                {
                    *reads = Some(*source);
                    self.stats.patched_inputs += 1;
                }
            }
        }
        let warn_from = self.config.large_copy_warn_bytes;
        for (position, slot) in node.inputs.iter().enumerate() {
            if let InputSlot::Copied {
                len, reads: None, ..
            } = *slot
                && len > warn_from
            {
                tracing::warn!(
                    function = %self.functions[node.function.0].name, position, bytes = len,
                    "a large input is copied on every replay; if its address is stable, declare it static"
                );
            }
        }
        Ok(())
    }

    /// Puts the pool back as it was before a recording began.
    fn undo_recording(
        &mut self,
        checkpoint: &Checkpoint,
        placeholders: &[Arc<Cell>],
        allocs: &[Arc<Cell>],
    ) {
        for c in placeholders.iter().chain(allocs) {
            c.disown();
            c.invalidate_reclaimed();
        }
        lock(&self.graph_pool).rollback(checkpoint);
    }

    /// A capture failed (here, or on another rank of the group): the signature runs eagerly
    /// for good, starting with this call.
    fn capture_failed<F>(
        &mut self,
        frame: &mut Frame<'_, F, M>,
        parent: Option<NodeKey>,
        why: EagerReason,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let function = frame.function;
        let name = self.functions[function.0].name.clone();
        let _span = tracing::info_span!("fallback", function = %name).entered();
        tracing::warn!(reason = %why, "capture failed; the function runs eagerly from now on");
        if !matches!(why, EagerReason::PeerCaptureFailed { .. }) {
            self.stats.capture_failures += 1;
        }
        self.stats.fallbacks += 1;
        self.log(function, parent, Decision::Eager(why.clone()));
        self.functions[function.0].sigs[frame.sig].eager = Some(why);
        self.run_eager(frame)
    }
}

/// Why a failed capture makes the signature eager: a capture violation or a failed
/// instantiation. Any other error is the call's to return.
fn fallback_reason(error: BodyError) -> Result<EagerReason, BodyError> {
    match error {
        BodyError::Device(e) if e.op() == DeviceOp::BeginCapture => {
            Ok(EagerReason::BeginCaptureFailed { error: e })
        }
        BodyError::Device(DeviceError::Capture { op, violation }) => {
            Ok(EagerReason::CaptureFailed { op, violation })
        }
        BodyError::Device(e)
            if matches!(
                e.op(),
                DeviceOp::EndCapture | DeviceOp::Instantiate | DeviceOp::Upload
            ) =>
        {
            Ok(EagerReason::InstantiateFailed { error: e })
        }
        error => Err(error),
    }
}

/// Records the input copies, the first nodes of the graph, so a replay needs no separate copy.
fn copy_inputs<D: Device>(device: &D, slots: &[InputSlot]) -> Result<(), BodyError> {
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
fn copy_back<D: Device>(device: &D, slots: &[InputSlot]) -> Result<(), BodyError> {
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
/// output that is not memory this body allocated, a static input, or empty.
fn classify_outputs<D: Device, M>(
    ctx: &mut Ctx<'_, D>,
    slots: &[InputSlot],
    outs: Vec<Output<M>>,
    keep: &mut Vec<Buffer>,
) -> Result<Vec<NodeOutput<M>>, BodyError> {
    let mut result: Vec<NodeOutput<M>> = Vec::with_capacity(outs.len());
    let mut seen: Vec<Arc<Cell>> = Vec::with_capacity(outs.len());
    for o in outs {
        let cell = o.buffer.cell().clone();
        let slot = if o.buffer.is_empty() {
            OutputSlot::Empty(cell.clone())
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
        seen.push(cell);
        keep.push(o.buffer);
        result.push(NodeOutput { slot, meta: o.meta });
    }
    Ok(result)
}
