//! graft-core: the backend-neutral runtime of graft (device layer, pool, buffers, the graph tree).
#![forbid(unsafe_code)]

pub mod buffer;
pub mod config;
pub mod ctx;
pub mod device;
pub mod diag;
pub mod error;
pub mod graft;
mod introspect;
mod lifecycle;
mod memory;
mod plan;
pub mod pool;
pub mod reason;
mod record;
mod replay;
mod run;
pub mod stats;
mod tree;

pub use buffer::{Buffer, BufferError, NodeId, NodeLabel};
pub use config::{AllowEntry, Config, FunctionSpec, Mode};
pub use ctx::{Ctx, RunKind};
pub use device::{
    CaptureMode, CaptureViolation, CopyEnds, Device, DeviceError, DeviceId, DeviceOp, DevicePtr,
    GraphSummary, StickyError,
};
pub use diag::{InputKind, MemoryReport, NodeInfo};
pub use error::{BodyError, CallError, FunctionId, MemoryError, VerifyTarget};
pub use graft::{Graft, Outcome};
pub use lifecycle::Phase;
pub use reason::{Decision, DecisionRecord, EagerReason, RecordReason, WarmupReason};
pub use stats::{RerecordCounts, Stats};
pub use tree::Output;
