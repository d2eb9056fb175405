//! The static KV cache every port shares: keys and values preallocated for `max_batch`
//! sequences of `max_seq` positions, written in place at each sequence's position, which
//! lives on the device and advances on the device. Its tensors keep their addresses for the
//! cache's whole life, so a recorded step replays against them (they are the step's statics).

use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor};

mod pages;

pub(crate) use pages::Lookup;
use pages::Pages;

/// Keys, values and positions of up to `max_batch` sequences. A step of batch `b` (a bucket)
/// uses sequences `0..b`. Static (a row of `max_seq` positions per sequence) or paged
/// (blocks shared by every sequence, each sequence's listed in a block table: see
/// [`Decoder::new_paged_cache`](crate::Decoder::new_paged_cache)).
#[derive(Debug)]
pub struct KvCache {
    /// Per layer, `[max_batch, kv_heads, max_seq, head_dim]` (static rows; the scratch row
    /// after them in a serving cache) or `[blocks + 1, kv_heads, block_size, head_dim]`
    /// (paged; the scratch block last).
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
    /// A serving cache's prefill constants (and its scratch row); `None` for a decode-only
    /// cache.
    prefill: Option<PrefillIndex>,
    /// The positions as the host last set and advanced them: the bound checks read these,
    /// never the device.
    host: Mutex<Vec<u32>>,
    /// The paged layout's table; `None` for static rows.
    pages: Option<Pages>,
}

/// The device constants a prefill step builds its write indices from. A serving cache has
/// one row more than its sequences: the scratch row, where the padding tokens of a prefill
/// chunk write (every one at a place of its own, so no two writes of a chunk collide), which
/// no decode step reads.
#[derive(Debug)]
struct PrefillIndex {
    /// `[max_batch]` u32: 0, 1, ..., to pick a sequence's position by a device row.
    rows: Tensor,
    /// `[kv_heads, 1]` u32: `h * max_seq`, the offset of head h within a row.
    heads: Tensor,
    /// `[1]` u32: `kv_heads * max_seq`, the stride of one row (in `head_dim` vectors).
    row_stride: Tensor,
    /// `[1]` u32: the scratch row's index (`max_batch`).
    scratch_row: Tensor,
}

impl PrefillIndex {
    /// The index of `max_batch` sequences whose flat cache (the unfused prefill's writes) has
    /// `flat_rows` rows before its scratch row.
    fn new(
        max_batch: usize,
        flat_rows: usize,
        kv_heads: usize,
        seq: u32,
        device: &Device,
    ) -> Result<PrefillIndex> {
        let too_large =
            || candle_core::Error::Msg("the kv cache is too large for u32 indices".into());
        let kv = u32::try_from(kv_heads).map_err(|_| too_large())?;
        let batch = u32::try_from(max_batch).map_err(|_| too_large())?;
        // The largest index is that of the scratch row's last place.
        let places = (flat_rows as u64 + 1) * u64::from(kv) * u64::from(seq);
        if places > u64::from(u32::MAX) {
            return Err(too_large());
        }
        let heads: Vec<u32> = (0..kv).map(|h| h * seq).collect();
        Ok(PrefillIndex {
            rows: Tensor::arange(0u32, batch, device)?,
            heads: Tensor::from_vec(heads, (kv_heads, 1), device)?,
            row_stride: Tensor::new(&[kv * seq], device)?,
            scratch_row: Tensor::new(&[batch], device)?,
        })
    }
}

/// Where one prefill chunk (or verify pass) reads and writes, built on the device from its
/// segments' rows and lengths (see [`KvCache::segments_plan`]).
#[derive(Debug)]
pub(crate) struct PrefillPlan {
    /// `[chunk]` u32: each token's position (padding token i's is i, in the scratch row).
    pub(crate) positions: Tensor,
    /// `[chunk]` u32: each token's cache row: the sequence's, or the scratch row's for
    /// padding.
    pub(crate) rows: Tensor,
    /// `[segments]` u32: each segment's row (one segment: the row); the scratch row for an
    /// unused segment.
    pub(crate) row: Tensor,
    /// `[segments]` u32: the index of each segment's last real token (0 for an unused one).
    pub(crate) last: Tensor,
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
    /// With `serving`, it has a scratch row for [`KvCache`]'s prefill (see `PrefillIndex`).
    /// With `paged` (blocks, block size), its keys and values are in pages (a paged cache
    /// always serves: its padding writes the scratch block).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        layers: usize,
        shape: (usize, usize, usize, usize),
        window: Option<usize>,
        serving: bool,
        paged: Option<(usize, usize)>,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let (max_batch, kv_heads, max_seq, head_dim) = shape;
        if max_batch == 0 || max_seq == 0 {
            candle_core::bail!("a kv cache needs at least one sequence and one position");
        }
        let seq = u32::try_from(max_seq)
            .map_err(|_| candle_core::Error::Msg("max_seq must fit in a u32".into()))?;
        let pages = match paged {
            Some((blocks, block_size)) => {
                Some(Pages::new(max_batch, max_seq, blocks, block_size, device)?)
            }
            None => None,
        };
        let serving = serving || pages.is_some();
        let rows = max_batch + usize::from(serving);
        let stored = match &pages {
            Some(p) => p.stored(kv_heads, head_dim),
            None => (rows, kv_heads, max_seq, head_dim),
        };
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(Tensor::zeros(stored, dtype, device)?);
            v.push(Tensor::zeros(stored, dtype, device)?);
        }
        // The unfused prefill's flat indices address static rows only.
        let prefill = if serving {
            let flat_rows = if pages.is_some() { 0 } else { max_batch };
            Some(PrefillIndex::new(
                max_batch, flat_rows, kv_heads, seq, device,
            )?)
        } else {
            None
        };
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
            prefill,
            host: Mutex::new(vec![0; max_batch]),
            pages,
        })
    }

    /// The bytes of keys and values one sequence holds (all layers).
    /// For a paged cache, those of `max_seq` positions (a sequence as long as it may grow).
    pub fn row_bytes(&self) -> usize {
        let dims = self.k[0].dims();
        let per_position = dims[1] * dims[3];
        2 * self.k.len() * per_position * self.max_seq() * self.k[0].dtype().size_in_bytes()
    }

    /// The bytes of the whole cache's keys and values (the scratch row or block included).
    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.k[0].elem_count() * self.k[0].dtype().size_in_bytes()
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
        if let Some(p) = &self.prefill {
            all.extend([&p.rows, &p.heads, &p.row_stride, &p.scratch_row]);
        }
        all.extend(self.pages.as_ref().map(Pages::table));
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
            None => match &self.pages {
                Some(p) => p.check_steps(&host[..batch]),
                None => Ok(()),
            },
        }
    }

    /// Checks that sequence `row` of a paged cache has blocks for its positions up to `end`
    /// (exclusive); static rows always do.
    fn check_blocks(&self, row: usize, end: usize) -> Result<()> {
        match &self.pages {
            Some(p) => pages::check_room(row, p.room(row), end),
            None => Ok(()),
        }
    }

    /// Records that a step advanced sequences `0..batch` by one position.
    pub(crate) fn advance(&self, batch: usize) {
        self.host_positions()[..batch]
            .iter_mut()
            .for_each(|p| *p += 1);
    }

    /// Copies sequence `from`'s keys, values and position onto sequence `to` (a device copy,
    /// between steps): a serving loop keeps its running sequences in rows `0..n` this way
    /// when one of them finishes.
    pub fn move_row(&self, from: usize, to: usize) -> Result<()> {
        let mut host = self.host_positions();
        if from >= host.len() || to >= host.len() {
            candle_core::bail!(
                "move_row({from}, {to}) on a kv cache of {} sequences",
                host.len()
            );
        }
        if from == to {
            return Ok(());
        }
        // `index_select` copies the one row (`Tensor::copy` of a view would clone the whole
        // cache's storage). A paged sequence's keys and values stay in their blocks: its
        // table row moves.
        let row = Tensor::new(&[from as u32], self.positions.device())?;
        let rows: Vec<&Tensor> = match &self.pages {
            Some(_) => vec![&self.positions],
            None => self
                .k
                .iter()
                .chain(&self.v)
                .chain([&self.positions])
                .collect(),
        };
        for t in rows {
            t.slice_set(&t.index_select(&row, 0)?, 0, to)?;
        }
        self.move_table_row(from, to)?;
        host[to] = host[from];
        Ok(())
    }

    /// Checks, before a prefill chunk of `len` real tokens padded to `chunk` at sequence
    /// `row`, that the cache is a serving cache and the tokens fit in the row.
    pub(crate) fn check_prefill(&self, row: usize, len: usize, chunk: usize) -> Result<()> {
        let host = self.host_positions();
        if self.prefill.is_none() {
            candle_core::bail!(
                "prefill needs a serving kv cache (its scratch row takes the padding): make it with Decoder::new_serving_cache"
            );
        }
        if row >= host.len() {
            candle_core::bail!(
                "a prefill of sequence {row} on a kv cache of {} sequences",
                host.len()
            );
        }
        if len == 0 || len > chunk || chunk > self.max_seq() {
            candle_core::bail!(
                "a prefill chunk of {len} tokens padded to {chunk}: pass 1 to {chunk} tokens, padded to at most max_seq ({})",
                self.max_seq()
            );
        }
        let at = host[row] as usize;
        if at + len > self.max_seq() {
            candle_core::bail!(
                "a prefill of {len} tokens at position {at} of sequence {row} overflows the kv cache ({} positions): shorten the prompt or make a cache with a larger max_seq",
                self.max_seq()
            );
        }
        self.check_blocks(row, at + len)
    }

    /// Records that a prefill advanced sequence `row` by `len` positions.
    pub(crate) fn advance_row(&self, row: usize, len: usize) {
        self.host_positions()[row] += len as u32;
    }

    /// The positions and rows of a prefill chunk of `chunk` tokens of several sequences, from
    /// `meta` (u32, built by the host): each token's row (the scratch row for padding) and
    /// offset within its segment (padding token i's: i), then per segment (`segments` of
    /// them) the index of its last token, its row and its length (0 and the scratch row for an
    /// unused one). Token i's position is its row's position plus its offset. Returns the
    /// plan and the segments' lengths (`[segments]`).
    pub(crate) fn segments_plan(
        &self,
        meta: &Tensor,
        chunk: usize,
        segments: usize,
    ) -> Result<(PrefillPlan, Tensor)> {
        let Some(p) = &self.prefill else {
            candle_core::bail!("prefill needs a serving kv cache");
        };
        let rows = meta.narrow(0, 0, chunk)?;
        let offsets = meta.narrow(0, chunk, chunk)?;
        let last = meta.narrow(0, 2 * chunk, segments)?;
        let row = meta.narrow(0, 2 * chunk + segments, segments)?;
        let lens = meta.narrow(0, 2 * chunk + 2 * segments, segments)?;
        let real = rows.broadcast_lt(&p.scratch_row)?;
        let zeros = rows.zeros_like()?;
        let start = self
            .positions
            .index_select(&real.where_cond(&rows, &zeros)?, 0)?;
        let positions = real.where_cond(&(&start + &offsets)?, &offsets)?;
        let plan = PrefillPlan {
            positions,
            rows,
            row,
            last,
        };
        Ok((plan, lens))
    }

    /// What the unfused prefill of `plan` needs besides: the additive causal mask of each
    /// token (`[chunk, max_seq]` f32) and where each head's key or value of each token is
    /// written in a layer's flat cache (`KvCache::flat`; `[kv_heads * chunk, head_dim]` u32):
    /// its row's place at its position, padding in the scratch row at distinct places.
    pub(crate) fn prefill_unfused(
        &self,
        plan: &PrefillPlan,
        head_dim: usize,
    ) -> Result<(Tensor, Tensor)> {
        let Some(p) = &self.prefill else {
            candle_core::bail!("prefill needs a serving kv cache");
        };
        let column = plan.positions.unsqueeze(1)?;
        let mut visible = self.arange.unsqueeze(0)?.broadcast_le(&column)?;
        if let Some(reach) = &self.reach {
            visible = (visible * reach.unsqueeze(0)?.broadcast_ge(&column)?)?;
        }
        let mask = visible.to_dtype(DType::F32)?.affine(1e9, -1e9)?;
        let (kv, chunk) = (p.heads.dim(0)?, plan.positions.dim(0)?);
        let write_at = plan
            .rows
            .unsqueeze(0)?
            .broadcast_mul(&p.row_stride)?
            .broadcast_add(&p.heads)?
            .broadcast_add(&plan.positions.unsqueeze(0)?)?
            .reshape((kv * chunk, 1))?
            .broadcast_as((kv * chunk, head_dim))?
            .contiguous()?;
        Ok((mask, write_at))
    }

    /// Layer `layer`'s keys and values as `[rows * kv_heads * max_seq, head_dim]` views of the
    /// same memory, for a prefill's writes.
    pub(crate) fn flat(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        self.static_rows("the unfused prefill")?;
        let flat = |t: &Tensor| {
            let hd = t.dim(3)?;
            t.reshape((t.elem_count() / hd, hd))
        };
        Ok((flat(&self.k[layer])?, flat(&self.v[layer])?))
    }

    /// Sequence `row` (`[1]` u32 on the device) of layer `layer`'s keys and values: `[1,
    /// kv_heads, max_seq, head_dim]` copies.
    pub(crate) fn row(&self, layer: usize, row: &Tensor) -> Result<(Tensor, Tensor)> {
        self.static_rows("the unfused prefill")?;
        Ok((
            self.k[layer].index_select(row, 0)?,
            self.v[layer].index_select(row, 0)?,
        ))
    }

    /// Advances each of `plan`'s segment rows by its length in `len` (`[segments]` u32, as
    /// `plan.row`), on the device.
    pub(crate) fn step_row(&self, plan: &PrefillPlan, len: &Tensor) -> Result<()> {
        let Some(p) = &self.prefill else {
            candle_core::bail!("prefill needs a serving kv cache");
        };
        // [max_batch, segments]: which segment each sequence is, times its length.
        let hit = p
            .rows
            .unsqueeze(1)?
            .broadcast_eq(&plan.row.unsqueeze(0)?)?
            .to_dtype(DType::U32)?;
        let advance = hit.broadcast_mul(&len.unsqueeze(0)?)?.sum(1)?;
        let next = (&self.positions + advance)?;
        self.positions.slice_set(&next, 0, 0)
    }

    /// Layer `layer`'s keys and values of every row (the scratch row included).
    pub(crate) fn layer_all(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.k[layer].clone(), self.v[layer].clone()))
    }

    /// Refuses `what` on a paged cache (only the fused ops read pages).
    fn static_rows(&self, what: &str) -> Result<()> {
        if self.pages.is_some() {
            candle_core::bail!(
                "{what} reads a kv cache by rows, and this one is paged: use a static cache (Decoder::new_serving_cache)"
            );
        }
        Ok(())
    }

    /// Sequences `0..batch` of layer `layer`'s keys and values.
    pub(crate) fn layer(&self, layer: usize, batch: usize) -> Result<(Tensor, Tensor)> {
        self.static_rows("a step by rows")?;
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
        self.static_rows("the unfused attention")?;
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
        KvCache::new(
            1,
            (2, 1, 4, 2),
            window,
            false,
            None,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap()
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
