//! `SharedExpert`: the expert every token goes through beside its routed ones (Qwen2-MoE),
//! scaled by the sigmoid of its own gate: `sigmoid(h · gate_w) * down · (silu(h · gate) *
//! (h · up))`, in three matrix-vector launches (gate, up and SwiGLU; the gate's logit; the
//! down projection with the sigmoid scaling), which [`SharedExpert::beside`] puts on a side
//! stream while the routed experts run on the device's.

use candle_core::{Result, Tensor};

use crate::linear::project;
use crate::{SideStream, check};

const OP: &str = "shared_expert";

/// A shared expert's weights (held, never copied): `gate` and `up` `[intermediate, hidden]`,
/// `down` `[hidden, intermediate]`, `gate_w` `[1, hidden]`.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    gate_w: Tensor,
}

impl SharedExpert {
    /// The expert of these weights, of one float dtype and device, contiguous.
    pub fn new(gate: Tensor, up: Tensor, down: Tensor, gate_w: Tensor) -> Result<SharedExpert> {
        check::float(OP, "gate", &gate)?;
        let &[f, d] = gate.dims() else {
            return Err(check::shape(OP, "gate", &gate, "[intermediate, hidden]"));
        };
        for (input, w, dims) in [
            ("up", &up, [f, d]),
            ("down", &down, [d, f]),
            ("gate_w", &gate_w, [1, d]),
        ] {
            check::like(OP, input, w, "gate", &gate)?;
            if w.dims() != dims {
                return Err(check::shape(
                    OP,
                    input,
                    w,
                    "up as gate, down [hidden, intermediate], gate_w [1, hidden]",
                ));
            }
        }
        Ok(SharedExpert {
            gate,
            up,
            down,
            gate_w,
        })
    }

    /// The weights (a step's statics).
    pub fn tensors(&self) -> [&Tensor; 4] {
        [&self.gate, &self.up, &self.down, &self.gate_w]
    }

    /// The expert of `h` (`[..., hidden]`) on the device's stream.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        Ok(self.beside(h, &SideStream::none(), || Ok(()))?.0)
    }

    /// The expert of `h` launched on `side` (for a few rows on CUDA; candle's matmul on the
    /// device stream for more) while `main` enqueues the device stream's work, then joined:
    /// returns the expert's output and `main`'s result, both ready for the device stream's
    /// next work. Its intermediate tensors live until the join.
    pub fn beside<R>(
        &self,
        h: &Tensor,
        side: &SideStream,
        main: impl FnOnce() -> Result<R>,
    ) -> Result<(Tensor, R)> {
        let ((y, _kept), r) = side.beside(
            || {
                let s = project(h, &[(&self.gate, None), (&self.up, None)], true, None, side)?;
                let g = project(h, &[(&self.gate_w, None)], false, None, side)?;
                let y = project(&s, &[(&self.down, None)], false, Some(&g), side)?;
                Ok((y, [s, g]))
            },
            main,
        )?;
        Ok((y, r))
    }
}
