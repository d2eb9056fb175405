//! What a recording's first launch reveals about its inputs: copied inputs the body writes
//! (`catch_mutated_inputs`, which retires the node), large read-only inputs made copy-free
//! (`patch_inputs`), and whether the graph can follow its in-place inputs (`follow_in_place`).

use crate::device::{CORE, CopyEnds, Device, DeviceError};
use crate::graft::Graft;
use crate::reason::Decision;
use crate::tree::{self, InputSlot, NodeKey};

impl<D: Device, M: Clone> Graft<D, M> {
    /// After a recording's first launch: a copied input whose placeholder no longer equals the
    /// caller's buffer was written by the body, and the graph left the caller's buffer as it
    /// was. Copies the result back now (so this call behaves as an eager run), retires the
    /// node (it never replays), and makes every later recording of the signature copy the
    /// input back inside its graph.
    pub(super) fn catch_mutated_inputs(
        &mut self,
        key: NodeKey,
        sig: usize,
    ) -> Result<(), DeviceError> {
        let function = self.tree[key].function;
        let mut found = Vec::new();
        for (position, slot) in self.tree[key].inputs.iter().enumerate() {
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
        self.tree[key].retired = Some(first);
        for position in found {
            tracing::warn!(
                function = %self.functions[function].name, position,
                "the body writes a copied input in place; graft copies it back to the caller's buffer inside the graph from now on"
            );
            self.functions[function].sigs[sig].mutated.push(position);
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
    pub(super) fn patch_inputs(&mut self, key: NodeKey) -> Result<(), DeviceError> {
        let min = self.config.patch_inputs_from.unwrap_or(usize::MAX);
        let node = &mut self.tree[key];
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
                let copy = CopyEnds {
                    dst: *placeholder,
                    src: *source,
                };
                if self.device.redirect(
                    CORE,
                    &mut node.graph,
                    copy.dst,
                    *len,
                    Some(copy),
                    Some(*source),
                )? {
                    *reads = Some(*source);
                    self.stats.patched_inputs += 1;
                }
            }
        }
        let warn_from = self.config.large_copy_warn_bytes;
        let node = &self.tree[key];
        for (position, slot) in node.inputs.iter().enumerate() {
            if let InputSlot::Copied {
                len, reads: None, ..
            } = *slot
                && len > warn_from
            {
                tracing::warn!(
                    function = %self.functions[node.function].name, position, bytes = len,
                    "a large input is copied on every replay; if its address is stable, declare it static"
                );
            }
        }
        Ok(())
    }

    /// In-place inputs: asks the device whether it can move every use the graph makes of each
    /// one (`Device::redirect` to where it already is). Those it can, replays point at each
    /// call's buffer; the others replay only at the recorded address. An input whose range
    /// overlaps another input's (a pointer into the overlap could belong to either) is not
    /// followed, unless every such input is an in-place one recorded as the same buffer (the
    /// same address and length, `f(x, x)`): those are followed together, and a replay needs
    /// them at one address again (`Node::aliases`). An input left unfollowed for an overlap
    /// keeps the input it overlaps (`InputSlot::InPlace::overlaps`), for the reason a move
    /// gives.
    pub(super) fn follow_in_place(&mut self, key: NodeKey) -> Result<(), DeviceError> {
        let node = &mut self.tree[key];
        let sizes = &self.functions[node.function].sigs[node.sig].sizes;
        let mut aliases = Vec::new();
        for k in 0..node.in_place.len() {
            let i = node.in_place[k];
            let InputSlot::InPlace { recorded, len, .. } = node.inputs[i] else {
                continue;
            };
            let (s, e) = (recorded.0, recorded.0 + len as u64);
            let mut same = Vec::new();
            let mut shared = None;
            for (j, (other, &n)) in node.inputs.iter().zip(sizes.iter()).enumerate() {
                let os = other.recorded_at().0;
                if j == i || n == 0 || os >= e || s >= os + n as u64 {
                    continue;
                }
                match *other {
                    InputSlot::InPlace {
                        recorded: r,
                        len: l,
                        ..
                    } if r == recorded && l == len => same.push(j),
                    _ => shared = shared.or(Some(j)),
                }
            }
            if shared.is_some() {
                if let InputSlot::InPlace { overlaps, .. } = &mut node.inputs[i] {
                    *overlaps = shared;
                }
                continue;
            }
            if self
                .device
                .redirect(CORE, &mut node.graph, recorded, len, None, Some(recorded))?
            {
                if let InputSlot::InPlace { follows, .. } = &mut node.inputs[i] {
                    *follows = true;
                }
                node.fixed[i] = tree::ANY_ADDRESS;
                self.stats.patched_inputs += 1;
                aliases.extend(same.into_iter().filter(|&j| j > i).map(|j| (i, j)));
            }
        }
        // A pair is followed together only where the device follows both.
        aliases
            .retain(|&(_, j)| matches!(node.inputs[j], InputSlot::InPlace { follows: true, .. }));
        node.aliases = aliases.into_boxed_slice();
        Ok(())
    }
}
