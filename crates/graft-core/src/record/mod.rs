//! Recording, the flow: capture the body (retried once after releasing memory when the device
//! runs out), agree on the outcome in a group, attach the graph to the tree as a node, launch
//! it once; a failed capture rolls everything back and falls back to eager.

mod capture;
mod guard;
mod inputs;
mod vote;

use std::sync::Arc;

use crate::buffer::{Buffer, Cell};
use crate::ctx::{Ctx, release_unused};
use crate::device::{CORE, Device, DeviceError, DeviceOp, DevicePtr};
use crate::error::{BodyError, CallError};
use crate::graft::{Frame, Graft, Outcome};
use crate::guard::Guard;
use crate::lifecycle::Phase;
use crate::pool::{Checkpoint, PoolError};
use crate::pools::lock;
use crate::reason::{Decision, EagerReason, EvictReason, RecordReason};
use crate::tree::{self, Node, NodeKey, Output, OutputSlot};

use capture::{Captured, Prepared};
use vote::{Local, Pending};

/// How one try at a capture failed, with the recording already undone.
enum Failure<E> {
    /// The device ran out of memory: worth one more try after releasing unused memory.
    OutOfMemory(PoolError),
    /// The body or the device failed the capture: a fallback or an error, by its kind.
    Capture(BodyError<E>),
    /// An error the call returns as it is.
    Call(CallError<E>),
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// Records the body under `parent` (a root when none) and launches the graph once.
    /// `reuse` is the graph of the node this recording replaces: its executable is updated in
    /// place when the device accepts the new capture (see [`Device::end_capture_into`]). When
    /// the device runs out of memory while recording, the recording is undone, memory no
    /// block and no graph uses is released from both pools, and the recording is tried once
    /// more (releasing is illegal during a capture and while the pool's checkpoint is pending).
    /// In a group, the ranks then agree on the outcome before anything is launched.
    pub(crate) fn record<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        parent: Option<NodeKey>,
        reason: RecordReason,
        mut reuse: Option<D::Graph>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let name = self.functions[frame.function].name.clone();
        let span = tracing::debug_span!("record", function = %name, reason = %reason);
        let _span = span.enter();
        self.diverge_if_replayed(frame.function);
        let attempt = match self.capture_once(frame, parent, None, &mut reuse) {
            Err(Failure::OutOfMemory(_)) => {
                let released = release_unused(&mut lock(self.pools.graph()), &self.device)
                    + release_unused(&mut lock(self.pools.eager()), &self.device);
                tracing::debug!(
                    released,
                    "out of device memory while recording: released unused pool memory, retrying"
                );
                self.capture_once(frame, parent, None, &mut reuse)
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
            Local::Captured(pending) => self.keep_capture(frame, parent, reason, pending),
            Local::FallBack(why) => self.capture_failed(frame, parent, why),
            Local::Failed(error) => Err(error),
        }
    }

    /// Attaches a capture to the tree and launches it once; frees it again when that launch
    /// shows it never replays.
    fn keep_capture<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        parent: Option<NodeKey>,
        reason: RecordReason,
        pending: Pending<D::Graph, M>,
    ) -> Result<Outcome, CallError<E>> {
        let Pending {
            prepared, captured, ..
        } = pending;
        let (key, keep) = self.attach(frame, parent, reason, prepared, captured);
        let outcome = self.first_launch(key, frame);
        drop(keep);
        match after_first_launch(&self.tree[key]) {
            Afterwards::Kept => {}
            Afterwards::Retired(why) => self.free_retired(key, parent, why)?,
            Afterwards::Eager(why) => {
                let name = &self.functions[frame.function].name;
                tracing::warn!(function = %name, reason = %why, "the recording never replays; the signature runs eagerly from now on");
                self.stats.fallbacks += 1;
                self.log(frame.function, parent, Decision::Eager(why.clone()));
                self.functions[frame.function].sigs[frame.sig].eager = Some(why);
                self.free_retired(key, parent, EvictReason::HostRandom)?;
            }
        }
        outcome
    }

    /// One try at a capture, leaving it pending (not attached, not launched), its inputs
    /// classified as `like`'s were where that node copied them (a guard's capture, ended to be
    /// compared: see [`Device::end_capture_to_compare`]). On failure the recording is undone.
    fn capture_once<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        parent: Option<NodeKey>,
        like: Option<NodeKey>,
        reuse: &mut Option<D::Graph>,
    ) -> Result<Pending<D::Graph, M>, Failure<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        if let Some((position, addr)) = self.external_in_pool(frame.inputs) {
            return Err(Failure::Call(CallError::ExternalInPool {
                function: self.functions[frame.function].name.clone(),
                position,
                addr,
            }));
        }
        let checkpoint = lock(self.pools.graph()).checkpoint();
        let prepared = match self.prepare_inputs(frame, parent, like) {
            Ok(prepared) => prepared,
            Err((placeholders, source)) => {
                self.undo_recording(&checkpoint, &placeholders, &[]);
                if matches!(source, PoolError::OutOfMemory { .. }) {
                    return Err(Failure::OutOfMemory(source));
                }
                let function = self.functions[frame.function].name.clone();
                return Err(Failure::Call(CallError::Pool { function, source }));
            }
        };
        let previous = self.phase;
        self.move_to(Phase::Recording {
            parent: parent.map(NodeKey::id),
        })
        .map_err(Failure::Call)?;
        match self.capture(
            frame,
            &prepared,
            &checkpoint,
            previous,
            reuse,
            like.is_some(),
        ) {
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

    /// Makes the captured graph a node of the tree: its footprint, the outputs of the path
    /// that must stay dead for it to replay, its outputs; the path moves to it.
    fn attach<F, E>(
        &mut self,
        frame: &Frame<'_, F, M, E>,
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
        let allocated: Box<[(DevicePtr, usize)]> = allocs
            .iter()
            .chain(&prepared.placeholders)
            .map(|c| (c.addr(), c.len()))
            .collect();
        let mut footprint = prepared.footprint;
        footprint.extend(
            allocs
                .iter()
                .filter(|c| c.len() > 0)
                .map(|c| (c.addr().0, c.end())),
        );
        let mut expected_dead = Vec::new();
        for anc in self.tree.path_nodes(parent) {
            for (i, o) in self.tree[anc].outputs.iter().enumerate() {
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
        let node = Node {
            function: frame.function,
            sig: frame.sig,
            graph,
            copied: tree::copied_positions(&prepared.slots),
            in_place: tree::in_place_positions(&prepared.slots),
            aliases: Box::new([]),
            fixed: tree::fixed_addresses(&prepared.slots),
            delivers: frame.dests.is_some(),
            inputs: prepared.slots.into_boxed_slice(),
            expected_dead: expected_dead.into_boxed_slice(),
            outputs,
            footprint: tree::merge_ranges(footprint),
            replays: 0,
            uses: Default::default(),
            guard: Guard::start(self.config.guards.filter(|_| self.member.is_none())),
            allocated,
            last_used: self.clock,
            retired: None,
            recorded_generation: self.generation,
            reason: reason.clone(),
            summary,
        };
        let key = self.tree.insert(parent, node);
        self.functions[frame.function].sigs[frame.sig].recorded = true;
        self.register_node(key, allocs, prepared.placeholders, reason);
        (key, keep)
    }

    /// Registers a new node's memory (pins, output cells, loose cells) and moves the path to it.
    fn register_node(
        &mut self,
        key: NodeKey,
        allocs: Vec<Arc<Cell>>,
        placeholders: Vec<Arc<Cell>>,
        reason: RecordReason,
    ) {
        let id = key.id();
        let function = self.tree[key].function;
        // What a graph reads or writes stays mapped as long as the graph exists.
        let pins: Vec<(DevicePtr, usize)> = self.tree[key].pins().collect();
        lock(self.pools.graph()).pin(&pins);
        let mut output_cells: Vec<*const Cell> = Vec::new();
        for o in &self.tree[key].outputs {
            if let OutputSlot::Tracked { cell, .. } = &o.slot {
                cell.set_node(id);
                output_cells.push(Arc::as_ptr(cell));
            }
        }
        let loose: Vec<Arc<Cell>> = allocs
            .into_iter()
            .chain(placeholders)
            .filter(|c| !output_cells.contains(&Arc::as_ptr(c)))
            .collect();
        self.pools.list_held(&loose);
        self.pools.keep_loose(loose);
        // Recording always ends at its node.
        let _: Result<(), CallError> = self.move_to(Phase::Replaying { tip: id });
        self.stats.recordings += 1;
        self.stats.rerecords.count(&reason);
        tracing::debug!(node = %id, "recorded");
        self.log(function, Some(key), Decision::Record(reason));
    }

    /// Launches a new node once (the recording only captured the work), checks whether the
    /// body wrote a copied input, and hands out the outputs.
    fn first_launch<F, E>(
        &mut self,
        key: NodeKey,
        frame: &mut Frame<'_, F, M, E>,
    ) -> Result<Outcome, CallError<E>> {
        let name = self.functions[frame.function].name.clone();
        let device_err = |source| CallError::Device {
            function: name.clone(),
            source,
        };
        if let Some(dests) = frame.dests.as_deref_mut() {
            self.deliver_into(key, dests, frame.out)?;
        }
        self.device
            .launch(CORE, &self.tree[key].graph)
            .map_err(device_err)?;
        if frame.dests.is_some() {
            self.copy_after_launch(key, frame.out).map_err(device_err)?;
        }
        self.catch_mutated_inputs(key, frame.sig)
            .map_err(device_err)?;
        self.patch_inputs(key).map_err(device_err)?;
        self.follow_in_place(key).map_err(device_err)?;
        for o in &self.tree[key].outputs {
            let buffer = match &o.slot {
                OutputSlot::Tracked { cell, .. } => {
                    let buffer = Buffer::from_cell(cell);
                    self.pools.list_held([cell]);
                    buffer
                }
                OutputSlot::Empty(cell) => Buffer::from_cell(cell),
                OutputSlot::StaticInput(p) => (*frame.inputs[*p]).clone(),
                OutputSlot::Alias(j) => frame.out[*j].buffer.clone(),
                // Handed out before the launch (`Graft::deliver_into`).
                OutputSlot::Delivered { .. } => continue,
            };
            frame.out.push(Output {
                buffer,
                meta: o.meta.clone(),
            });
        }
        Ok(Outcome::Recorded(key.id()))
    }

    /// Frees a node retired by its first launch (it never replays): its graph is destroyed
    /// and its pins released at once instead of counting against the graph budget, and the
    /// path moves back to its parent, as after an eager run. The outputs this call handed out
    /// stay valid: evicting keeps held outputs as loose memory.
    fn free_retired<E>(
        &mut self,
        key: NodeKey,
        parent: Option<NodeKey>,
        why: EvictReason,
    ) -> Result<(), CallError<E>> {
        drop(self.evict(key, why));
        self.move_to(match parent {
            Some(p) => Phase::Replaying { tip: p.id() },
            None => Phase::Idle,
        })
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
        lock(self.pools.graph()).rollback(checkpoint);
    }

    /// A capture failed (here, or on another rank of the group): the signature runs eagerly
    /// for good, starting with this call.
    fn capture_failed<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        parent: Option<NodeKey>,
        why: EagerReason,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let function = frame.function;
        let name = self.functions[function].name.clone();
        let _span = tracing::info_span!("fallback", function = %name).entered();
        tracing::warn!(reason = %why, "capture failed; the function runs eagerly from now on");
        if !matches!(why, EagerReason::PeerCaptureFailed { .. }) {
            self.stats.capture_failures += 1;
        }
        self.stats.fallbacks += 1;
        self.log(function, parent, Decision::Eager(why.clone()));
        self.functions[function].sigs[frame.sig].eager = Some(why.clone());
        self.run_eager(frame, why)
    }
}

/// What becomes of a new node once its first launch showed what its graph does: decided by
/// [`after_first_launch`], carried out by [`Graft::record`].
#[derive(Debug, PartialEq)]
enum Afterwards {
    /// It stays in the tree, to replay.
    Kept,
    /// It never replays (its first launch retired it: a copied input it reads was written):
    /// freed at once.
    Retired(EvictReason),
    /// It never replays and neither would a re-recording (its graph draws random numbers on
    /// the host): freed at once, and its signature runs eagerly for good.
    Eager(EagerReason),
}

/// The decision [`Afterwards`] for a node after its first launch.
fn after_first_launch<G, M>(node: &Node<G, M>) -> Afterwards {
    let kernels = node.summary.host_random;
    if kernels > 0 {
        Afterwards::Eager(EagerReason::HostRandom { kernels })
    } else if let Some(position) = node.retired {
        Afterwards::Retired(EvictReason::InputMutated { position })
    } else {
        Afterwards::Kept
    }
}

/// Why a failed capture makes the signature eager: a capture violation or a failed
/// instantiation. Any other error is the call's to return.
fn fallback_reason<E>(error: BodyError<E>) -> Result<EagerReason, BodyError<E>> {
    match error {
        BodyError::Device(e) if e.op() == DeviceOp::BeginCapture => {
            Ok(EagerReason::BeginCaptureFailed { error: e })
        }
        BodyError::Device(DeviceError::Capture { op, violation }) => {
            Ok(EagerReason::CaptureFailed { op, violation })
        }
        BodyError::Device(error @ DeviceError::Conditional { .. }) => {
            Ok(EagerReason::ConditionalRefused { error })
        }
        BodyError::Device(error @ DeviceError::Unavailable { .. })
            if error.op() == DeviceOp::Conditional =>
        {
            Ok(EagerReason::ConditionalRefused { error })
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
