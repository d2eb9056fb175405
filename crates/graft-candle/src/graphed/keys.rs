//! The keys a call's inputs add to graft's signature: each input's dtype, rank and dims.

use candle_core::{DType, Tensor};

/// A stable number for a dtype, for signature keys.
pub(crate) fn dtype_key(dtype: DType) -> u64 {
    DTYPES
        .iter()
        .position(|&d| d == dtype)
        .map_or(u64::MAX, |i| i as u64)
}

const DTYPES: [DType; 10] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
];

/// Appends what of `t` the signature depends on: dtype, rank, dims.
pub(crate) fn push_shape_keys(keys: &mut Vec<u64>, t: &Tensor) {
    keys.push(dtype_key(t.dtype()));
    keys.push(t.rank() as u64);
    keys.extend(t.dims().iter().map(|&d| d as u64));
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn shape_keys_tell_shapes_of_equal_size_apart() {
        let a = Tensor::zeros(8, DType::U32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((2, 4), DType::U32, &Device::Cpu).unwrap();
        let c = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        let keys = |t: &Tensor| {
            let mut k = Vec::new();
            push_shape_keys(&mut k, t);
            k
        };
        assert_eq!(keys(&a), vec![dtype_key(DType::U32), 1, 8]);
        assert_ne!(keys(&a), keys(&b));
        assert_ne!(keys(&a), keys(&c));
        assert!(DTYPES.iter().all(|&d| dtype_key(d) != u64::MAX));
    }
}
