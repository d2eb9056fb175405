//! Replay, the fast path: re-point moved input copies (or re-patch copy-free inputs),
//! invalidate the held cells of the `handed` list that the graph overwrites, launch, hand out
//! the outputs. Also verify mode.

use std::sync::Arc;

use crate::buffer::{Buffer, Cell};
use crate::ctx::{Ctx, RunKind};
use crate::device::{CORE, CopyEnds, Device, DeviceError, DevicePtr};
use crate::error::{BodyError, CallError, MemoryError, VerifyTarget};
use crate::graft::{Frame, Graft, Outcome};
use crate::lifecycle::Phase;
use crate::tree::{self, InputSlot, NodeKey, Output, OutputSlot};

impl<D: Device, M: Clone> Graft<D, M> {
    /// A call of `key` gives destinations for its outputs exactly when its recording
    /// delivers them (`Graft::call_owned` against `Graft::call`): checked before a replay and
    /// before a guard, which would otherwise capture the body either way.
    pub(crate) fn check_owned_outputs<F, E>(
        &self,
        key: NodeKey,
        frame: &Frame<'_, F, M, E>,
    ) -> Result<(), CallError<E>> {
        if self.tree[key].delivers == frame.dests.is_some() {
            return Ok(());
        }
        let how = |owned| {
            if owned {
                "with owned outputs"
            } else {
                "without owned outputs"
            }
        };
        Err(CallError::OwnedOutputs {
            function: self.functions[self.tree[key].function].name.clone(),
            recorded: how(self.tree[key].delivers),
            called: how(frame.dests.is_some()),
        })
    }

    pub(crate) fn replay<F, E>(
        &mut self,
        key: NodeKey,
        frame: &mut Frame<'_, F, M, E>,
    ) -> Result<Outcome, CallError<E>> {
        let _span = tracing::trace_span!("replay", node = ?key).entered();
        let id = key.id();
        let function = self.tree[key].function;
        let fail = |graft: &Self, source| CallError::Device {
            function: graft.functions[function].name.clone(),
            source,
        };
        self.check_owned_outputs(key, frame)?;
        let (copied, repointed) = match self.repoint_copies(key, frame.addrs) {
            Ok(counts) => counts,
            Err(source) => return Err(fail(self, source)),
        };
        if let Some(dests) = frame.dests.as_deref_mut() {
            self.deliver_into(key, dests, frame.out)?;
        }
        let node = &self.tree[key];
        // Held memory the graph overwrites is invalidated first; cells nobody holds leave the
        // list (a later hand-out lists them again).
        let invalidated = self
            .pools
            .invalidate_overwritten(id, |start, end| node.footprint_overlaps(start, end));
        if let Err(source) = self.device.launch(CORE, &node.graph) {
            return Err(fail(self, source));
        }
        if frame.dests.is_some()
            && let Err(source) = self.copy_after_launch(key, frame.out)
        {
            return Err(fail(self, source));
        }
        self.stats.invalidations += invalidated;
        self.stats.copied_inputs += copied;
        self.stats.copy_sources_updated += repointed;
        if frame.dests.is_none() {
            self.hand_out(key, frame.inputs, frame.out);
        }
        self.clock += 1;
        let node = &mut self.tree[key];
        node.replays += 1;
        node.last_used = self.clock;
        self.stats.replays += 1;
        self.pools.replayed();
        self.move_to(Phase::Replaying { tip: id })?;
        Ok(Outcome::Replayed(id))
    }

    /// The graph copies the copied inputs itself (and copies written ones back); re-points a
    /// copy only if the caller's buffer moved (in a loop it usually does not). A copy-free
    /// input is re-patched to the caller's new buffer instead, or copied again when that
    /// buffer lies in memory the graph writes. Returns the copied inputs and how many were
    /// re-pointed (or re-patched).
    fn repoint_copies(
        &mut self,
        key: NodeKey,
        addrs: &[DevicePtr],
    ) -> Result<(u64, u64), DeviceError> {
        let node = &mut self.tree[key];
        let (mut copied, mut repointed) = (0, 0);
        for &i in node.copied.iter() {
            let (slot, src) = (&mut node.inputs[i], addrs[i]);
            if let InputSlot::Copied {
                placeholder,
                len,
                source,
                write_back,
                reads,
            } = slot
                && *len > 0
            {
                let ph = *placeholder;
                let copy = CopyEnds {
                    dst: ph,
                    src: *source,
                };
                match *reads {
                    Some(at) if at == src => continue,
                    Some(_) if tree::overlaps(&node.footprint, src.0, src.0 + *len as u64) => {
                        self.device
                            .redirect(CORE, &mut node.graph, ph, *len, Some(copy), None)?;
                        *reads = None;
                    }
                    Some(_) => {
                        self.device.redirect(
                            CORE,
                            &mut node.graph,
                            ph,
                            *len,
                            Some(copy),
                            Some(src),
                        )?;
                        *reads = Some(src);
                        repointed += 1;
                        continue;
                    }
                    None => {}
                }
                if *source != src {
                    let into = |src| CopyEnds { dst: ph, src };
                    self.device
                        .repoint_copy(CORE, &mut node.graph, into(*source), into(src))?;
                    *source = src;
                    repointed += 1;
                }
                if let Some(dst) = write_back
                    && *dst != src
                {
                    let back = |dst| CopyEnds { dst, src: ph };
                    self.device
                        .repoint_copy(CORE, &mut node.graph, back(*dst), back(src))?;
                    *dst = src;
                }
                copied += 1;
            }
        }
        for &i in node.in_place.iter() {
            if let InputSlot::InPlace {
                recorded,
                at,
                len,
                follows: true,
                ..
            } = &mut node.inputs[i]
                && *at != addrs[i]
            {
                let to = addrs[i];
                if !self
                    .device
                    .redirect(CORE, &mut node.graph, *recorded, *len, None, Some(to))?
                {
                    return Err(DeviceError::InvalidArgument {
                        op: crate::device::DeviceOp::GraphUpdate,
                        what: "the device no longer redirects an in-place input it redirected when it was recorded",
                    });
                }
                *at = to;
                repointed += 1;
            }
        }
        Ok((copied, repointed))
    }

    /// Hands a replay's outputs to the caller: each output slot reuses its cell when nobody
    /// holds it, or retires it (invalidated) and takes a spare.
    fn hand_out(&mut self, key: NodeKey, inputs: &[&Buffer], out: &mut Vec<Output<M>>) {
        let id = key.id();
        let generation = self.generation;
        let pools = &mut self.pools;
        let node = &mut self.tree[key];
        for out_i in node.outputs.iter_mut() {
            let buffer = match &mut out_i.slot {
                OutputSlot::Tracked { cell, spares } => {
                    if cell.is_held() {
                        cell.invalidate_overwritten(Some(id));
                        let fresh = match spares.iter().position(|c| !c.is_held()) {
                            Some(j) => spares.swap_remove(j),
                            None => {
                                let c = Cell::new(
                                    cell.addr(),
                                    cell.len(),
                                    self.device.id(),
                                    self.functions[node.function].name.clone(),
                                    generation,
                                    Some(Arc::downgrade(pools.graph())),
                                );
                                c.set_node(id);
                                c
                            }
                        };
                        spares.push(std::mem::replace(cell, fresh));
                    }
                    cell.recycle(generation);
                    let buffer = Buffer::from_cell(cell);
                    pools.list_held([&*cell]);
                    buffer
                }
                OutputSlot::StaticInput(p) => (*inputs[*p]).clone(),
                OutputSlot::Alias(j) => out[*j].buffer.clone(),
                OutputSlot::Empty(cell) => Buffer::from_cell(cell),
                // Handed out before the launch (`Graft::deliver_into`).
                OutputSlot::Delivered { .. } => continue,
            };
            out.push(Output {
                buffer,
                meta: out_i.meta.clone(),
            });
        }
    }

    /// Verify mode: replays, then runs the body eagerly from the same starting state and
    /// compares every output and every input afterwards, byte for byte. Bodies may update
    /// inputs in place (a KV cache, a training step's weights and optimizer state), and a
    /// framework's body may write its statics directly rather than through the ctx, so the
    /// eager run works on the caller's own buffers: their bytes are read before the replay,
    /// read again after it (the replay's result), and written back before the eager run.
    /// The update is applied once, and what the caller keeps is the eager run's result.
    pub(crate) fn replay_verified<F, E>(
        &mut self,
        key: NodeKey,
        frame: &mut Frame<'_, F, M, E>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let name = self.functions[frame.function].name.clone();
        let memory = |source: MemoryError| CallError::Verify {
            function: name.clone(),
            source,
        };
        let read_inputs = |g: &Self, inputs: &[&Buffer]| {
            inputs
                .iter()
                .map(|b| g.read_bytes(b))
                .collect::<Result<Vec<_>, _>>()
        };
        let before = read_inputs(self, frame.inputs).map_err(memory)?;
        let outcome = self.replay(key, frame)?;
        // Read before the eager run: an output may be a static input the eager run rewrites.
        let replayed_outputs = frame
            .out
            .iter()
            .map(|o| self.read_bytes(&o.buffer))
            .collect::<Result<Vec<_>, _>>()
            .map_err(memory)?;
        let replayed_inputs = read_inputs(self, frame.inputs).map_err(memory)?;
        for (buffer, bytes) in frame.inputs.iter().zip(&before) {
            self.write(buffer, bytes).map_err(memory)?;
        }
        let mut eager = Vec::new();
        let mut reference = Frame {
            function: frame.function,
            sig: frame.sig,
            inputs: frame.inputs,
            addrs: frame.addrs,
            body: &mut *frame.body,
            dests: None,
            out: &mut eager,
        };
        self.run_body(&mut reference, RunKind::Eager)?;
        let out = &*frame.out;
        let eager_outputs = eager
            .iter()
            .map(|o| self.read_bytes(&o.buffer))
            .collect::<Result<Vec<_>, _>>()
            .map_err(memory)?;
        let eager_inputs = read_inputs(self, frame.inputs).map_err(memory)?;
        let pairs = replayed_outputs
            .iter()
            .zip(&eager_outputs)
            .chain(replayed_inputs.iter().zip(&eager_inputs));
        for (index, (a, b)) in pairs.enumerate() {
            if let Some(byte) = a
                .iter()
                .zip(b)
                .position(|(x, y)| x != y)
                .or((a.len() != b.len()).then_some(a.len().min(b.len())))
            {
                let what = if index < out.len() {
                    VerifyTarget::Output(index)
                } else {
                    VerifyTarget::Input(index - out.len())
                };
                return Err(CallError::VerifyMismatch {
                    function: name,
                    node: key.id(),
                    what,
                    byte,
                });
            }
        }
        if out.len() != eager.len() {
            return Err(CallError::VerifyMismatch {
                function: name,
                node: key.id(),
                what: VerifyTarget::Output(out.len().min(eager.len())),
                byte: 0,
            });
        }
        Ok(outcome)
    }

    fn read_bytes(&self, buffer: &Buffer) -> Result<Vec<u8>, MemoryError> {
        let mut bytes = vec![0u8; buffer.len()];
        self.read(buffer, &mut bytes)?;
        Ok(bytes)
    }
}
