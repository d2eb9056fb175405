//! graft-core: the backend-neutral runtime of graft (device layer, pool, buffers, the graph tree).
#![forbid(unsafe_code)]

pub mod device;

pub use device::{
    CaptureMode, CaptureViolation, Device, DeviceError, DeviceId, DeviceOp, DevicePtr,
    GraphSummary, StickyError,
};
