//! Padding a batch to its bucket (graft-core's [`Buckets`]): a handful of recorded graphs
//! serve every batch size. The bucket is the first signature key of a step registered with
//! buckets ([`crate::CandleGraft::register_bucketed`]).

use graft_core::Buckets;

/// `rows` padded with `pad` to the bucket `buckets` picks for them. Returns the size to pass
/// as `keys[0]` and the padded rows: the bucket, or, above the largest bucket, the real size
/// (unpadded; graft runs that call eagerly with `EagerReason::AboveLargestBucket`).
pub fn pad<T: Copy>(buckets: &Buckets, rows: &[T], pad: T) -> (usize, Vec<T>) {
    let size = buckets.pick(rows.len()).size().max(rows.len());
    let mut padded = Vec::with_capacity(size);
    padded.extend_from_slice(rows);
    padded.resize(size, pad);
    (size, padded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_to_the_smallest_bucket_that_holds_the_batch() {
        let b = Buckets::new([1, 8, 32]).unwrap();
        assert_eq!(pad(&b, &[] as &[u32], 0), (1, vec![0]));
        assert_eq!(pad(&b, &[4u32], 0), (1, vec![4]));
        assert_eq!(pad(&b, &[5u32, 6, 7], 0), (8, vec![5, 6, 7, 0, 0, 0, 0, 0]));
        assert_eq!(pad(&b, &[1u32; 32], 0).0, 32);
    }

    #[test]
    fn above_the_largest_bucket_the_real_size_is_kept() {
        let b = Buckets::new([1, 8]).unwrap();
        assert_eq!(pad(&b, &[2u32; 9], 0), (9, vec![2; 9]));
    }
}
