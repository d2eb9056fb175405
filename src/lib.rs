//! graft: CUDA graph trees for Rust tensor frameworks (facade over graft-core and its backends).
pub use graft_core::*;
pub use graft_sim as sim;
