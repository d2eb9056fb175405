//! The projections' test bodies: `linear`, `linear_cat` and `linear_swiglu` against f32
//! matmuls, and their batch invariance.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::{MATVEC_ROWS, TENSOR_ROWS, linear, linear_cat, linear_swiglu};
use proptest::prelude::*;

use super::{assert_close, random, tolerance};

/// One projection case: the rows' shape (rows = its product), `k` columns, each weight's rows
/// (1 to 3 weights), a bias or not, and a start offset of `x` and the weights inside bigger
/// tensors (misaligning the 16-byte loads when odd).
#[derive(Debug, Clone)]
pub struct LinearCase {
    pub lead: Vec<usize>,
    pub k: usize,
    pub ns: Vec<usize>,
    pub bias: bool,
    pub offset: usize,
    pub seed: u64,
}

pub fn linear_cases() -> impl Strategy<Value = LinearCase> {
    (
        prop_oneof![
            proptest::collection::vec(1usize..=3, 1..=2),
            Just(vec![MATVEC_ROWS]),
            Just(vec![MATVEC_ROWS + 1]),
            Just(vec![8]),
            Just(vec![TENSOR_ROWS]),
            Just(vec![TENSOR_ROWS + 1]),
            Just(vec![2, 1, 4]),
        ],
        prop_oneof![1usize..=40, Just(64), Just(256), Just(1000), Just(2048)],
        proptest::collection::vec(prop_oneof![1usize..=20, Just(64), Just(333)], 1..=3),
        any::<bool>(),
        prop_oneof![Just(0usize), Just(1), Just(8)],
        any::<u64>(),
    )
        .prop_map(|(lead, k, ns, bias, offset, seed)| LinearCase {
            lead,
            k,
            ns,
            bias,
            offset,
            seed,
        })
}

/// A `shape` tensor of values in `[-scale, scale)` at `offset` elements into a bigger one (so
/// not 16-byte aligned when the offset is odd).
fn offset_random(
    seed: u64,
    shape: &[usize],
    offset: usize,
    scale: f32,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    random(seed, &[n + offset], scale, dtype, device)?
        .narrow(0, offset, n)?
        .reshape(shape)
}

/// The projections' batch invariance (bf16 and f16 on CUDA, every dtype on the CPU): every
/// row of `linear_cat` and `linear_swiglu` over TENSOR_ROWS rows has the same bits within
/// calls of 3 to TENSOR_ROWS rows, from the first row or the middle one (the tensor-core
/// kernel: a row in another slot of the mma), and each of two rows the same bits alone (the
/// matrix-vector kernel; on the CPU, one and two rows the same bits as within the
/// TENSOR_ROWS call too), for each of `ks` columns.
pub fn check_batch_invariance(device: &Device, dtype: DType, ks: &[usize]) -> Result<()> {
    for &k in ks {
        let x = random(1, &[TENSOR_ROWS, k], 0.1, dtype, device)?;
        let (w0, w1) = (
            random(2, &[200, k], 1.0, dtype, device)?,
            random(3, &[200, k], 1.0, dtype, device)?,
        );
        let b = random(4, &[200], 1.0, dtype, device)?;
        let bits =
            |t: Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        // Rows from..from + rows of x, each through both ops.
        let project = |from: usize, rows: usize| -> Result<(Vec<f32>, Vec<f32>)> {
            let x = x.narrow(0, from, rows)?;
            Ok((
                bits(linear_cat(&x, &[(&w0, Some(&b)), (&w1, None)])?)?,
                bits(linear_swiglu(&x, &w0, &w1)?)?,
            ))
        };
        // (rows of the whole call, calls of fewer rows from a first row).
        let half = TENSOR_ROWS / 2;
        let mut fewer = vec![(0, 3), (0, 8), (0, 13), (half, half), (half, 5)];
        if device.is_cpu() {
            // One implementation serves every row count there: one and two rows too.
            fewer.extend([(0, 1), (half, 2)]);
        }
        let calls = [(TENSOR_ROWS, fewer), (MATVEC_ROWS, vec![(0, 1), (1, 1)])];
        for (all, parts) in calls {
            let (all_cat, all_swiglu) = project(0, all)?;
            let width = |v: &Vec<f32>| v.len() / all;
            let (cat_n, swiglu_n) = (width(&all_cat), width(&all_swiglu));
            for (from, rows) in parts {
                let (cat, swiglu) = project(from, rows)?;
                assert_eq!(
                    cat,
                    all_cat[from * cat_n..(from + rows) * cat_n],
                    "linear_cat of rows {from}..{} in {dtype:?}, k {k}",
                    from + rows
                );
                assert_eq!(
                    swiglu,
                    all_swiglu[from * swiglu_n..(from + rows) * swiglu_n],
                    "linear_swiglu of rows {from}..{} in {dtype:?}, k {k}",
                    from + rows
                );
            }
        }
    }
    Ok(())
}

/// `linear_cat` (and `linear` for one weight) and `linear_swiglu` of the case's first weight
/// and a second of its shape, against f32 matmuls of the same inputs rounded once (the
/// matrix-vector or tensor-core kernel up to MATVEC_ROWS or TENSOR_ROWS rows, candle's matmul
/// above).
pub fn check_linear(device: &Device, c: &LinearCase, dtype: DType) -> Result<()> {
    let rows: usize = c.lead.iter().product();
    let mut shape = c.lead.clone();
    shape.push(c.k);
    // Scaled so that every output is of order 1.
    let scale = 2.0 / (c.k as f32).sqrt();
    let x = offset_random(c.seed, &shape, c.offset, scale, dtype, device)?;
    let x2 = x.reshape((rows, c.k))?.to_dtype(DType::F32)?;
    let mut parts = Vec::new();
    for (i, &n) in c.ns.iter().enumerate() {
        let seed = c.seed ^ (i as u64 + 1) << 8;
        let w = offset_random(seed, &[n, c.k], c.offset, 1.0, dtype, device)?;
        let b = random(seed ^ 1, &[n], 1.0, dtype, device)?;
        parts.push((w, c.bias.then_some(b)));
    }
    let refs: Vec<(&Tensor, Option<&Tensor>)> =
        parts.iter().map(|(w, b)| (w, b.as_ref())).collect();
    let project = |w: &Tensor, b: Option<&Tensor>| -> Result<Tensor> {
        let y = x2.matmul(&w.to_dtype(DType::F32)?.t()?)?;
        match b {
            Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?),
            None => Ok(y),
        }
    };
    let want = Tensor::cat(
        &refs
            .iter()
            .map(|&(w, b)| project(w, b))
            .collect::<Result<Vec<_>>>()?,
        1,
    )?;
    let got = if refs.len() == 1 {
        linear(&x, refs[0].0, refs[0].1)?
    } else {
        linear_cat(&x, &refs)?
    };
    let total: usize = c.ns.iter().sum();
    let mut out = c.lead.clone();
    out.push(total);
    assert_eq!(got.dims(), out.as_slice());
    // Sums of k products in another order (cuBLAS's, or the kernel's lanes), then one
    // rounding.
    let (atol, rtol) = tolerance(dtype);
    let tol = (atol * 4.0, rtol * 4.0);
    let want_d = want.to_dtype(dtype)?;
    assert_close("linear", &got.reshape((rows, total))?, &want_d, tol)?;
    // SwiGLU of the first weight (gate) and a second of its shape (up).
    let gate = refs[0].0;
    let up = offset_random(c.seed ^ 77, gate.dims(), c.offset, 1.0, dtype, device)?;
    let want = (project(gate, None)?.silu()? * project(&up, None)?)?.to_dtype(dtype)?;
    let got = linear_swiglu(&x, gate, &up)?;
    out.pop();
    out.push(c.ns[0]);
    assert_eq!(got.dims(), out.as_slice());
    assert_close("linear_swiglu", &got.reshape((rows, c.ns[0]))?, &want, tol)
}
