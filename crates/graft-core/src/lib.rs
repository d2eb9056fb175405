//! graft-core: the backend-neutral runtime of graft (device layer, pool, buffers, the graph tree).
//!
//! The root holds what a framework embedding graft uses. [`backend`] holds what a backend
//! author implements; `testing` (feature `test-support`) what graft's own tests and benches
//! inspect.
#![forbid(unsafe_code)]

mod bucket;
mod buffer;
mod config;
mod coordinator;
mod ctx;
mod deliver;
mod device;
mod diag;
mod error;
mod evict;
mod graft;
mod group;
#[cfg(feature = "test-support")]
mod introspect;
mod lifecycle;
mod memory;
mod plan;
mod prepare;
// Its inspection surface (`testing`) is only reachable with the test-support feature.
#[cfg_attr(
    not(feature = "test-support"),
    allow(unreachable_pub, dead_code, unused_imports)
)]
mod pool;
mod reason;
mod record;
mod replay;
mod run;
mod signature;
mod stats;
mod tree;

pub use bucket::{Bucket, Buckets, BucketsError};
pub use buffer::{Buffer, BufferError, NodeId, NodeLabel};
pub use config::{AllowEntry, Config, FunctionSpec, Mode};
pub use coordinator::{Coordinator, StartError, StepError};
pub use ctx::{Ctx, RunKind};
pub use device::{
    CaptureMode, CaptureViolation, Device, DeviceError, DeviceId, DeviceOp, DevicePtr,
    GraphSummary, UpdateRefusal,
};
pub use diag::{InputKind, MemoryReport, NodeInfo};
pub use deliver::Destinations;
pub use error::{AnyError, BodyError, CallError, FunctionId, MemoryError, VerifyTarget};
pub use graft::{Graft, Outcome};
pub use group::{GroupError, Member};
pub use lifecycle::Phase;
pub use pool::{PoolError, PoolStats};
pub use prepare::{BucketCapture, CaptureReport};
pub use reason::{Decision, DecisionRecord, EagerReason, EvictReason, RecordReason, WarmupReason};
pub use stats::{RerecordCounts, Stats};
pub use tree::Output;

/// What a backend author implements and uses: the [`Device`] trait, its
/// capture lifecycle and memory rules (see the trait's module documentation), and the types
/// its methods take and return.
pub mod backend {
    pub use crate::device::{
        CaptureMode, CaptureViolation, CopyEnds, Device, DeviceError, DeviceId, DeviceOp,
        DevicePtr, GraphSummary, StickyError, UpdateRefusal,
    };
}

/// What graft's own tests and benches inspect: the pool on its own. Not a stable interface.
#[cfg(feature = "test-support")]
pub mod testing {
    pub use crate::pool::{Backing, Block, BlockId, Checkpoint, InvariantViolation, Pool};
    pub use crate::tree::TreeViolation;
}
