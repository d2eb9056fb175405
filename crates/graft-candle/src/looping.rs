//! `Loops`: what a step's body uses to loop on the device (a CUDA conditional WHILE node when graft records it), or on the host when the step runs eagerly.

use candle_core::{Result, Tensor};

/// Handed to the body of [`crate::CandleGraft::call_looping`]: `while_loop` runs its closure
/// while a `u32` flag tensor is not 0.
pub struct Loops<'c> {
    /// Through graft's context (recorded as a conditional node, or on the host in a warmup)
    /// when graft runs the body; `None` on the host (an eager run, any device).
    pub(crate) graft: Option<&'c mut dyn LoopCtx>,
}

/// What [`Loops`] calls when graft runs the body (the CUDA engine's loop context).
pub(crate) trait LoopCtx {
    /// graft-core's `Ctx::while_loop` over `flag`, with `body` as each iteration.
    fn while_loop(&mut self, flag: &Tensor, body: &mut dyn FnMut() -> Result<()>) -> Result<()>;
}

impl std::fmt::Debug for Loops<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.graft.is_some() {
            "graft"
        } else {
            "host"
        };
        f.debug_struct("Loops").field("how", &how).finish()
    }
}

impl Loops<'_> {
    /// Runs `body` again and again while the first element of `flag` (a `u32` tensor the body
    /// rewrites in place, 0 to stop) is not 0, tested before each iteration. Under graft
    /// the whole loop is one conditional node: a replay runs every iteration on the GPU with
    /// no host round trip. `flag` must be made before the loop (a static, or a tensor made
    /// earlier in the body) and every tensor the body makes must be dropped by the end of
    /// its iteration; state that crosses iterations is written in place (`slice_set`,
    /// `scatter_set`) into tensors made before the loop.
    ///
    /// A loop the device cannot record (a driver older than CUDA 12.8, a body that keeps a
    /// tensor past its iteration, a collective) makes the step run eagerly, looping on the
    /// host, with the reason in its outcome.
    pub fn while_loop(
        &mut self,
        flag: &Tensor,
        mut body: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        match &mut self.graft {
            None => loop {
                if flag.flatten_all()?.get(0)?.to_scalar::<u32>()? == 0 {
                    return Ok(());
                }
                body()?;
            },
            Some(ctx) => ctx.while_loop(flag, &mut body),
        }
    }
}
