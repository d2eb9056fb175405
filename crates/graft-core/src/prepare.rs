//! Eager capture of every bucket up front, largest first, as serving engines do at start-up.

use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::{CallError, FunctionId};
use crate::graft::{Graft, Outcome};

/// What [`Graft::capture_buckets`] did for one bucket.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct BucketCapture {
    /// The bucket.
    pub bucket: usize,
    /// How its last call ended: `Recorded` normally, `Replayed` if it was recorded before,
    /// `Eager` if it cannot be captured (see [`Graft::explain`] for why).
    pub outcome: Outcome,
    /// Calls made (warmups included).
    pub calls: u32,
    /// Wall time of those calls, host side (the device may still be running the last one).
    pub elapsed: Duration,
}

/// What [`Graft::capture_buckets`] did, largest bucket first.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct CaptureReport {
    /// One entry per bucket.
    pub buckets: Vec<BucketCapture>,
    /// Wall time of the whole capture.
    pub elapsed: Duration,
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// Warms up and records `function` at every one of its buckets now, largest first, so
    /// that serving never pays for a recording (lazy capture, the alternative, is what a plain
    /// call does on first use of a bucket). `step(graft, bucket)` makes one call of the
    /// function at `bucket` (inputs padded to it, `keys[0] = bucket`) and returns its outcome;
    /// it is called until the bucket is recorded (its warmups first), each bucket in a
    /// generation of its own. Every bucket records at the root of the tree, so all of them
    /// share the graph pool: together they hold about what the largest holds alone.
    ///
    /// Errors if the function has no buckets, or with the first error `step` returns (a
    /// framework's own error type, which a graft error converts into); buckets captured
    /// before it stay recorded.
    pub fn capture_buckets<F, E>(
        &mut self,
        function: FunctionId,
        mut step: F,
    ) -> Result<CaptureReport, E>
    where
        F: FnMut(&mut Graft<D, M>, usize) -> Result<Outcome, E>,
        E: From<CallError>,
    {
        let Some(f) = self.functions.get(function) else {
            return Err(CallError::UnknownFunction { id: function }.into());
        };
        let Some(buckets) = f.spec.buckets.clone() else {
            return Err(CallError::NoBuckets {
                function: f.name.clone(),
            }
            .into());
        };
        let _span = tracing::info_span!("capture_buckets", function = %f.name, buckets = buckets.sizes().len()).entered();
        // Enough calls for the warmups and the recording, with room for one re-record.
        let calls = f.spec.warmups.unwrap_or(self.config.warmups) + 2;
        let start = Instant::now();
        let mut report = Vec::with_capacity(buckets.sizes().len());
        for &bucket in buckets.sizes().iter().rev() {
            self.mark_step_begin();
            let began = Instant::now();
            let mut made = 0;
            let outcome = loop {
                made += 1;
                let outcome = step(self, bucket)?;
                if outcome != Outcome::Warmup || made >= calls {
                    break outcome;
                }
            };
            tracing::debug!(bucket, ?outcome, calls = made, "bucket captured");
            report.push(BucketCapture {
                bucket,
                outcome,
                calls: made,
                elapsed: began.elapsed(),
            });
        }
        self.mark_step_begin();
        Ok(CaptureReport {
            buckets: report,
            elapsed: start.elapsed(),
        })
    }
}
