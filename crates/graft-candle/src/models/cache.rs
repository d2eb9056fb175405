//! The static KV cache every port shares: keys and values preallocated for `max_batch`
//! sequences of `max_seq` positions, written in place at each sequence's position, which
//! lives on the device and advances on the device. Its tensors keep their addresses for the
//! cache's whole life, so a recorded step replays against them (they are the step's statics).

use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor};

/// Keys, values and positions of up to `max_batch` sequences. A step of batch `b` (a bucket)
/// uses sequences `0..b`.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer, `[max_batch, kv_heads, max_seq, head_dim]`.
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// `[max_batch]` u32: the position each sequence's next token is written at.
    positions: Tensor,
    /// `[max_seq]` u32: 0, 1, ..., for the mask.
    arange: Tensor,
    /// `[1]` u32: 1, to advance the positions.
    one: Tensor,
    /// With a sliding window `w`, `[max_seq]` u32: `j + w` for key j (visible from positions
    /// up to it).
    reach: Option<Tensor>,
    /// The positions as the host last set and advanced them: the bound checks read these,
    /// never the device.
    host: Mutex<Vec<u32>>,
}

/// Errors of the cache's host-side checks, with what to do.
fn full(row: usize, max_seq: usize) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "sequence {row} of the kv cache is full ({max_seq} positions): reset it (KvCache::set_position) or make a cache with a larger max_seq"
    ))
    .bt()
}

impl KvCache {
    /// A zeroed cache of `layers` layers, every position at 0.
    pub(crate) fn new(
        layers: usize,
        shape: (usize, usize, usize, usize),
        window: Option<usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let (max_batch, _, max_seq, _) = shape;
        if max_batch == 0 || max_seq == 0 {
            candle_core::bail!("a kv cache needs at least one sequence and one position");
        }
        let seq = u32::try_from(max_seq)
            .map_err(|_| candle_core::Error::Msg("max_seq must fit in a u32".into()))?;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(Tensor::zeros(shape, dtype, device)?);
            v.push(Tensor::zeros(shape, dtype, device)?);
        }
        let arange = Tensor::arange(0u32, seq, device)?;
        // A window at least as long as the cache hides nothing.
        let reach = match window.filter(|&w| w < max_seq) {
            Some(w) => Some(Tensor::arange(w as u32, seq + w as u32, device)?),
            None => None,
        };
        Ok(KvCache {
            k,
            v,
            positions: Tensor::zeros(max_batch, DType::U32, device)?,
            arange,
            one: Tensor::ones(1, DType::U32, device)?,
            reach,
            host: Mutex::new(vec![0; max_batch]),
        })
    }

    /// How many sequences the cache holds.
    pub fn max_batch(&self) -> usize {
        self.positions.elem_count()
    }

    /// How many positions each sequence has.
    pub fn max_seq(&self) -> usize {
        self.arange.elem_count()
    }

    /// The tensors a recorded step writes or reads in place (keys, values, positions and the
    /// mask's range): pass them as statics (`Decoder::statics` does).
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut all: Vec<&Tensor> = self.k.iter().chain(&self.v).collect();
        all.extend([&self.positions, &self.arange, &self.one]);
        all.extend(&self.reach);
        all
    }

    /// The position of every sequence, as this cache's steps advanced them (no device read).
    pub fn positions(&self) -> Vec<u32> {
        self.host_positions().clone()
    }

    /// The positions as the device holds them (a host read: call it between steps).
    pub fn device_positions(&self) -> Result<Vec<u32>> {
        self.positions.to_vec1::<u32>()
    }

    /// Moves sequence `row` to `position` (0 starts it over; earlier positions stay in the
    /// cache and later ones are masked). An upload: call it between steps, never in a body.
    pub fn set_position(&self, row: usize, position: u32) -> Result<()> {
        let mut host = self.host_positions();
        let max_seq = self.max_seq();
        if row >= host.len() || position as usize > max_seq {
            candle_core::bail!(
                "set_position({row}, {position}) on a kv cache of {} sequences of {max_seq} positions",
                host.len()
            );
        }
        let value = Tensor::new(&[position], self.positions.device())?;
        self.positions.slice_set(&value, 0, row)?;
        host[row] = position;
        Ok(())
    }

    /// Starts every sequence over at position 0 (an upload: between steps).
    pub fn reset(&self) -> Result<()> {
        let zeros = Tensor::zeros(self.max_batch(), DType::U32, self.positions.device())?;
        self.positions.slice_set(&zeros, 0, 0)?;
        self.host_positions().iter_mut().for_each(|p| *p = 0);
        Ok(())
    }

    fn host_positions(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        // Poisoned only by a panic while the guard was held, which leaves plain integers.
        self.host.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks that sequences `0..batch` each have a position left, before a step of that
    /// batch; `advance` records the step's advance of them (after it ran).
    pub(crate) fn check_room(&self, batch: usize) -> Result<()> {
        let host = self.host_positions();
        if batch == 0 || batch > host.len() {
            candle_core::bail!(
                "a step of {batch} sequences on a kv cache of {}: use a batch between 1 and max_batch",
                host.len()
            );
        }
        match host[..batch]
            .iter()
            .position(|&p| p as usize >= self.max_seq())
        {
            Some(row) => Err(full(row, self.max_seq())),
            None => Ok(()),
        }
    }

    /// Records that a step advanced sequences `0..batch` by one position.
    pub(crate) fn advance(&self, batch: usize) {
        self.host_positions()[..batch]
            .iter_mut()
            .for_each(|p| *p += 1);
    }

    /// Sequences `0..batch` of layer `layer`'s keys and values.
    pub(crate) fn layer(&self, layer: usize, batch: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k[layer].narrow(0, 0, batch)?,
            self.v[layer].narrow(0, 0, batch)?,
        ))
    }

    /// The positions of sequences `0..batch` (`[batch]` u32, on the device).
    pub(crate) fn positions_of(&self, batch: usize) -> Result<Tensor> {
        self.positions.narrow(0, 0, batch)
    }

    /// The additive attention mask of sequences `0..batch` at their positions: `[batch, 1, 1,
    /// max_seq]` f32, 0 where a cache position is visible (at or before the sequence's
    /// position, and within the sliding window of it when the cache has one), -1e9
    /// elsewhere. Built on the device.
    pub(crate) fn mask(&self, batch: usize) -> Result<Tensor> {
        let pos = self.positions_of(batch)?.unsqueeze(1)?;
        let mut visible = self.arange.unsqueeze(0)?.broadcast_le(&pos)?;
        if let Some(reach) = &self.reach {
            // Key j is visible from position p when j + w >= p (candle's Mistral and Qwen2).
            visible = (visible * reach.unsqueeze(0)?.broadcast_ge(&pos)?)?;
        }
        visible
            .to_dtype(DType::F32)?
            .affine(1e9, -1e9)?
            .reshape((batch, 1, 1, self.max_seq()))
    }

    /// Where sequences `0..batch` write their new key/value: `[batch, kv_heads, 1, head_dim]`
    /// u32 of each sequence's position, for `scatter_set` along the positions.
    pub(crate) fn write_index(
        &self,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Tensor> {
        self.positions_of(batch)?
            .reshape((batch, 1, 1, 1))?
            .broadcast_as((batch, kv_heads, 1, head_dim))?
            .contiguous()
    }

    /// Advances the positions of sequences `0..batch` by one, on the device.
    pub(crate) fn step_positions(&self, batch: usize) -> Result<()> {
        let pos = self.positions_of(batch)?;
        let next = pos.broadcast_add(&self.one)?;
        self.positions.slice_set(&next, 0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(window: Option<usize>) -> KvCache {
        KvCache::new(1, (2, 1, 4, 2), window, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_mask_shows_each_sequence_its_own_positions() -> Result<()> {
        let c = cache(None);
        c.set_position(0, 2)?;
        let rows = c.mask(2)?.reshape((2, 4))?.to_vec2::<f32>()?;
        assert_eq!(rows[0], [0.0, 0.0, 0.0, -1e9]);
        assert_eq!(rows[1], [0.0, -1e9, -1e9, -1e9]);
        let w = cache(Some(1));
        w.set_position(0, 2)?;
        let windowed = w.mask(1)?.reshape((1, 4))?.to_vec2::<f32>()?;
        assert_eq!(windowed[0], [-1e9, 0.0, 0.0, -1e9]);
        assert_eq!(cache(Some(4)).tensors().len(), c.tensors().len());
        Ok(())
    }

    #[test]
    fn positions_advance_on_the_device_and_a_full_sequence_is_an_error() -> Result<()> {
        let c = cache(None);
        c.set_position(1, 3)?;
        c.step_positions(2)?;
        c.advance(2);
        assert_eq!(c.device_positions()?, [1, 4]);
        assert_eq!(c.positions(), [1, 4]);
        let e = c.check_room(2).unwrap_err().to_string();
        assert!(e.contains("sequence 1 of the kv cache is full"), "{e}");
        c.check_room(1)?;
        assert!(c.check_room(3).is_err());
        assert!(c.set_position(2, 0).is_err());
        c.reset()?;
        assert_eq!(c.device_positions()?, [0, 0]);
        Ok(())
    }
}
