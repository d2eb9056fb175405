//! Batch-size buckets: the sizes a function is recorded at, and the bucket a real size pads to.

use std::fmt;
use std::sync::Arc;

/// The sizes (usually batch sizes) a function is recorded at, ascending.
///
/// A function registered with [`crate::FunctionSpec::buckets`] is called with its bucket as
/// the first signature key: the framework asks [`Buckets::pick`] (or
/// [`crate::Graft::bucket`]) for the bucket of its real size, pads its inputs to it, and
/// calls with `keys[0] = bucket`. A size above the largest bucket is called with the real
/// size as `keys[0]` and runs eagerly ([`crate::EagerReason::AboveLargestBucket`]); graft
/// records nothing for it.
#[derive(Clone, PartialEq, Eq)]
pub struct Buckets {
    sizes: Arc<[usize]>,
}

/// The bucket a size runs at.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Bucket {
    /// Pad to this bucket (it may equal the size).
    Padded(usize),
    /// Larger than the largest bucket: call with the real size; the call runs eagerly.
    Above {
        /// The real size.
        size: usize,
        /// The largest bucket.
        largest: usize,
    },
}

impl Bucket {
    /// The size to pad the inputs to and to pass as `keys[0]`: the bucket, or the real size
    /// above the largest bucket.
    pub fn size(self) -> usize {
        match self {
            Bucket::Padded(b) => b,
            Bucket::Above { size, .. } => size,
        }
    }
}

/// Why a bucket list was refused.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum BucketsError {
    /// No sizes at all.
    #[error("a bucket list needs at least one size")]
    Empty,
    /// A size of zero.
    #[error("bucket sizes must be at least 1; drop the 0")]
    Zero,
}

impl Buckets {
    /// These sizes (sorted and deduplicated here).
    pub fn new(sizes: impl IntoIterator<Item = usize>) -> Result<Buckets, BucketsError> {
        let mut sizes: Vec<usize> = sizes.into_iter().collect();
        sizes.sort_unstable();
        sizes.dedup();
        match sizes.first() {
            None => Err(BucketsError::Empty),
            Some(0) => Err(BucketsError::Zero),
            Some(_) => Ok(Buckets {
                sizes: sizes.into(),
            }),
        }
    }

    /// 1, 2, 4, ... up to `max` (and `max` itself when it is not a power of two).
    pub fn powers_of_two(max: usize) -> Buckets {
        let max = max.max(1);
        let sizes = std::iter::successors(Some(1usize), |&s| s.checked_mul(2))
            .take_while(|&s| s < max)
            .chain(std::iter::once(max));
        Buckets::from_sorted(sizes)
    }

    /// The serving-engine rule (vLLM's default capture sizes): 1, 2, 4, then every 8 up to
    /// 256, then every 16, up to `max` (and `max` itself when the rule skips it).
    pub fn stepped(max: usize) -> Buckets {
        let max = max.max(1);
        let sizes = [1, 2, 4]
            .into_iter()
            .chain((8..=256).step_by(8))
            .chain((272..).step_by(16))
            .take_while(|&s| s < max)
            .chain(std::iter::once(max));
        Buckets::from_sorted(sizes)
    }

    fn from_sorted(sizes: impl Iterator<Item = usize>) -> Buckets {
        Buckets {
            sizes: sizes.collect(),
        }
    }

    /// The sizes, ascending.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The largest bucket.
    pub fn largest(&self) -> usize {
        // Never empty: every constructor puts at least one size in.
        self.sizes.last().copied().unwrap_or(1)
    }

    /// Whether `size` is one of the buckets.
    pub fn contains(&self, size: usize) -> bool {
        self.sizes.binary_search(&size).is_ok()
    }

    /// The smallest bucket that holds `size` (a size of 0 pads to the smallest bucket).
    pub fn pick(&self, size: usize) -> Bucket {
        let i = self.sizes.partition_point(|&b| b < size);
        match self.sizes.get(i) {
            Some(&b) => Bucket::Padded(b),
            None => Bucket::Above {
                size,
                largest: self.largest(),
            },
        }
    }
}

impl fmt::Debug for Buckets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.sizes {
            [one] => write!(f, "Buckets[{one}]"),
            [first, .., last] => write!(f, "Buckets[{} sizes, {first}..={last}]", self.sizes.len()),
            [] => write!(f, "Buckets[]"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_produce_the_documented_sizes() {
        assert_eq!(Buckets::powers_of_two(32).sizes(), &[1, 2, 4, 8, 16, 32]);
        assert_eq!(
            Buckets::powers_of_two(48).sizes(),
            &[1, 2, 4, 8, 16, 32, 48]
        );
        let s = Buckets::stepped(512);
        assert_eq!(&s.sizes()[..5], &[1, 2, 4, 8, 16]);
        assert!(s.contains(256) && s.contains(272) && s.contains(512));
        assert!(!s.contains(264));
        assert_eq!(s.sizes().len(), 3 + 32 + 16);
        assert_eq!(Buckets::stepped(1).sizes(), &[1]);
    }

    #[test]
    fn pick_pads_up_and_reports_overflow() {
        let b = Buckets::new([8, 1, 32, 8]).unwrap();
        assert_eq!(b.sizes(), &[1, 8, 32]);
        assert_eq!(b.pick(0), Bucket::Padded(1));
        assert_eq!(b.pick(1), Bucket::Padded(1));
        assert_eq!(b.pick(2), Bucket::Padded(8));
        assert_eq!(b.pick(32), Bucket::Padded(32));
        assert_eq!(
            b.pick(33),
            Bucket::Above {
                size: 33,
                largest: 32
            }
        );
        assert_eq!(b.pick(33).size(), 33);
        assert_eq!(Buckets::new([]), Err(BucketsError::Empty));
        assert_eq!(Buckets::new([0, 4]), Err(BucketsError::Zero));
    }

    proptest::proptest! {
        /// Against a linear scan: the picked bucket is the smallest one that holds the size.
        #[test]
        fn pick_matches_a_linear_scan(
            sizes in proptest::collection::vec(1usize..300, 1..40),
            size in 0usize..320,
        ) {
            let b = Buckets::new(sizes.iter().copied()).unwrap();
            let oracle = sizes.iter().copied().filter(|&s| s >= size).min();
            match (b.pick(size), oracle) {
                (Bucket::Padded(p), Some(o)) => proptest::prop_assert_eq!(p, o),
                (Bucket::Above { size: s, largest }, None) => {
                    proptest::prop_assert_eq!(s, size);
                    proptest::prop_assert_eq!(largest, *sizes.iter().max().unwrap());
                }
                (got, want) => proptest::prop_assert!(false, "{got:?} vs {want:?}"),
            }
        }
    }
}
