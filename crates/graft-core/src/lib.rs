//! graft-core: the backend-neutral runtime of graft (device layer, pool, buffers, the graph tree).
//!
//! The root holds what a framework embedding graft uses, the [`Device`] trait included (as a
//! bound: its dangerous methods are sealed to graft-core, see [`backend::CoreOnly`]).
//! [`backend`] holds what a backend author needs beyond that; `testing` (feature
//! `test-support`) what graft's own tests and benches inspect.
#![forbid(unsafe_code)]

mod admit;
mod bucket;
mod buffer;
mod buffer_error;
mod buffer_io;
mod churn;
mod conditional;
mod config;
mod coordinator;
mod ctx;
mod deliver;
mod destinations;
mod device;
mod diag;
mod error;
mod evict;
mod fork;
mod graft;
mod group;
mod guard;
#[cfg(feature = "test-support")]
mod introspect;
mod lifecycle;
mod memory;
mod node_id;
mod plan;
mod policy;
mod pool;
mod pools;
mod prepare;
mod reason;
mod record;
mod replay;
mod run;
mod signature;
mod stats;
mod tree;
mod uses;
mod view;

pub use bucket::{Bucket, Buckets, BucketsError};
pub use buffer::Buffer;
pub use buffer_error::BufferError;
pub use churn::Churn;
pub use conditional::Branch;
pub use config::{AllowEntry, Config, FunctionSpec, Mode};
pub use coordinator::{Coordinator, StartError, StepError};
pub use ctx::{Ctx, RunKind};
pub use destinations::Destinations;
pub use device::{
    CaptureMode, CaptureViolation, Conditional, ConditionalRule, Device, DeviceError, DeviceId,
    DeviceOp, DevicePtr, ForkRule, GraphDifference, GraphSummary, UpdateRefusal,
};
pub use diag::{InputKind, MemoryReport, NodeInfo};
pub use error::{AnyError, BodyError, CallError, FunctionId, MemoryError, VerifyTarget};
pub use graft::{Graft, Outcome};
pub use group::{Ballot, BallotBox, Gone, GroupError, Member};
pub use guard::{GuardFinding, Guards};
pub use lifecycle::Phase;
pub use node_id::{NodeId, NodeLabel};
pub use pool::{PoolError, PoolStats};
pub use prepare::{BucketCapture, CaptureReport};
pub use reason::{Decision, DecisionRecord, EagerReason, EvictReason, RecordReason, WarmupReason};
pub use stats::{RerecordCounts, Stats};
pub use tree::Output;

/// What a backend author needs beyond the crate root, where the [`Device`] trait and the types
/// its methods take and return live: the token that seals the trait's dangerous methods to
/// graft-core ([`CoreOnly`](backend::CoreOnly)), the ends of a recorded copy, and the sticky
/// error slot backends embed.
pub mod backend {
    pub use crate::device::{CopyEnds, CoreOnly, StickyError};
}

/// What graft's own tests and benches inspect: the pool on its own. Not a stable interface.
#[cfg(feature = "test-support")]
pub mod testing {
    pub use crate::pool::{Backing, Block, BlockId, Checkpoint, InvariantViolation, Pool};
    pub use crate::tree::TreeViolation;
}
