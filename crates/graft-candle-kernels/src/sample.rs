//! `sample_rows`: each row's next token drawn with that row's own sampling parameters, read from
//! a device tensor (`[rows, SAMPLE_WORDS]` u32, [`SampleParams::words`] of each row), so that
//! requests with different temperatures, top-k, top-p and seeds share one recorded decode
//! step: one launch of one block per row, its configuration from the shapes only.
//!
//! A row's token depends on its own logits and parameters only (never on the other rows or the
//! batch size) and is the same on every call. Per row, with `l` its logits as f32:
//!
//! - **Invalid parameters** (a NaN or infinite temperature, a NaN top-p): the token is
//!   [`SAMPLE_INVALID`] (`u32::MAX`, past any vocabulary: `embedding` makes it a row of NaN),
//!   on both backends. Check the parameters on the host (the server does).
//! - **Greedy** (temperature <= 0): the first index of the largest logit, exactly what
//!   [`argmax_last`](crate::argmax_last) gives (NaN never wins; a row of NaN gives 0), at the
//!   cost of `argmax_last`.
//! - **Sampling** (temperature `T` > 0). `m` is the largest non-NaN logit; NaN logits are never
//!   drawn (a row of NaN gives 0). Each token's weight is `w = 2^((l - m) · log2(e) / T)`
//!   (`exp((l - m) / T)`; exactly 1 where `l == m`, so an infinite `m` is no NaN), held in
//!   fixed point as `q = floor(w · 2^40)` (0 for `w < 2^-40`: a token less than 2^-40 as
//!   likely as the top one is never drawn), with `2^x` computed by the crate's own polynomial
//!   (`exp2_neg`, within 1e-7 of `2^x` relative) in separately rounded f32 operations, so the
//!   CPU and the GPU find the same bits, and every sum after is an integer: the GPU's token
//!   is meant to be the CPU's (the GPU tests compare them).
//!   - **top-k** (`top_k = 0`, or at least the row's non-NaN count, keeps every token): keep
//!     the tokens whose logit is at least the `top_k`-th largest (every token tied with it
//!     too, as Hugging Face's top-k).
//!   - **top-p** (`top_p >= 1` keeps every token top-k kept): with `K` the kept tokens' total
//!     weight, keep those of logit at least `t`, the largest logit whose tokens from `t` up
//!     weigh at least `need = min(K, max(1, ceil(top_p · K)))` (`top_p · K` in f64): the
//!     smallest set of the most likely whose weight reaches `top_p` of the kept weight, every
//!     token tied at the threshold kept, at least the top one (`top_p <= 0` keeps only the
//!     tokens tied with the largest logit).
//!   - **the draw**: `u` is the top 24 bits of the first word of graft-philox's
//!     Philox4x32-10 at counter `[index, 0, 0, 0]` and key `[seed low, seed high]`
//!     (`u / 2^24` is [`graft_philox::unit_f32`] of that word); with `M` the kept tokens' total
//!     weight, the token is the first kept index (in index order) where the running kept
//!     weight exceeds `floor(u · M / 2^24)`. That is always below `M`, so some kept token of
//!     nonzero weight is drawn: no guard is needed (the kernel keeps one: the greedy token).
//!
//! The GPU kernel (`sample/sample.cu`, one block of 1,024 threads per row) finds the first
//! largest logit in one pass as `argmax_last` does (a greedy row stops there). Without a cut,
//! one more pass sums the weight of each warp's contiguous 32nd of the row and a pass over the
//! chosen 32nd finds the token. With a cut, a pass counts the candidates (the tokens of
//! nonzero weight) per bin of `log2 w`; when the tokens that decide the cut (top-k's bins, or
//! for top-p alone as many bins as fit) are at most 4,096, a pass copies them into shared
//! memory and the thresholds and the draw are radix selections there (8 bits a step, integer
//! histograms); otherwise the same selections run over the row, a pass per 8-bit step.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::argmax::first_max;
use crate::cpu::float_dispatch;
use crate::{KernelError, check};

const OP: &str = "sample_rows";

/// Words of one row of the params tensor.
pub const SAMPLE_WORDS: usize = 6;

/// The token of a row whose parameters are invalid (a NaN or infinite temperature, a NaN
/// top-p): past every vocabulary, so that it cannot pass for a token.
pub const SAMPLE_INVALID: u32 = u32::MAX;

/// The largest vocabulary: the kept weights (up to 2^40 each) must sum below 2^64.
const MAX_VOCAB: usize = (1 << 24) - 1;

/// One fixed-point unit of weight: the largest logit's weight is `ONE`.
const ONE: f32 = (1u64 << 40) as f32;

/// One row's sampling parameters (see the module documentation for what each does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// The softmax temperature; 0 or below: greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (and those tied with the last); 0: all.
    pub top_k: u32,
    /// Keep the most likely of top-k's tokens until they weigh `top_p` of them; 1 or above:
    /// all.
    pub top_p: f32,
    /// The request's random seed (Philox's key).
    pub seed: u64,
    /// The draw's index (Philox's counter): the request's step, so that each step draws anew.
    pub index: u32,
}

impl SampleParams {
    /// The greedy choice: temperature 0.
    pub const GREEDY: SampleParams = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        index: 0,
    };

    /// The row's words: [temperature bits, top_p bits, top_k, seed low, seed high, index].
    pub fn words(&self) -> [u32; SAMPLE_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.top_k,
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.index,
        ]
    }

    /// The parameters of a row's words.
    fn of_words(w: &[u32]) -> Self {
        SampleParams {
            temperature: f32::from_bits(w[0]),
            top_p: f32::from_bits(w[1]),
            top_k: w[2],
            seed: u64::from(w[3]) | u64::from(w[4]) << 32,
            index: w[5],
        }
    }
}

/// Each row's token: `logits` `[rows, vocab]` (f32, bf16 or f16, contiguous; a start offset is
/// fine; 1 <= vocab < 2^24), `params` `[rows, SAMPLE_WORDS]` u32 (each row's
/// [`SampleParams::words`], contiguous, on the same device) -> `[rows]` u32, as the module
/// documentation describes.
pub fn sample_rows(logits: &Tensor, params: &Tensor) -> Result<Tensor> {
    check::float(OP, "logits", logits)?;
    let &[rows, vocab] = logits.dims() else {
        return Err(check::shape(OP, "logits", logits, "[rows, vocab]"));
    };
    if vocab == 0 {
        return Err(check::shape(
            OP,
            "logits",
            logits,
            "[rows, vocab] with vocab > 0",
        ));
    }
    check::indices(OP, "params", params, logits)?;
    if params.dims() != [rows, SAMPLE_WORDS] {
        return Err(check::shape(
            OP,
            "params",
            params,
            "[rows, 6]: SampleParams::words of each logits row",
        ));
    }
    check::contiguous(OP, "logits", logits)?;
    check::contiguous(OP, "params", params)?;
    if vocab > MAX_VOCAB {
        return Err(KernelError::TooLarge {
            op: OP,
            what: "the vocabulary",
            size: vocab,
        }
        .into());
    }
    if rows == 0 {
        return Tensor::zeros(0, DType::U32, logits.device());
    }
    check::u32_of(OP, "the row count", rows)?;
    logits.apply_op2_no_bwd(params, &Sample { vocab })
}

/// The custom op over (logits, params): `[rows]` u32; the wrapper has checked the inputs.
struct Sample {
    vocab: usize,
}

impl CustomOp2 for Sample {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        params: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::U32(params) = params else {
            return Err(KernelError::IndexDType {
                op: OP,
                input: "params",
                got: params.dtype(),
            }
            .into());
        };
        let params = check::cpu_slice(OP, "params", params, pl)?;
        let out = float_dispatch!(OP, "logits", (logits), |x| cpu(x, ll, params, self.vocab))?;
        let rows = out.len();
        Ok((CpuStorage::U32(out), Shape::from_dims(&[rows])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        params: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self.vocab, logits, ll, params, pl)
    }
}

fn cpu<T: WithDType>(x: &[T], l: &Layout, params: &[u32], vocab: usize) -> Result<Vec<u32>> {
    let x = check::cpu_slice(OP, "logits", x, l)?;
    let mut row = Vec::with_capacity(vocab);
    Ok(x.chunks_exact(vocab)
        .zip(params.chunks_exact(SAMPLE_WORDS))
        .map(|(logits, words)| {
            row.clear();
            row.extend(logits.iter().map(|&v| check::f32_of(v)));
            sample_row(&row, &SampleParams::of_words(words))
        })
        .collect())
}

/// One row's token (the module documentation's semantics, computed directly).
fn sample_row(row: &[f32], p: &SampleParams) -> u32 {
    if !p.temperature.is_finite() || p.top_p.is_nan() {
        return SAMPLE_INVALID;
    }
    let Some((best, m)) = first_max(row.iter().copied()) else {
        return 0;
    };
    if p.temperature <= 0.0 {
        return best as u32;
    }
    let scale = std::f32::consts::LOG2_E / p.temperature;
    // Each non-NaN logit's index, key and weight.
    let tokens = row
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i, key(l), weight(l, m, scale)));
    let mut floor = 0u32;
    let count = tokens.clone().count();
    let k = p.top_k as usize;
    if k != 0 && k < count {
        let mut keys: Vec<u32> = tokens.clone().map(|(_, key, _)| key).collect();
        let (_, &mut kth, _) = keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        floor = kth;
    }
    let mass = |floor: u32| -> u64 {
        tokens
            .clone()
            .filter(|&(_, key, _)| key >= floor)
            .map(|(_, _, q)| q)
            .sum()
    };
    if p.top_p < 1.0 {
        let need = need(p.top_p, mass(floor));
        // The kept tokens of nonzero weight, the most likely first; the first key where the
        // weight from the top reaches `need` (ties summed before the check).
        let mut heavy: Vec<(u32, u64)> = tokens
            .clone()
            .filter(|&(_, key, q)| key >= floor && q > 0)
            .map(|(_, key, q)| (key, q))
            .collect();
        heavy.sort_unstable_by_key(|&(key, _)| std::cmp::Reverse(key));
        let mut sum = 0u64;
        for (at, &(key, q)) in heavy.iter().enumerate() {
            sum += q;
            let last_of_key = heavy.get(at + 1).is_none_or(|next| next.0 != key);
            if last_of_key && sum >= need {
                floor = key;
                break;
            }
        }
    }
    let word =
        graft_philox::philox4x32_10([p.index, 0, 0, 0], [p.seed as u32, (p.seed >> 32) as u32])[0];
    let target = scale_mass(mass(floor), word >> 8);
    let mut run = 0u64;
    for (i, key, q) in tokens {
        if key >= floor {
            run += q;
            if run > target {
                return i as u32;
            }
        }
    }
    // Never reached: the target is below the kept weight.
    best as u32
}

/// The order-preserving u32 image of a non-NaN f32 (-0 as +0): `key(a) < key(b)` exactly when
/// `a < b`.
fn key(v: f32) -> u32 {
    let bits = if v == 0.0 { 0 } else { v.to_bits() };
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Cephes' `exp2f` polynomial coefficients (highest power first), as f32 bits: the kernel
/// writes the same bits (a test checks).
const EXP2_COEFFICIENTS: [u32; 6] = [
    0x3920_fdde, // 1.5353362e-4
    0x3aaf_9f29, // 1.3398874e-3
    0x3c1d_96a6, // 9.618437e-3
    0x3d63_5774, // 5.5503324e-2
    0x3e75_fdee, // 2.4022648e-1
    0x3f31_7218, // 6.931472e-1
];

/// `2^x` for `x` in `[-40, 0]`, 0 below it (and for NaN): `2^i · (1 + f·P(f))` with `i` the
/// nearest integer and `f = x - i` in `[-0.5, 0.5]`, every operation rounded on its own (Rust
/// never fuses them; the kernel uses `__fmul_rn`/`__fadd_rn`), so both compute the same bits.
pub(crate) fn exp2_neg(x: f32) -> f32 {
    if x.is_nan() || x < -40.0 {
        return 0.0;
    }
    let i = (x + 0.5).floor();
    let f = x - i;
    let mut p = 0.0f32;
    for c in EXP2_COEFFICIENTS {
        p = p * f + f32::from_bits(c);
    }
    p = p * f + 1.0;
    // 2^i, exactly (i is in [-40, 0]).
    p * f32::from_bits(((127 + i as i32) as u32) << 23)
}

/// A non-NaN logit's fixed-point weight against the largest `m`: `floor(2^x · 2^40)`.
fn weight(l: f32, m: f32, scale: f32) -> u64 {
    if l == m {
        return 1 << 40;
    }
    (exp2_neg((l - m) * scale) * ONE) as u64
}

/// The weight top-p's kept set must reach: `min(mass, max(1, ceil(p · mass)))`, in f64.
fn need(p: f32, mass: u64) -> u64 {
    let want = (f64::from(p) * mass as f64).ceil();
    if want.is_nan() || want < 1.0 {
        return 1;
    }
    (want as u64).min(mass)
}

/// `floor(mass · u24 / 2^24)`.
fn scale_mass(mass: u64, u24: u32) -> u64 {
    ((u128::from(mass) * u128::from(u24)) >> 24) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polynomial is within 2e-7 of `2^x` over its range, never above 1, and 0 below it.
    #[test]
    fn exp2_neg_is_close_to_exp2() {
        let mut worst = 0.0f64;
        for step in 0..=400_000 {
            let x = -40.0 * step as f32 / 400_000.0;
            let got = f64::from(exp2_neg(x));
            let want = f64::from(x).exp2();
            worst = worst.max((got / want - 1.0).abs());
            assert!(got <= 1.0, "2^{x} = {got}");
        }
        assert!(worst < 2e-7, "worst relative error {worst}");
        assert_eq!(exp2_neg(-40.01), 0.0);
        assert_eq!(exp2_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2_neg(f32::NAN), 0.0);
        assert_eq!(exp2_neg(0.0), 1.0);
    }

    /// The kernel's source writes the host's constants.
    #[test]
    fn the_kernel_has_the_hosts_constants() {
        let source = include_str!("sample/sample.cu");
        for c in EXP2_COEFFICIENTS {
            assert!(source.contains(&format!("0x{c:08x}u")), "{c:08x}");
        }
        let log2e = std::f32::consts::LOG2_E.to_bits();
        assert!(source.contains(&format!("0x{log2e:08x}u")), "log2(e)");
        assert!(source.contains("1099511627776.0f"), "2^40");
        assert_eq!(ONE, 1_099_511_627_776.0);
    }

    /// Keys order the floats (and -0 with +0).
    #[test]
    fn keys_keep_the_order() {
        let values = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            0.0,
            1e-40,
            2.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for pair in values.windows(2) {
            assert!(key(pair[0]) < key(pair[1]), "{pair:?}");
        }
        assert_eq!(key(-0.0), key(0.0));
    }

    #[test]
    fn need_and_scale_stay_in_range() {
        assert_eq!(need(0.0, 100), 1);
        assert_eq!(need(-1.0, 100), 1);
        assert_eq!(need(0.5, 101), 51);
        assert_eq!(need(0.999_999_9, 3), 3);
        assert_eq!(scale_mass(u64::MAX >> 1, (1 << 24) - 1), {
            let m = u128::from(u64::MAX >> 1);
            ((m * ((1 << 24) - 1)) >> 24) as u64
        });
        assert!(scale_mass(1, (1 << 24) - 1) < 1);
    }
}
