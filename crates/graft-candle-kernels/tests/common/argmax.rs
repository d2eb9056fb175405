//! argmax_last's body: the first largest of each row, repeated maxima and -inf included.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::argmax_last;

use super::values;

/// `rows` rows of `n` random values with a repeated maximum in every other row and -inf in
/// every third: what a first-largest choice must get right.
pub fn tied_rows(rows: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut data = values(seed, rows * n, 4.0);
    for (r, row) in data.chunks_mut(n).enumerate() {
        // A repeated maximum in every other row, the later copy first found by no one.
        if r % 2 == 0 && n > 2 {
            let (a, b) = ((seed as usize + r) % n, (seed as usize + 3 * r + 1) % n);
            row[a] = 9.0;
            row[b] = 9.0;
        }
        if r % 3 == 0 {
            row[0] = f32::NEG_INFINITY;
        }
    }
    data
}

/// argmax_last against the first largest element of each row found on the host, with ties
/// (repeated maxima) and -inf in the rows.
pub fn check_argmax(device: &Device, rows: usize, n: usize, seed: u64, dtype: DType) -> Result<()> {
    let data = tied_rows(rows, n, seed);
    let x = Tensor::from_vec(data, (rows, n), &Device::Cpu)?.to_dtype(dtype)?;
    let host = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let want: Vec<u32> = host
        .iter()
        .map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            row.iter().position(|&v| v == max).unwrap_or(0) as u32
        })
        .collect();
    let got = argmax_last(&x.to_device(device)?)?.to_vec1::<u32>()?;
    assert_eq!(got, want, "argmax_last of {rows} rows of {n}");
    Ok(())
}
