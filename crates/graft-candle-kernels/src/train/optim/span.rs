//! The overlap check of a multi-tensor step's lists: no tensor the step writes may share
//! memory with another tensor of the step (read ones may share with each other).

use candle_core::{Result, Tensor};

use crate::KernelError;

/// Where a contiguous tensor's elements lie: its storage (by address) and element range.
pub(super) struct Span {
    storage: usize,
    start: usize,
    end: usize,
    /// Whether the step writes it.
    writes: bool,
    input: &'static str,
    index: usize,
}

impl Span {
    pub(super) fn of(t: &Tensor, input: &'static str, index: usize, writes: bool) -> Span {
        let (storage, layout) = t.storage_and_layout();
        let start = layout.start_offset();
        Span {
            storage: std::ptr::from_ref(&*storage).addr(),
            start,
            end: start + t.elem_count(),
            writes,
            input,
            index,
        }
    }

    /// Checks that no written span overlaps another span (read spans may overlap each other).
    pub(super) fn check(op: &'static str, mut spans: Vec<Span>) -> Result<()> {
        spans.retain(|s| s.start < s.end);
        spans.sort_by_key(|s| (s.storage, s.start));
        // Of the spans so far in the current storage: the one reaching furthest, and the
        // written one reaching furthest (sorted by start, a span overlaps an earlier one
        // exactly when it starts before that one's end).
        let mut any: Option<&Span> = None;
        let mut written: Option<&Span> = None;
        for s in &spans {
            if any.is_some_and(|a| a.storage != s.storage) {
                (any, written) = (None, None);
            }
            let clash = if s.writes { any } else { written };
            if let Some(c) = clash.filter(|c| c.end > s.start) {
                return Err(KernelError::Overlap {
                    op,
                    input: s.input,
                    index: s.index,
                    other: c.input,
                    other_index: c.index,
                }
                .into());
            }
            if any.is_none_or(|a| s.end > a.end) {
                any = Some(s);
            }
            if s.writes && written.is_none_or(|w| s.end > w.end) {
                written = Some(s);
            }
        }
        Ok(())
    }
}
