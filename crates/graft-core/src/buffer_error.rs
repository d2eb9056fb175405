//! `BufferError`, why a buffer can no longer be used (a leaf: it imports only node ids, so the device layer can name it without depending on buffers).

use std::sync::Arc;

use crate::node_id::NodeLabel;

/// Why a buffer can no longer be read.
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum BufferError {
    /// A later warmup, recording or replay reused the buffer's memory.
    #[error(
        "buffer produced by {function} (node {node}, generation {generation}) was overwritten by node {overwritten_by} \
         in a later step; copy it out with Graft::copy_out before the next step, or keep it in a buffer you own"
    )]
    Overwritten {
        /// Name of the function that produced the buffer.
        function: Arc<str>,
        /// Node that produced it, or `-` for a warmup or eager run.
        node: NodeLabel,
        /// Generation (step) that produced it.
        generation: u64,
        /// Node whose replay or recording reused the memory (`-` for a warmup).
        overwritten_by: NodeLabel,
    },
    /// The memory was reclaimed when the buffer could not be kept (a restore found it overlapping live memory).
    #[error(
        "buffer produced by {function} (node {node}, generation {generation}) was reclaimed by the pool; \
         copy outputs out with Graft::copy_out before diverging from a recorded path"
    )]
    Reclaimed {
        /// Name of the function that produced the buffer.
        function: Arc<str>,
        /// Node that produced it.
        node: NodeLabel,
        /// Generation that produced it.
        generation: u64,
    },
    /// `Graft::reset` freed every graph and segment.
    #[error(
        "buffer produced by {function} (generation {generation}) was freed by Graft::reset; \
         copy outputs out before resetting, or allocate long-lived buffers with Graft::alloc"
    )]
    Reset {
        /// Name of the function that produced the buffer.
        function: Arc<str>,
        /// Generation that produced it.
        generation: u64,
    },
    /// The `Graft` that made the buffer was dropped or closed, and its memory with it.
    #[error(
        "buffer made by {function} (generation {generation}) was freed when its Graft was dropped or closed; \
         keep the runtime alive while you use its buffers, or copy them into memory you own first"
    )]
    Dropped {
        /// Name of the function that produced the buffer (`alloc` for `Graft::alloc`).
        function: Arc<str>,
        /// Generation that produced it.
        generation: u64,
    },
}
