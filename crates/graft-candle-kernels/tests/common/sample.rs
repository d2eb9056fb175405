//! sample_rows' bodies: an oracle written the trivially correct way (sort, cumulative sum, in
//! f64) giving each token's probability; greedy rows against argmax_last; draw frequencies
//! against the oracle; determinism and batch invariance; non-finite parameters and logits; and
//! (GPU) the device's tokens against the CPU's.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::{SAMPLE_INVALID, SampleParams, argmax_last, sample_rows};

use super::values;

/// The params tensor of `rows` on `device`.
pub fn params_tensor(rows: &[SampleParams], device: &Device) -> Result<Tensor> {
    let words: Vec<u32> = rows.iter().flat_map(|p| p.words()).collect();
    Tensor::from_vec(words, (rows.len(), 6), device)
}

/// A row's sampling parameters.
pub fn sampling(temperature: f32, top_k: u32, top_p: f32, seed: u64, index: u32) -> SampleParams {
    SampleParams {
        temperature,
        top_k,
        top_p,
        seed,
        index,
    }
}

/// Each token's probability under `p` (finite temperature, non-NaN top-p), the trivially
/// correct way, and how close top-p's cut came to `top_p` (the kernels' fixed-point weights
/// may decide a closer cut the other way).
pub fn oracle(row: &[f32], p: &SampleParams) -> (Vec<f64>, f64) {
    let n = row.len();
    let mut probs = vec![0.0; n];
    let finite: Vec<usize> = (0..n).filter(|&i| !row[i].is_nan()).collect();
    if finite.is_empty() {
        probs[0] = 1.0;
        return (probs, 1.0);
    }
    // Non-NaN indices, largest logit first (a stable sort: the first of equals first).
    let mut order = finite.clone();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    let m = row[order[0]];
    if p.temperature <= 0.0 {
        let first = finite.iter().copied().find(|&i| row[i] == m).unwrap_or(0);
        probs[first] = 1.0;
        return (probs, 1.0);
    }
    let weight = |i: usize| -> f64 {
        if row[i] == m {
            1.0
        } else {
            ((f64::from(row[i]) - f64::from(m)) / f64::from(p.temperature)).exp()
        }
    };
    let k = p.top_k as usize;
    let mut kept: Vec<usize> = if k == 0 || k >= order.len() {
        order.clone()
    } else {
        let kth = row[order[k - 1]];
        order.iter().copied().filter(|&i| row[i] >= kth).collect()
    };
    let mut margin = 1.0f64;
    if p.top_p < 1.0 {
        let total: f64 = kept.iter().map(|&i| weight(i)).sum();
        let mut cum = 0.0;
        let mut cut = kept.len();
        for (at, &i) in kept.iter().enumerate() {
            cum += weight(i);
            let last_of_value = kept.get(at + 1).is_none_or(|&j| row[j] != row[i]);
            if last_of_value {
                margin = margin.min((cum / total - f64::from(p.top_p)).abs());
                if cum / total >= f64::from(p.top_p) {
                    cut = at + 1;
                    break;
                }
            }
        }
        kept.truncate(cut);
    }
    let total: f64 = kept.iter().map(|&i| weight(i)).sum();
    for &i in &kept {
        probs[i] = weight(i) / total;
    }
    (probs, margin)
}

/// Temperature 0 (and any temperature <= 0) gives argmax_last's token on random rows with
/// repeated maxima and -inf; top-k 1 gives one of the largest logits (argmax_last's where it
/// is the only one).
pub fn check_sample_greedy(
    device: &Device,
    rows: usize,
    n: usize,
    seed: u64,
    dtype: DType,
) -> Result<()> {
    let data = super::argmax::tied_rows(rows, n, seed);
    let x = Tensor::from_vec(data, (rows, n), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let want = argmax_last(&x)?.to_vec1::<u32>()?;
    let greedy: Vec<SampleParams> = (0..rows)
        .map(|r| SampleParams {
            temperature: [0.0, -0.0, -1.0][r % 3],
            seed: r as u64,
            index: r as u32,
            ..SampleParams::GREEDY
        })
        .collect();
    let got = sample_rows(&x, &params_tensor(&greedy, device)?)?.to_vec1::<u32>()?;
    assert_eq!(got, want, "greedy sample_rows of {rows} rows of {n}");
    let top1: Vec<SampleParams> = (0..rows)
        .map(|r| sampling(0.8, 1, 1.0, seed ^ r as u64, r as u32))
        .collect();
    let got = sample_rows(&x, &params_tensor(&top1, device)?)?.to_vec1::<u32>()?;
    let host = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    for (r, row) in host.iter().enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let token = got[r] as usize;
        assert_eq!(row[token], max, "top-1 row {r} drew {token}");
        if row.iter().filter(|&&v| v == max).count() == 1 {
            assert_eq!(got[r], want[r], "top-1 row {r}");
        }
    }
    Ok(())
}

/// The rows of the statistical test, their parameters (seed and index filled in per draw) and
/// draws: 12 logits (ties at 1.5 and 0.8, -inf, and in some a NaN), and 12 + 4,096 with the
/// 4,096 tied at -6 (more candidates than the kernel's shared memory holds, so its cuts run
/// over the row).
pub fn statistics_settings(draws: usize) -> Vec<(Vec<f32>, SampleParams, usize)> {
    let row = vec![
        2.0,
        1.5,
        1.5,
        0.3,
        -0.4,
        1.0,
        -2.0,
        0.8,
        0.8,
        -1.0,
        f32::NEG_INFINITY,
        0.1,
    ];
    let mut with_nan = row.clone();
    with_nan[4] = f32::NAN;
    let mut wide = row.clone();
    wide.extend(std::iter::repeat_n(-6.0, 4096));
    let s = |temperature, top_k, top_p| sampling(temperature, top_k, top_p, 0, 0);
    let fewer = draws / 4;
    vec![
        (row.clone(), s(1.0, 0, 1.0), draws),
        (row.clone(), s(0.7, 2, 1.0), draws),
        (row.clone(), s(1.3, 0, 0.6), draws),
        (row.clone(), s(0.9, 5, 0.8), draws),
        (with_nan.clone(), s(2.0, 0, 0.95), draws),
        (with_nan, s(1.0, 7, 1.0), draws),
        (row.clone(), s(0.5, 1, 1.0), draws),
        (row.clone(), s(1.0, 0, 0.0), draws),
        (row.clone(), s(100.0, 0, 1.0), draws),
        (row, s(1.0, 12, 0.999), draws),
        (wide.clone(), s(1.0, 0, 0.97), fewer),
        (wide.clone(), s(1.0, 4100, 1.0), fewer),
        (wide, s(1.0, 4100, 0.6), fewer),
    ]
}

/// For each setting, its draws as rows of the same logits with seeds and indexes varied
/// (`draws` for the narrow rows, a quarter for the wide): no token outside the oracle's kept
/// set, and every frequency within 5 standard deviations of the oracle's probability.
pub fn check_sample_statistics(device: &Device, draws: usize) -> Result<()> {
    for (setting, (row, base, draws)) in statistics_settings(draws).into_iter().enumerate() {
        let (probs, margin) = oracle(&row, &base);
        assert!(
            margin > 1e-4,
            "setting {setting}: top-p's cut is a near tie"
        );
        let n = row.len();
        let logits = Tensor::from_vec(row.repeat(draws), (draws, n), device)?;
        let params: Vec<SampleParams> = (0..draws)
            .map(|d| SampleParams {
                seed: 0x5eed_0000 + (setting as u64) * 1000 + (d % 13) as u64,
                index: d as u32,
                ..base
            })
            .collect();
        let tokens = sample_rows(&logits, &params_tensor(&params, device)?)?.to_vec1::<u32>()?;
        let mut counts = vec![0usize; n];
        for &t in &tokens {
            assert!((t as usize) < n, "setting {setting}: token {t}");
            counts[t as usize] += 1;
        }
        let total = draws as f64;
        for (i, (&count, &p)) in counts.iter().zip(&probs).enumerate() {
            let expected = total * p;
            if p == 0.0 {
                assert_eq!(
                    count, 0,
                    "setting {setting} {base:?}: token {i} is not kept"
                );
            } else {
                let sigma = (total * p * (1.0 - p)).sqrt();
                assert!(
                    (count as f64 - expected).abs() <= 5.0 * sigma + 1.0,
                    "setting {setting} {base:?}: token {i} drawn {count} times, expected \
                     {expected:.1} (sigma {sigma:.1})"
                );
            }
        }
    }
    Ok(())
}

/// `count` rows of `vocab` logits: mostly flat noise with a few boosted tokens (so top-p's
/// set is small), some flat, some of one value repeated, some with NaN and -inf.
pub fn mixed_logits(seed: u64, count: usize, vocab: usize) -> Vec<f32> {
    let mut data = values(seed, count * vocab, 6.0);
    for (r, row) in data.chunks_mut(vocab).enumerate() {
        match r % 6 {
            0 | 1 => {
                for j in 0..8 {
                    row[(r * 7919 + j * 104_729) % vocab] += 12.0 - j as f32;
                }
            }
            2 => row.iter_mut().for_each(|v| *v *= 0.2),
            3 => row.fill(1.25),
            4 => {
                for j in (0..vocab).step_by(3) {
                    row[j] = if j % 2 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
            _ => {}
        }
    }
    data
}

/// Parameters covering every path of the kernel (greedy, no cut, small and large top-k, small
/// and large top-p sets, both, invalid).
pub fn mixed_params(count: usize, seed: u64) -> Vec<SampleParams> {
    (0..count)
        .map(|r| {
            let (s, i) = (seed ^ (r as u64).wrapping_mul(0x9e37_79b9), r as u32);
            match r % 11 {
                0 => SampleParams::GREEDY,
                1 => sampling(1.0, 0, 1.0, s, i),
                2 => sampling(0.7, 40, 1.0, s, i),
                3 => sampling(0.9, 0, 0.9, s, i),
                4 => sampling(1.1, 50, 0.95, s, i),
                5 => sampling(3.0, 0, 0.99, s, i),
                6 => sampling(1.0, 6000, 1.0, s, i),
                7 => sampling(0.6, 1, 0.5, s, i),
                8 => sampling(2.0, 5000, 0.7, s, i),
                9 => sampling(f32::NAN, 0, 1.0, s, i),
                _ => sampling(0.05, 3, 0.0, s, i),
            }
        })
        .collect()
}

/// A row gives the same token alone, in a batch at another place, and on every call; another
/// index or seed draws differently.
pub fn check_sample_determinism(device: &Device) -> Result<()> {
    let (rows, vocab) = (33, 1000);
    let data = mixed_logits(11, rows, vocab);
    let params = mixed_params(rows, 5);
    let logits = Tensor::from_vec(data.clone(), (rows, vocab), device)?;
    let p = params_tensor(&params, device)?;
    let batch = sample_rows(&logits, &p)?.to_vec1::<u32>()?;
    assert_eq!(
        sample_rows(&logits, &p)?.to_vec1::<u32>()?,
        batch,
        "a second call"
    );
    // The rows reversed.
    let reversed: Vec<f32> = data.chunks(vocab).rev().flatten().copied().collect();
    let mut back = params.clone();
    back.reverse();
    let logits_back = Tensor::from_vec(reversed, (rows, vocab), device)?;
    let mut got = sample_rows(&logits_back, &params_tensor(&back, device)?)?.to_vec1::<u32>()?;
    got.reverse();
    assert_eq!(got, batch, "the batch reversed");
    for (r, &token) in batch.iter().enumerate() {
        let alone = sample_rows(&logits.narrow(0, r, 1)?, &p.narrow(0, r, 1)?)?;
        assert_eq!(alone.to_vec1::<u32>()?, [token], "row {r} alone");
    }
    // Another index or seed: other draws from a flat row.
    let flat = Tensor::from_vec(values(3, 64, 0.5), (1, 64), device)?.repeat((200, 1))?;
    let draws = |seed: u64, index0: u32| -> Result<Vec<u32>> {
        let params: Vec<SampleParams> = (0..200)
            .map(|d| sampling(1.0, 0, 1.0, seed, index0 + d))
            .collect();
        sample_rows(&flat, &params_tensor(&params, device)?)?.to_vec1::<u32>()
    };
    let base = draws(1, 0)?;
    let distinct = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x != y).count();
    assert!(distinct(&base, &draws(2, 0)?) > 150, "another seed");
    assert!(distinct(&base, &draws(1, 1000)?) > 150, "other indexes");
    assert!(
        distinct(&base[1..], &base[..199]) > 150,
        "consecutive indexes"
    );
    Ok(())
}

/// Non-finite parameters give SAMPLE_INVALID; rows of NaN give 0; infinite logits: a row of
/// -inf draws any token, +inf logits are the only ones drawn.
pub fn check_sample_non_finite(device: &Device) -> Result<()> {
    let n = 8;
    let ok = sampling(1.0, 0, 1.0, 7, 7);
    let cases: Vec<(Vec<f32>, SampleParams, &[u32])> = vec![
        (
            vec![1.0; n],
            sampling(f32::NAN, 0, 1.0, 1, 1),
            &[SAMPLE_INVALID],
        ),
        (
            vec![1.0; n],
            sampling(f32::INFINITY, 0, 1.0, 1, 1),
            &[SAMPLE_INVALID],
        ),
        (
            vec![1.0; n],
            sampling(f32::NEG_INFINITY, 0, 1.0, 1, 1),
            &[SAMPLE_INVALID],
        ),
        (
            vec![1.0; n],
            sampling(1.0, 0, f32::NAN, 1, 1),
            &[SAMPLE_INVALID],
        ),
        (vec![f32::NAN; n], SampleParams::GREEDY, &[0]),
        (vec![f32::NAN; n], ok, &[0]),
        (vec![f32::NAN; n], sampling(1.0, 2, 0.5, 7, 7), &[0]),
        (vec![f32::NEG_INFINITY; n], SampleParams::GREEDY, &[0]),
        (
            vec![1.0, f32::INFINITY, 3.0, f32::INFINITY, 0.0, -1.0, 2.0, 5.0],
            sampling(0.5, 0, 0.9, 3, 3),
            &[1, 3],
        ),
        (
            vec![
                f32::NAN,
                f32::NEG_INFINITY,
                0.5,
                0.5,
                f32::NAN,
                0.0,
                0.0,
                0.0,
            ],
            SampleParams::GREEDY,
            &[2],
        ),
    ];
    for (row, p, allowed) in &cases {
        let logits = Tensor::from_vec(row.clone(), (1, n), device)?;
        let token = sample_rows(&logits, &params_tensor(&[*p], device)?)?.to_vec1::<u32>()?[0];
        assert!(allowed.contains(&token), "{row:?} {p:?}: {token}");
    }
    // A row of -inf: every token may be drawn (all tied at the largest).
    let logits = Tensor::from_vec(vec![f32::NEG_INFINITY; 4], (1, 4), device)?.repeat((400, 1))?;
    let params: Vec<SampleParams> = (0..400).map(|d| sampling(1.0, 0, 1.0, 9, d)).collect();
    let tokens = sample_rows(&logits, &params_tensor(&params, device)?)?.to_vec1::<u32>()?;
    for t in 0..4 {
        assert!(tokens.contains(&t), "a row of -inf never drew {t}");
    }
    Ok(())
}

/// The device's tokens against the CPU's over `count` rows of `vocab` mixed logits and
/// parameters in `dtype`: the same on every greedy (and invalid) row, and on at least 99% of
/// all rows (the weights are meant to be the same bits, so all should agree).
pub fn check_sample_matches_cpu(
    device: &Device,
    count: usize,
    vocab: usize,
    dtype: DType,
) -> Result<()> {
    let data = mixed_logits(vocab as u64, count, vocab);
    let params = mixed_params(count, 77);
    let logits = Tensor::from_vec(data, (count, vocab), &Device::Cpu)?.to_dtype(dtype)?;
    let p = params_tensor(&params, &Device::Cpu)?;
    let want = sample_rows(&logits, &p)?.to_vec1::<u32>()?;
    let got = sample_rows(&logits.to_device(device)?, &p.to_device(device)?)?.to_vec1::<u32>()?;
    let mut differ = Vec::new();
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        let exact = params[r].temperature <= 0.0 || params[r].temperature.is_nan();
        assert!(!exact || g == w, "row {r} {:?}: {g} against {w}", params[r]);
        if g != w {
            differ.push((r, *g, *w));
        }
    }
    eprintln!(
        "sample_rows at vocab {vocab} in {dtype:?}: {} of {count} rows differ from the CPU's {differ:?}",
        differ.len()
    );
    assert!(differ.len() * 100 <= count, "rows that differ: {differ:?}");
    Ok(())
}
