//! Outputs delivered into memory the caller owns ([`Graft::call_owned`]): checking what the
//! caller's allocator gives, and handing each output to it, by a copy recorded as the graph's
//! last node for that output (re-pointed before every launch), or after an eager run of the
//! body.

use crate::buffer::Buffer;
use crate::destinations::Destinations;
use crate::device::{CORE, CopyEnds, Device, DeviceError, DeviceOp};
use crate::error::{BodyError, CallError};
use crate::graft::Graft;
use crate::tree::{NodeKey, Output, OutputSlot};

impl<D: Device, M: Clone> Graft<D, M> {
    /// Asks `dests` for output `index`'s memory and checks it: this device, at least `bytes`
    /// long, not memory of graft's own pools. Returns it with its address.
    pub(crate) fn destination<E>(
        &self,
        dests: &mut dyn Destinations<M, E>,
        function: crate::error::FunctionId,
        index: usize,
        meta: &M,
        bytes: usize,
    ) -> Result<(Buffer, crate::device::DevicePtr), CallError<E>> {
        let name = || self.functions[function].name.clone();
        let given =
            dests
                .destination(index, meta, bytes)
                .map_err(|error| CallError::Destination {
                    function: name(),
                    index,
                    error,
                })?;
        let bad = |why| CallError::BadDestination {
            function: name(),
            index,
            given: given.len(),
            needed: bytes,
            why,
        };
        if given.device() != self.device.id() {
            return Err(bad("it belongs to another device"));
        }
        if given.len() < bytes {
            return Err(bad("it is too short"));
        }
        if self.pools.owns(given.cell()) {
            return Err(bad("it is memory of graft's own pools"));
        }
        let addr = given.addr().map_err(|_| bad("it can no longer be read"))?;
        Ok((given, addr))
    }

    /// After an eager run or a warmup: copies each of the body's outputs into its destination
    /// (on the device's stream) and hands the destinations out instead.
    pub(crate) fn deliver_eagerly<E>(
        &self,
        dests: &mut dyn Destinations<M, E>,
        function: crate::error::FunctionId,
        produced: Vec<Output<M>>,
        out: &mut Vec<Output<M>>,
    ) -> Result<(), CallError<E>> {
        for (index, o) in produced.into_iter().enumerate() {
            let len = o.buffer.len();
            let (dest, at) = self.destination(dests, function, index, &o.meta, len)?;
            if len > 0 {
                let src = o.buffer.addr().map_err(|source| CallError::Body {
                    function: self.functions[function].name.clone(),
                    source: BodyError::Buffer(source),
                })?;
                self.device
                    .copy(CORE, at, src, len)
                    .map_err(|source| CallError::Device {
                        function: self.functions[function].name.clone(),
                        source,
                    })?;
            }
            out.push(Output {
                buffer: dest,
                meta: o.meta,
            });
        }
        Ok(())
    }

    /// Before launching node `key`: points each delivered output's copy at the caller's
    /// memory for this call and hands that memory out, in output order. Where the device
    /// refuses to re-point the copy, the output is copied after the launch from then on
    /// (`copy_after_launch`): slower by one copy, never wrong.
    pub(crate) fn deliver_into<E>(
        &mut self,
        key: NodeKey,
        dests: &mut dyn Destinations<M, E>,
        out: &mut Vec<Output<M>>,
    ) -> Result<(), CallError<E>> {
        let function = self.tree[key].function;
        for index in 0..self.tree[key].outputs.len() {
            let (ends, len, after) = match self.tree[key].outputs[index].slot {
                OutputSlot::Delivered { ends, len, after } => (Some(ends), len, after),
                _ => (None, 0, false),
            };
            let meta = self.tree[key].outputs[index].meta.clone();
            let (dest, at) = self.destination(dests, function, index, &meta, len)?;
            if let Some(ends) = ends
                && !after
                && ends.dst != at
            {
                let now = CopyEnds {
                    dst: at,
                    src: ends.src,
                };
                let node = &mut self.tree[key];
                let repointed = self.device.repoint_copy(CORE, &mut node.graph, ends, now);
                if let OutputSlot::Delivered { ends, after, .. } = &mut node.outputs[index].slot {
                    match repointed {
                        Ok(()) => *ends = now,
                        Err(error) => {
                            tracing::warn!(
                                function = %self.functions[function].name, index, %error,
                                "the graph cannot write the caller's memory for this output (the device refused to re-point its copy); graft copies it after each launch instead"
                            );
                            *after = true;
                        }
                    }
                }
            }
            out.push(Output { buffer: dest, meta });
        }
        Ok(())
    }

    /// After launching node `key`: copies the outputs whose copy could not be re-pointed from
    /// their placeholders into the caller's memory handed out in `out`.
    pub(crate) fn copy_after_launch(
        &self,
        key: NodeKey,
        out: &[Output<M>],
    ) -> Result<(), DeviceError> {
        for (o, handed) in self.tree[key].outputs.iter().zip(out) {
            if let OutputSlot::Delivered {
                ends,
                len,
                after: true,
            } = o.slot
            {
                let dst = handed
                    .buffer
                    .device_addr(DeviceOp::Copy, self.device.id(), 0, len)?;
                self.device.copy(CORE, dst, ends.dst, len)?;
            }
        }
        Ok(())
    }
}
