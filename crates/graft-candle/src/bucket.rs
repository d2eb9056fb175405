//! Batch buckets: a batch is padded up to the smallest bucket that holds it, so a handful of
//! recorded graphs serve every batch size. The bucket is part of a step's signature (its
//! keys), like any shape.

use crate::error::Error;

/// The bucket sizes a runtime pads batches to, strictly increasing.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Buckets(Vec<usize>);

impl Buckets {
    /// A bucket list: non-empty, strictly increasing, every size at least 1.
    pub fn new(sizes: impl Into<Vec<usize>>) -> Result<Buckets, Error> {
        let sizes = sizes.into();
        let increasing = sizes.windows(2).all(|w| w[0] < w[1]);
        if sizes.is_empty() || sizes[0] == 0 || !increasing {
            return Err(Error::BadBuckets { buckets: sizes });
        }
        Ok(Buckets(sizes))
    }

    /// The bucket sizes.
    pub fn sizes(&self) -> &[usize] {
        &self.0
    }

    /// The smallest bucket that holds `batch` rows (a batch of 0 uses the smallest bucket).
    pub fn bucket_for(&self, batch: usize) -> Result<usize, Error> {
        let largest = self.0[self.0.len() - 1];
        self.0
            .iter()
            .copied()
            .find(|&b| b >= batch)
            .ok_or(Error::NoBucket { batch, largest })
    }

    /// `rows` padded with `pad` up to its bucket; returns the bucket and the padded rows.
    pub fn pad<T: Copy>(&self, rows: &[T], pad: T) -> Result<(usize, Vec<T>), Error> {
        let bucket = self.bucket_for(rows.len())?;
        let mut padded = Vec::with_capacity(bucket);
        padded.extend_from_slice(rows);
        padded.resize(bucket, pad);
        Ok((bucket, padded))
    }
}

impl Default for Buckets {
    /// 1, 8 and 32.
    fn default() -> Buckets {
        Buckets(vec![1, 8, 32])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_to_the_smallest_bucket_that_holds_the_batch() {
        let b = Buckets::default();
        assert_eq!(b.bucket_for(0).unwrap(), 1);
        assert_eq!(b.bucket_for(1).unwrap(), 1);
        assert_eq!(b.bucket_for(2).unwrap(), 8);
        assert_eq!(b.bucket_for(8).unwrap(), 8);
        assert_eq!(b.bucket_for(9).unwrap(), 32);
        assert_eq!(
            b.pad(&[5u32, 6, 7], 0).unwrap(),
            (8, vec![5, 6, 7, 0, 0, 0, 0, 0])
        );
    }

    #[test]
    fn too_large_a_batch_and_bad_lists_are_errors() {
        let b = Buckets::default();
        let e = b.bucket_for(33).unwrap_err();
        assert!(matches!(
            e,
            Error::NoBucket {
                batch: 33,
                largest: 32
            }
        ));
        assert!(e.to_string().contains("split it"), "{e}");
        for bad in [vec![], vec![0, 1], vec![8, 8], vec![8, 1]] {
            assert!(matches!(Buckets::new(bad), Err(Error::BadBuckets { .. })));
        }
        assert_eq!(Buckets::new([1, 4]).unwrap().sizes(), &[1, 4]);
    }
}
