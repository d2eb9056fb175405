//! Where a step's tokens are in the cache ([`Slots`]), and the fused cache write and
//! attention at those slots: graft-candle-kernels' static-row or paged op, as the cache's
//! lookup says.

use candle_core::{Result, Tensor};
use graft_candle_kernels::{
    QkNorm, decode_attention, decode_attention_paged, prefill_attention, prefill_attention_paged,
    rope_store, rope_store_paged,
};

use crate::cache::Lookup;
use crate::rope::Rope;
use crate::spec::DecoderSpec;

/// Where a step's tokens are in the cache, for [`Decoder::blocks_at`].
pub(crate) struct Slots<'a> {
    /// `[n]` u32: each token's position.
    pub(crate) positions: &'a Tensor,
    /// Where each token's cache slots are (its cache row, or its sequence's block table).
    pub(crate) lookup: &'a Lookup,
    /// The unfused attention's mask (`[n, 1, 1, max_seq]`), where the heads do not fit the
    /// fused one (decode only: a prefill then runs `prefill_unfused`).
    pub(crate) mask: Option<&'a Tensor>,
    /// The tokens come in long runs of one sequence's consecutive positions (a prefill
    /// chunk): the attention takes tiles of them (`prefill_attention`).
    pub(crate) runs: bool,
}

impl Slots<'_> {
    /// The rotated queries of `qkv` (`[n, (heads + 2 kv_heads) * head_dim]`), the rotated keys
    /// and the values written into `caches` at the slots.
    pub(crate) fn store(
        &self,
        qkv: &Tensor,
        rope: &Rope,
        caches: (&Tensor, &Tensor),
        heads: usize,
        norm: Option<QkNorm<'_>>,
    ) -> Result<Tensor> {
        let (cos, sin, style) = (&rope.cos, &rope.sin, rope.style());
        match self.lookup {
            Lookup::Rows(rows) => rope_store(
                qkv,
                cos,
                sin,
                self.positions,
                rows.as_ref(),
                caches,
                heads,
                style,
                norm,
            ),
            Lookup::Pages(table) => rope_store_paged(
                qkv,
                cos,
                sin,
                self.positions,
                table,
                caches,
                heads,
                style,
                norm,
            ),
        }
    }

    /// The fused attention of `q` over `caches` up to each slot's position.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        (k, v): (&Tensor, &Tensor),
        s: &DecoderSpec,
    ) -> Result<Tensor> {
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let window = s.sliding_window;
        let at = self.positions;
        match (self.lookup, self.runs) {
            (Lookup::Rows(Some(rows)), true) => prefill_attention(q, k, v, at, rows, scale, window),
            (Lookup::Rows(rows), _) => decode_attention(q, k, v, at, rows.as_ref(), scale, window),
            (Lookup::Pages(table), true) => {
                prefill_attention_paged(q, k, v, at, table, scale, window)
            }
            (Lookup::Pages(table), false) => {
                decode_attention_paged(q, k, v, at, table, scale, window)
            }
        }
    }
}
