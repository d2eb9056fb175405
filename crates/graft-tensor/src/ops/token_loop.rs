//! The bookkeeping of a device-side token loop: [`loop_begin`] makes its state before the
//! loop ([`TokenLoop`]: the token buffer, the current tokens, the tokens each row may still
//! emit, and the loop's flag and iteration), and [`loop_record`] ends each iteration with one
//! kernel that stores the step's tokens and decides whether another iteration runs.

use graft_core::Buffer;

use super::{dtype_is, position, shape_is};
use crate::backend::{Backend, LoopArgs, LoopDims, Ops};
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::tensor::{Alloc, Tensor};

/// What a token loop's buffer holds where a row had stopped, or where an iteration did not
/// run (token ids are never negative).
pub const PAD: i32 = -1;

/// The device state of a token loop of up to `steps` iterations over `rows` sequences, made by
/// [`loop_begin`] before the loop (so it outlives every iteration).
#[derive(Clone, Debug)]
pub struct TokenLoop {
    out: Tensor,
    cur: Tensor,
    left: Tensor,
    ctl: Tensor,
    pos: Tensor,
    dims: LoopDims,
}

impl TokenLoop {
    /// `[steps, rows]` i32: iteration `i`'s token of row `r`, or [`crate::PAD`] where the row
    /// had stopped or the iteration did not run.
    pub fn tokens(&self) -> &Tensor {
        &self.out
    }

    /// `[rows]` i32: the tokens the next iteration decodes from (after the loop: the last
    /// step's tokens, every row's).
    pub fn current(&self) -> &Tensor {
        &self.cur
    }

    /// The loop's flag: a u32 at the start of this buffer, non-zero while another iteration
    /// is to run (what [`graft_core::Ctx::while_loop`] tests).
    pub fn flag(&self) -> &Buffer {
        self.ctl.buffer()
    }

    fn args(&self) -> LoopArgs<'_> {
        LoopArgs {
            out: &self.out,
            cur: &self.cur,
            left: &self.left,
            ctl: &self.ctl,
            pos: &self.pos,
        }
    }
}

/// Starts a token loop of at most `steps` iterations over the rows of `tokens` (`[rows]` i32,
/// the first iteration's input), each row emitting at most `limits[r]` tokens (`[rows]` i32;
/// 0: stopped from the start) and stopping after `eos` (none if `None` or negative). The loop
/// also stops once the device position `pos` reaches `ctx`. Allocates the loop's state from
/// `cx` and initializes it with one kernel; the flag is set if an iteration is to run.
///
/// # Errors
/// Shape and dtype errors; [`TensorError::LoopLength`] for `steps` of 0 or a token buffer
/// of more than `i32::MAX` entries.
#[allow(clippy::too_many_arguments)]
pub fn loop_begin<D: Backend, A: Alloc<D> + ?Sized>(
    k: &D::Ops,
    cx: &mut A,
    tokens: &Tensor,
    limits: &Tensor,
    pos: &Tensor,
    steps: usize,
    ctx: i32,
    eos: Option<i32>,
) -> Result<TokenLoop> {
    const OP: &str = "loop_begin";
    dtype_is(OP, "tokens", tokens, DType::I32)?;
    let rows = match *tokens.shape() {
        [rows] => rows,
        _ => {
            return Err(TensorError::Shape {
                op: OP,
                operand: "tokens",
                expected: vec![tokens.numel()],
                found: tokens.shape().to_vec(),
            });
        }
    };
    dtype_is(OP, "limits", limits, DType::I32)?;
    shape_is(OP, "limits", limits, &[rows])?;
    position(OP, pos)?;
    let max = i32::MAX as usize / rows.max(1);
    if steps == 0 || steps > max {
        return Err(TensorError::LoopLength {
            max_tokens: steps,
            max,
        });
    }
    let dims = LoopDims {
        rows,
        steps,
        ctx,
        eos: eos.unwrap_or(-1),
    };
    let state = TokenLoop {
        out: Tensor::empty(cx, &[steps, rows], DType::I32)?,
        cur: Tensor::empty(cx, &[rows], DType::I32)?,
        left: Tensor::empty(cx, &[rows], DType::I32)?,
        ctl: Tensor::empty(cx, &[2], DType::U32)?,
        pos: pos.clone(),
        dims,
    };
    k.loop_begin(&state.args(), tokens, limits, dims)?;
    Ok(state)
}

/// Ends an iteration of `state`'s loop with the step's tokens `next` (`[rows]` i32): rows
/// with tokens left store theirs at the iteration's row of the token buffer, `next` becomes
/// the current tokens, and the flag is cleared once every row has stopped, the loop's
/// `steps` iterations have run or the position has reached the context.
///
/// # Errors
/// Shape and dtype errors of `next`.
pub fn loop_record<K: Ops + ?Sized>(k: &K, state: &TokenLoop, next: &Tensor) -> Result<()> {
    const OP: &str = "loop_record";
    dtype_is(OP, "next", next, DType::I32)?;
    shape_is(OP, "next", next, &[state.dims.rows])?;
    k.loop_record(&state.args(), next, state.dims)
}
