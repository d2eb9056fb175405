//! Memory planning for serving: record every bucket first, measure what the graphs hold,
//! then give the kv cache all the memory left but a stated margin.

use std::time::Instant;

use super::{Engine, model};
use graft_candle::Error;

/// The sequences a serving cache of `row_bytes` per sequence can hold in `free` bytes,
/// keeping `margin` free: its scratch row takes one row's bytes too.
pub fn kv_rows(free: u64, margin: u64, row_bytes: u64) -> usize {
    let rows = free.saturating_sub(margin) / row_bytes.max(1);
    usize::try_from(rows.saturating_sub(1)).unwrap_or(usize::MAX)
}

/// What [`plan`] measured and decided, in bytes and seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Free device memory before the recordings (weights loaded, capture cache allocated).
    pub free_before_capture: u64,
    /// Seconds to record every bucket (warmups included) against the capture cache.
    pub capture_s: f64,
    /// Calls that took.
    pub capture_calls: usize,
    /// CUDA's graph memory after the recordings (the driver's physical memory for the
    /// graphs' allocations, trimmed to what they use).
    pub graph_driver: u64,
    /// graft's graph pool (mapped bytes).
    pub graph_pool: u64,
    /// Free memory once the capture cache is gone: what the serving cache is sized from.
    pub free_for_cache: u64,
    /// Kept free on purpose.
    pub margin: u64,
    /// Bytes per sequence of the cache (all layers' keys and values of `max_seq` positions).
    pub row_bytes: u64,
    /// Sequences of the serving cache (a paged cache keeps the engine's).
    pub sequences: usize,
    /// A paged cache's blocks and the bytes of one (`None` for static rows): a paged cache
    /// gets every block that fits, whatever its sequences.
    pub blocks: Option<(usize, u64)>,
    /// Bytes of the serving cache (its scratch row included).
    pub cache_bytes: u64,
    /// Seconds to record every bucket again against the serving cache.
    pub repoint_s: f64,
    /// CUDA's graph memory after that (equal to `graph_driver` when nothing grew).
    pub graph_driver_after: u64,
    /// Free memory at the end.
    pub free_after: u64,
}

/// Plans `engine`'s memory (see the module documentation): records every bucket against
/// the engine's cache (which must hold the largest decode bucket: the capture cache),
/// measures the graph memory, frees the capture cache, gives a new cache every sequence that
/// fits in the memory left but `margin`, and records every bucket again against it (with
/// `Config::replace_moved_static` each graph is updated in place). Fails, before any
/// allocation that could fail, when the cache would not hold the largest decode bucket.
pub fn plan(engine: &mut Engine<'_>, margin: u64) -> Result<MemoryPlan, Error> {
    let device = engine
        .model
        .device()
        .as_cuda_device()
        .map_err(model)?
        .clone();
    let (free_before_capture, _) = graft_candle::cuda::free_memory(&device)?;
    let started = Instant::now();
    let capture_calls = engine.capture()?;
    graft_candle::cuda::trim_graph_memory(&device)?;
    let capture_s = started.elapsed().as_secs_f64();
    let graph_driver = graft_candle::cuda::graph_memory(&device)?.mapped_current;
    let graph_pool = engine
        .graft()
        .and_then(|g| g.graft())
        .map_or(0, |g| g.memory_report().mapped_bytes as u64);
    let row_bytes = engine.cache.row_bytes() as u64;
    let max_seq = engine.cache.max_seq();
    let paged = engine.cache.block_size().zip(engine.cache.block_bytes());
    // A one-position placeholder holds the cache's place while the capture cache is freed.
    let placeholder = engine.model.new_serving_cache(1, 1).map_err(model)?;
    drop(std::mem::replace(&mut engine.cache, placeholder));
    let (free_for_cache, _) = graft_candle::cuda::free_memory(&device)?;
    let largest = engine.config.decode_buckets.largest();
    let (sequences, blocks) = match paged {
        None => {
            let sequences = kv_rows(free_for_cache, margin, row_bytes);
            if sequences < largest {
                return Err(model(candle_core::Error::Msg(format!(
                    "{free_for_cache} bytes are free after recording ({graph_driver} in graphs), enough for a kv cache of {sequences} sequences of {max_seq} positions, fewer than the largest decode bucket ({largest}): lower it, lower max_seq or the margin ({margin} bytes)"
                ))));
            }
            engine.cache = engine
                .model
                .new_serving_cache(sequences, max_seq)
                .map_err(model)?;
            (sequences, None)
        }
        Some((block_size, block_bytes)) => {
            // The scratch block is the one `kv_rows` keeps for a scratch row.
            let blocks = kv_rows(free_for_cache, margin, block_bytes as u64);
            let sequences = engine.config.max_running.unwrap_or(largest).max(largest);
            if blocks * block_size < max_seq {
                return Err(model(candle_core::Error::Msg(format!(
                    "{free_for_cache} bytes are free after recording ({graph_driver} in graphs), enough for {blocks} kv blocks of {block_size} positions, fewer than one sequence of max_seq ({max_seq}): lower max_seq or the margin ({margin} bytes)"
                ))));
            }
            engine.cache = engine
                .model
                .new_paged_cache(sequences, max_seq, blocks, block_size)
                .map_err(model)?;
            (sequences, Some((blocks, block_bytes as u64)))
        }
    };
    engine.pool = super::pool_of(&engine.cache)?;
    let cache_bytes = engine.cache.bytes() as u64;
    let started = Instant::now();
    engine.capture()?;
    graft_candle::cuda::trim_graph_memory(&device)?;
    let repoint_s = started.elapsed().as_secs_f64();
    let graph_driver_after = graft_candle::cuda::graph_memory(&device)?.mapped_current;
    let (free_after, _) = graft_candle::cuda::free_memory(&device)?;
    Ok(MemoryPlan {
        free_before_capture,
        capture_s,
        capture_calls,
        graph_driver,
        graph_pool,
        free_for_cache,
        margin,
        row_bytes,
        sequences,
        blocks,
        cache_bytes,
        repoint_s,
        graph_driver_after,
        free_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_gets_all_but_the_margin_less_its_scratch_row() {
        assert_eq!(kv_rows(10_000, 1_000, 1_000), 8);
        assert_eq!(kv_rows(10_999, 1_000, 1_000), 8);
        assert_eq!(kv_rows(500, 1_000, 1_000), 0);
        assert_eq!(kv_rows(1_500, 0, 1_000), 0);
    }
}
