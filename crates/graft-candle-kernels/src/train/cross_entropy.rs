//! `cross_entropy(logits, targets)`: the mean cross-entropy of predicting each target from
//! its row of logits, differentiable in the logits. Forward: one kernel for each row's
//! log-sum-exp and loss, one summing the losses in a fixed order; backward: one kernel writing
//! `(softmax - onehot) * dloss / rows`, reading the log-sum-exps the forward saved.
//! `classifier_with_grad` runs the head's projection and both over chunks of rows, each
//! chunk's gradient written over the logits it made, then the gradients' two GEMMs.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};

use super::saved::Saved;
use crate::cpu::float_dispatch;
use crate::{KernelError, check};

const OP: &str = "cross_entropy";

/// The mean over rows of `logsumexp(row) - row[target]`, as a `[1]` f32 tensor: `logits`
/// `[..., vocab]` (f32, bf16 or f16, contiguous), `targets` u32 of `logits`' leading dims.
/// Computed in f32. A target at or past `vocab` makes the loss NaN (a kernel cannot fail, and
/// a wrong target must not pass unseen). Differentiable in `logits`, whose gradient has their
/// dtype.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (op, targets) = checked(logits, targets)?;
    logits.apply_op2(&targets, op)
}

/// The mean cross-entropy (as [`cross_entropy`]) and its gradient in the logits, outside
/// candle's autograd: `(loss, dlogits)`, the loss's gradient taken as 1 (the loss is what the
/// step minimizes). The same kernels as `cross_entropy` and its backward pass; a hand-written
/// backward pass starts from this.
pub fn cross_entropy_with_grad(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let (op, targets) = checked(logits, targets)?;
    let loss = logits.apply_op2_no_bwd(&targets, &op)?;
    let dlogits = op.gradient(
        logits,
        &targets,
        &Tensor::ones(1, DType::F32, logits.device())?,
    )?;
    Ok((loss, dlogits))
}

/// What [`classifier_with_grad`] gives: the loss and the gradients of the classifier's two
/// inputs.
#[derive(Debug)]
pub struct ClassifierGrads {
    /// The mean cross-entropy over every row, `[1]` f32.
    pub loss: Tensor,
    /// The gradient in `h`, `h`'s shape and dtype.
    pub dh: Tensor,
    /// The gradient in `head`, `[vocab, hidden]`.
    pub dhead: Tensor,
}

/// A language model's classifier in a training step: the logits `h · headᵀ` (`h` `[...,
/// hidden]`, `head` `[vocab, hidden]`, as [`crate::dense`] takes them), their mean
/// cross-entropy against `targets` (`h`'s leading dims, u32) and its gradients in `h` and
/// `head`, over chunks of at most `chunk_rows` rows. For each chunk: the head's GEMM, the
/// cross-entropy, its gradient in the logits written over them (the same kernels as
/// [`cross_entropy_with_grad`]), then that gradient's two GEMMs, the chunk's rows of `dh` and
/// its part of `dhead` (added into the earlier chunks' by [`crate::dense_weight_grad_add`]).
/// So one chunk's `[chunk_rows, vocab]` logits exist at a time, never a `[rows, vocab]`
/// tensor; with one chunk (`chunk_rows` at least the rows) the values are those of that
/// composition over all rows, bit for bit.
pub fn classifier_with_grad(
    h: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<ClassifierGrads> {
    const CLASSIFIER: &str = "classifier_with_grad";
    if chunk_rows == 0 {
        return Err(KernelError::Unsupported {
            op: CLASSIFIER,
            reason: "chunks of no rows: pass chunk_rows of at least 1",
        }
        .into());
    }
    let (_, hidden) = head.dims2()?;
    let rows = targets.elem_count();
    if h.dims().split_last() != Some((&hidden, targets.dims())) {
        return Err(check::shape(
            CLASSIFIER,
            "h",
            h,
            "[..., hidden]: the targets' dims, then the head's columns",
        ));
    }
    let (flat_h, flat_targets) = (h.reshape((rows, hidden))?, targets.flatten_all()?);
    let chunks = rows.div_ceil(chunk_rows).max(1);
    let mut loss: Option<Tensor> = None;
    let mut dh = Vec::with_capacity(chunks);
    let mut dhead: Option<Tensor> = None;
    for chunk in 0..chunks {
        let start = chunk * chunk_rows;
        let len = chunk_rows.min(rows - start);
        let hc = flat_h.narrow(0, start, len)?;
        let logits = crate::dense(&hc, head)?;
        let (op, tc) = checked(&logits, &flat_targets.narrow(0, start, len)?)?;
        let chunk_loss = logits.apply_op2_no_bwd(&tc, &op)?;
        // The chunk's share of the mean: its gradient scale `dloss / len` is `1 / rows`.
        let share = |t: Tensor| -> Result<Tensor> {
            if chunks == 1 {
                Ok(t)
            } else {
                t.affine(len as f64 / rows as f64, 0.0)
            }
        };
        let dloss = share(Tensor::ones(1, DType::F32, logits.device())?)?;
        let backward = op.backward(&dloss)?;
        logits.inplace_op3(&tc, &op.saved.get(OP)?, &backward)?;
        let dlogits = logits;
        dh.push(crate::dense_sum(&[(&dlogits, head)])?);
        match &dhead {
            None => dhead = Some(crate::dense_weight_grad(&dlogits, &hc)?),
            Some(acc) => crate::dense_weight_grad_add(acc, &dlogits, &hc)?,
        }
        let chunk_loss = share(chunk_loss)?;
        loss = Some(match loss {
            None => chunk_loss,
            Some(sum) => (sum + chunk_loss)?,
        });
    }
    let dh = match dh.len() {
        1 => dh.swap_remove(0),
        _ => Tensor::cat(&dh, 0)?,
    };
    match (loss, dhead) {
        (Some(loss), Some(dhead)) => Ok(ClassifierGrads {
            loss,
            dh: dh.reshape(h.shape())?,
            dhead,
        }),
        _ => Err(check::shape(
            CLASSIFIER,
            "targets",
            targets,
            "at least one row",
        )),
    }
}

/// Checks [`cross_entropy`]'s arguments: its op and the targets, contiguous.
fn checked(logits: &Tensor, targets: &Tensor) -> Result<(CrossEntropy, Tensor)> {
    check::float(OP, "logits", logits)?;
    check::indices(OP, "targets", targets, logits)?;
    let Some((&vocab, lead)) = logits.dims().split_last() else {
        return Err(check::shape(OP, "logits", logits, "[..., vocab]"));
    };
    if targets.dims() != lead {
        return Err(check::shape(OP, "targets", targets, "logits' leading dims"));
    }
    check::contiguous(OP, "logits", logits)?;
    let targets = targets.contiguous()?;
    let rows = targets.elem_count();
    if rows == 0 || vocab == 0 {
        return Err(check::shape(
            OP,
            "logits",
            logits,
            "at least one row of at least one logit",
        ));
    }
    check::u32_of(OP, "the vocabulary", vocab)?;
    check::u32_of(OP, "the row count", rows)?;
    let op = CrossEntropy {
        rows,
        vocab,
        saved: Saved::default(),
    };
    Ok((op, targets))
}

/// The forward op over (logits, targets): `[1]` f32, keeping `[2 * rows]` f32 (each row's
/// loss, then its log-sum-exp) for the backward pass.
struct CrossEntropy {
    rows: usize,
    vocab: usize,
    saved: Saved,
}

/// The backward op over (logits, targets, the saved rows), with the loss's gradient (`[1]`
/// f32) held: the logits' gradient.
struct CrossEntropyBackward {
    rows: usize,
    vocab: usize,
    dloss: Tensor,
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::U32(targets) = targets else {
            return Err(unsupported("targets", targets.dtype()));
        };
        let targets = check::cpu_slice(OP, "targets", targets, tl)?;
        let rows = float_dispatch!(OP, "logits", (logits), |l| {
            cpu_rows(l, ll, targets, self.vocab)
        })?;
        let mean = rows[..self.rows].iter().sum::<f32>() / self.rows as f32;
        self.saved.put(
            OP,
            Storage::Cpu(CpuStorage::F32(rows)),
            Shape::from(2 * self.rows),
        )?;
        Ok((CpuStorage::F32(vec![mean]), Shape::from(1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (mean, rows) = cuda::forward(self.rows, self.vocab, logits, ll, targets, tl)?;
        self.saved
            .put(OP, Storage::Cuda(rows), Shape::from(2 * self.rows))?;
        Ok((mean, Shape::from(1)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(self.gradient(logits, targets, dloss)?), None))
    }
}

impl CrossEntropy {
    /// The logits' gradient from the loss's (`[1]` f32), reading the rows the forward saved.
    fn gradient(&self, logits: &Tensor, targets: &Tensor, dloss: &Tensor) -> Result<Tensor> {
        let saved = self.saved.get(OP)?;
        logits.apply_op3_no_bwd(targets, &saved, &self.backward(dloss)?)
    }

    /// The backward op for the loss's gradient `dloss` (`[1]` f32).
    fn backward(&self, dloss: &Tensor) -> Result<CrossEntropyBackward> {
        if dloss.dtype() != DType::F32 || dloss.elem_count() != 1 {
            return Err(check::shape(OP, "the loss's gradient", dloss, "[1] f32"));
        }
        Ok(CrossEntropyBackward {
            rows: self.rows,
            vocab: self.vocab,
            dloss: dloss.contiguous()?,
        })
    }
}

impl CustomOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
        saved: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = self.cpu(logits, ll, targets, tl, saved, sl)?;
        Ok((out, ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        tl: &Layout,
        saved: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dlogits = cuda::backward(
            self.rows,
            self.vocab,
            &self.dloss,
            logits,
            ll,
            targets,
            tl,
            saved,
            sl,
        )?;
        Ok((dlogits, ll.shape().clone()))
    }
}

/// The backward op writing the gradient over the logits (the classifier's).
impl InplaceOp3 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward_in_place"
    }

    fn cpu_fwd(
        &self,
        logits: &mut CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
        saved: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        whole(ll)?;
        *logits = self.cpu(logits, ll, targets, tl, saved, sl)?;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &mut candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        tl: &Layout,
        saved: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        whole(ll)?;
        cuda::backward_in_place(
            self.rows,
            self.vocab,
            &self.dloss,
            logits,
            ll,
            targets,
            tl,
            saved,
            sl,
        )
    }
}

impl CrossEntropyBackward {
    /// The gradient on the CPU, as a new storage.
    fn cpu(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        tl: &Layout,
        saved: &CpuStorage,
        sl: &Layout,
    ) -> Result<CpuStorage> {
        let (CpuStorage::U32(targets), CpuStorage::F32(saved)) = (targets, saved) else {
            return Err(unsupported("targets", targets.dtype()));
        };
        let targets = check::cpu_slice(OP, "targets", targets, tl)?;
        let saved = check::cpu_slice(OP, "saved", saved, sl)?;
        let dloss = self.dloss.to_vec1::<f32>()?[0];
        let scale = dloss / self.rows as f32;
        let lse = &saved[self.rows..];
        float_dispatch!(OP, "logits", (logits), |l| {
            cpu_backward(l, ll, targets, lse, self.vocab, scale)
        })
    }
}

/// Refuses logits that are not their storage's whole (the in-place gradient replaces it).
fn whole(ll: &Layout) -> Result<()> {
    if ll.is_contiguous() && ll.start_offset() == 0 {
        return Ok(());
    }
    Err(KernelError::NotContiguous {
        op: OP,
        input: "logits",
    }
    .into())
}

fn unsupported(input: &'static str, got: DType) -> candle_core::Error {
    KernelError::UnsupportedDType { op: OP, input, got }.into()
}

/// Each row's loss, then each row's log-sum-exp (f32, `[2 * rows]`).
fn cpu_rows<T: WithDType>(
    logits: &[T],
    ll: &Layout,
    targets: &[u32],
    vocab: usize,
) -> Result<Vec<f32>> {
    let logits = check::cpu_slice(OP, "logits", logits, ll)?;
    let mut losses = Vec::with_capacity(2 * targets.len());
    let mut lses = Vec::with_capacity(targets.len());
    for (row, &t) in logits.chunks(vocab).zip(targets) {
        let row: Vec<f32> = row.iter().map(|&v| check::f32_of(v)).collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        let lse = max + sum.ln();
        losses.push(match row.get(t as usize) {
            Some(&x) => lse - x,
            None => f32::NAN,
        });
        lses.push(lse);
    }
    losses.extend(lses);
    Ok(losses)
}

fn cpu_backward<T: WithDType>(
    logits: &[T],
    ll: &Layout,
    targets: &[u32],
    lse: &[f32],
    vocab: usize,
    scale: f32,
) -> Result<CpuStorage> {
    let logits = check::cpu_slice(OP, "logits", logits, ll)?;
    let mut out = Vec::with_capacity(logits.len());
    for ((row, &t), &lse) in logits.chunks(vocab).zip(targets).zip(lse) {
        let bad = t as usize >= vocab;
        for (i, &x) in row.iter().enumerate() {
            let p = (check::f32_of(x) - lse).exp();
            let g = if bad {
                f32::NAN
            } else {
                (p - if i == t as usize { 1.0 } else { 0.0 }) * scale
            };
            out.push(T::from_f64(f64::from(g)));
        }
    }
    Ok(T::to_cpu_storage_owned(out))
}
