//! graft: CUDA graph trees for Rust tensor frameworks (facade over graft-core, its backends and
//! graft-launch, ranks as processes).
//!
//! See the README and `docs/guide.md` for how to embed it.
pub use graft_core::*;
pub use graft_cuda as cuda;
pub use graft_launch as launch;
pub use graft_sim as sim;

#[doc = include_str!("../docs/guide.md")]
pub mod guide {}
