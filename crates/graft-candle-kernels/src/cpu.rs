//! The CPU implementations' dtype dispatch ([`float_dispatch!`]): an op's CPU code is written
//! once, generic over the element type, and run on f32, bf16 or f16 storages.

/// `float_dispatch!(op, input, (a, b, ..), |x, y, ..| body)`: `body` (a `Result`) with `x`,
/// `y`, .. bound to the elements of the `&CpuStorage`s `a`, `b`, .. when they all hold f32,
/// all bf16 or all f16, so that one body generic over `T: WithDType` serves the three;
/// otherwise [`KernelError::UnsupportedDType`](crate::KernelError::UnsupportedDType) for
/// `op`'s `input`, with the first storage's dtype.
///
/// candle's own maps (`cpu_backend::utils::Map1`, `Map2`) don't fit: they take every dtype
/// (integers and f64 too), at most two inputs, return the input's dtype and fail with
/// candle's errors.
macro_rules! float_dispatch {
    ($op:expr, $input:expr, ($first:expr $(, $rest:expr)*), |$($x:ident),+| $body:expr) => {{
        let storages = ($first, $($rest,)*);
        match storages {
            ($(candle_core::CpuStorage::F32($x),)+) => $body,
            ($(candle_core::CpuStorage::BF16($x),)+) => $body,
            ($(candle_core::CpuStorage::F16($x),)+) => $body,
            _ => Err($crate::KernelError::UnsupportedDType {
                op: $op,
                input: $input,
                got: candle_core::backend::BackendStorage::dtype(storages.0),
            }
            .into()),
        }
    }};
}

pub(crate) use float_dispatch;

#[cfg(test)]
mod tests {
    use candle_core::{CpuStorage, Result, WithDType};

    fn total<T: WithDType>(x: &[T], y: &[T]) -> Result<f64> {
        Ok(x.iter().chain(y).map(|v| v.to_f64()).sum())
    }

    /// The sum of `a` and `b`'s elements, through the dispatch.
    fn sum(a: &CpuStorage, b: &CpuStorage) -> Result<f64> {
        float_dispatch!("op", "a", (a, b), |x, y| total(x, y))
    }

    #[test]
    fn dispatches_floats_and_refuses_the_rest() {
        let f32s = CpuStorage::F32(vec![1.0, 2.0]);
        let bf16s = CpuStorage::BF16(vec![WithDType::from_f64(3.0)]);
        assert_eq!(sum(&f32s, &f32s).unwrap(), 6.0);
        assert_eq!(sum(&bf16s, &bf16s).unwrap(), 6.0);
        let mixed = sum(&bf16s, &f32s).unwrap_err().to_string();
        assert!(mixed.contains("op: a is BF16"), "{mixed}");
        let ints = CpuStorage::U32(vec![1]);
        let refused = sum(&ints, &ints).unwrap_err().to_string();
        assert!(refused.contains("supports f32, bf16 and f16"), "{refused}");
    }
}
