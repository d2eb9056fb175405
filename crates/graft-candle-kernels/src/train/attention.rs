//! `causal_attention`: causal self-attention of whole sequences with its backward pass, both
//! fused (flash-attention style): the forward pass keeps each row's softmax log-sum-exp
//! instead of the attention matrix, and the backward pass recomputes the weights from it.
//!
//! Three custom ops over (q, k, v): the forward op (tracked by candle's autograd, its `bwd`
//! running the other two), the query-gradient op (which also keeps each row's
//! `delta = rowsum(dO * O)`) and the key-and-value-gradient op. Each has a CUDA kernel
//! (`cuda.rs`, source in `causal_attention.cu`) and a CPU implementation (`cpu.rs`). The
//! values the ops read beside their three typed inputs (the output, its gradient, the
//! log-sum-exps, the deltas) are tensors the ops hold.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::saved::Saved;
use crate::cpu::float_dispatch;
use crate::{KernelError, check};

const OP: &str = "causal_attention";

/// CUDA's limit on the grid's y and z dimensions (heads and sequences).
const GRID_YZ_LIMIT: usize = 65535;
/// The longest sequence: the kernels index rows in 32 bits and step past the end by a tile.
const MAX_SEQ: usize = u32::MAX as usize - 64;

/// Causal self-attention of whole sequences, forward and backward fused (training, prefill).
///
/// - `q`: `[batch, seq, heads * head_dim]`; `k`, `v`: `[batch, seq, kv_heads * head_dim]`:
///   the projections' outputs, token-major (not transposed to head-major), each contiguous (a
///   start offset is fine), of one dtype (f32, bf16 or f16) and device; batch and seq at
///   least 1;
/// - query head `h` reads key/value head `h / (heads / kv_heads)` (grouped-query attention;
///   keys and values are never repeated); `heads` must be a multiple of `kv_heads`;
/// - `head_dim = q.dim(2) / heads` must be 64 or 128 on every backend
///   ([`causal_attention_fits`]), so a model decides between this and the unfused attention
///   the same way on the CPU and on a GPU.
///
/// Returns `[batch, seq, heads * head_dim]` in q's dtype, token-major (the output projection
/// reads it as it is): row `i` of each sequence attends to keys `0..=i`, with scores
/// `q·k / sqrt(head_dim)`, the softmax and the sums in f32 and one rounding at the end.
///
/// Differentiable: `loss.backward()` computes the gradients of q, k and v in their dtype with
/// fused kernels, recomputing the attention weights from the row log-sum-exps this forward
/// pass keeps (nothing of size seq × seq is ever stored). The CUDA kernels are deterministic
/// (no atomics: the same inputs give bitwise the same outputs and gradients) and their launch
/// configurations depend only on the shapes and the device's multiprocessor count (small
/// grids use smaller tiles, for more blocks).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
) -> Result<Tensor> {
    let dims = Dims::of(q, k, v, heads, kv_heads)?;
    q.apply_op3(
        k,
        v,
        CausalAttention {
            dims,
            lse: Saved::default(),
        },
    )
}

/// [`causal_attention`] outside candle's autograd, keeping what its backward pass reads: the
/// output, and [`SavedAttention::backward`] for the gradients of q, k and v (the same kernels
/// and bits as `causal_attention`'s own backward pass). For a hand-written backward pass.
pub fn causal_attention_saved(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
) -> Result<SavedAttention> {
    let dims = Dims::of(q, k, v, heads, kv_heads)?;
    let op = CausalAttention {
        dims,
        lse: Saved::default(),
    };
    let out = q.apply_op3_no_bwd(k, v, &op)?;
    Ok(SavedAttention {
        op,
        q: q.clone(),
        k: k.clone(),
        v: v.clone(),
        out,
    })
}

/// A forward pass of the causal attention with what its backward pass reads
/// ([`causal_attention_saved`]).
#[derive(Debug)]
pub struct SavedAttention {
    op: CausalAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
}

impl SavedAttention {
    /// The attention's output, `[batch, seq, heads * head_dim]`.
    pub fn output(&self) -> &Tensor {
        &self.out
    }

    /// The gradients `(dq, dk, dv)` from the output's gradient `dy` (the output's shape and
    /// dtype).
    pub fn backward(&self, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        self.op.gradients(&self.q, &self.k, &self.v, &self.out, dy)
    }
}

/// Whether [`causal_attention`] takes this head dim (`Err` says why not): 64 and 128, on the
/// CPU and on CUDA alike; a model decides once, at load, between it and the unfused attention.
pub fn causal_attention_fits(head_dim: usize) -> std::result::Result<(), KernelError> {
    if head_dim == 64 || head_dim == 128 {
        Ok(())
    } else {
        Err(KernelError::Unsupported {
            op: OP,
            reason: "the fused causal attention takes head dim 64 or 128 only",
        })
    }
}

/// The attention's sizes, checked.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, kv_heads: usize) -> Result<Self> {
        check::float(OP, "q", q)?;
        check::like(OP, "k", k, "q", q)?;
        check::like(OP, "v", v, "q", q)?;
        let &[batch, seq, width] = q.dims() else {
            return Err(check::shape(OP, "q", q, "[batch, seq, heads * head_dim]"));
        };
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::Heads {
                op: OP,
                heads,
                kv_heads,
            }
            .into());
        }
        if batch == 0 || seq == 0 || !width.is_multiple_of(heads) {
            return Err(check::shape(
                OP,
                "q",
                q,
                "[batch, seq, heads * head_dim] with batch and seq at least 1",
            ));
        }
        let head_dim = width / heads;
        causal_attention_fits(head_dim)?;
        if k.dims() != [batch, seq, kv_heads * head_dim] {
            return Err(check::shape(
                OP,
                "k",
                k,
                "[batch, seq, kv_heads * head_dim] with q's batch, seq and head dim",
            ));
        }
        if v.dims() != k.dims() {
            return Err(check::shape(OP, "v", v, "k's shape"));
        }
        for (what, size, limit) in [
            ("the batch", batch, GRID_YZ_LIMIT),
            ("the query head count", heads, GRID_YZ_LIMIT),
            ("the sequence length", seq, MAX_SEQ),
        ] {
            if size > limit {
                return Err(KernelError::TooLarge { op: OP, what, size }.into());
            }
        }
        check::contiguous(OP, "q", q)?;
        check::contiguous(OP, "k", k)?;
        check::contiguous(OP, "v", v)?;
        Ok(Self {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// Query heads per KV head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The scores' scale, `1 / sqrt(head_dim)`.
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The first element of query (or output) row `i` of head `h` of sequence `b`.
    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.seq + i) * self.heads + h) * self.head_dim
    }

    /// The first element of key (or value) row `j` of KV head `kvh` of sequence `b`.
    fn kv_at(&self, b: usize, j: usize, kvh: usize) -> usize {
        ((b * self.seq + j) * self.kv_heads + kvh) * self.head_dim
    }

    /// The index of row `i` of head `h` of sequence `b` in the `[batch, heads, seq]` row
    /// values (log-sum-exps, deltas).
    fn row_at(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.heads + h) * self.seq + i
    }

    /// Elements of q (and of the output and its gradient).
    fn q_len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// Elements of k (and of v).
    fn kv_len(&self) -> usize {
        self.batch * self.seq * self.kv_heads * self.head_dim
    }

    /// `[batch, seq, heads * head_dim]`: the output and the query gradient.
    fn out_shape(&self) -> Shape {
        Shape::from_dims(&[self.batch, self.seq, self.heads * self.head_dim])
    }

    /// `[batch, heads, seq]`: the row log-sum-exps and deltas, f32.
    fn rows_shape(&self) -> Shape {
        Shape::from_dims(&[self.batch, self.heads, self.seq])
    }

    /// `[2, batch, seq, kv_heads * head_dim]`: the key gradient, then the value gradient.
    fn dkv_shape(&self) -> Shape {
        Shape::from_dims(&[2, self.batch, self.seq, self.kv_heads * self.head_dim])
    }
}

/// The forward op; the wrapper has checked q, k and v. Keeps the row log-sum-exps.
#[derive(Debug)]
struct CausalAttention {
    dims: Dims,
    /// `[batch, heads, seq]` f32, set by the forward pass.
    lse: Saved,
}

/// The query-gradient op: `dq` in q's dtype; keeps each row's delta.
struct AttentionDq {
    dims: Dims,
    /// The forward output O, contiguous.
    out: Tensor,
    /// Its gradient dO, contiguous, O's dtype.
    grad: Tensor,
    /// `[batch, heads, seq]` f32.
    lse: Tensor,
    /// `[batch, heads, seq]` f32 `rowsum(dO * O)`, set by this op's pass.
    delta: Saved,
}

/// The key-and-value-gradient op: `[2, batch, seq, kv_heads * head_dim]` in q's dtype.
struct AttentionDkv {
    dims: Dims,
    grad: Tensor,
    lse: Tensor,
    delta: Tensor,
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims;
        let (out, lse) = float_dispatch!(OP, "q", (q, k, v), |q, k, v| {
            cpu::forward(d, q, ql, k, kl, v, vl)
        })?;
        let lse = Storage::Cpu(CpuStorage::F32(lse));
        self.lse.put(OP, lse, d.rows_shape())?;
        Ok((out, d.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, q, ql, k, kl, v, vl)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.gradients(q, k, v, res, grad_res)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl CausalAttention {
    /// The gradients of q, k and v from the output `res` and its gradient `grad_res`: the
    /// query-gradient op, then the key-and-value-gradient op.
    fn gradients(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let lse = self.lse.get(OP)?;
        check::like(OP, "the output's gradient", grad_res, "q", q)?;
        if grad_res.dims() != res.dims() {
            return Err(check::shape(
                OP,
                "the output's gradient",
                grad_res,
                "the output's shape",
            ));
        }
        let grad = grad_res.contiguous()?;
        let dq_op = AttentionDq {
            dims: self.dims,
            out: res.contiguous()?,
            grad: grad.clone(),
            lse: lse.clone(),
            delta: Saved::default(),
        };
        let dq = q.apply_op3_no_bwd(k, v, &dq_op)?;
        let dkv_op = AttentionDkv {
            dims: self.dims,
            grad,
            lse,
            delta: dq_op.delta.get(OP)?,
        };
        let dkv = q.apply_op3_no_bwd(k, v, &dkv_op)?;
        Ok((dq, dkv.get(0)?, dkv.get(1)?))
    }
}

impl CustomOp3 for AttentionDq {
    fn name(&self) -> &'static str {
        "causal_attention_dq"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (dq, delta) = float_dispatch!(OP, "q", (q, k, v), |q, k, v| {
            cpu::dq(self, q, ql, k, kl, v, vl)
        })?;
        let delta = Storage::Cpu(CpuStorage::F32(delta));
        self.delta.put(OP, delta, self.dims.rows_shape())?;
        Ok((dq, self.dims.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::dq(self, q, ql, k, kl, v, vl)
    }
}

impl CustomOp3 for AttentionDkv {
    fn name(&self) -> &'static str {
        "causal_attention_dkv"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dkv = float_dispatch!(OP, "q", (q, k, v), |q, k, v| {
            cpu::dkv(self, q, ql, k, kl, v, vl)
        })?;
        Ok((dkv, self.dims.dkv_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::dkv(self, q, ql, k, kl, v, vl)
    }
}
