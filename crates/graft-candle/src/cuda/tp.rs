//! Tensor parallelism for candle users: one rank's NCCL communicator over candle's stream
//! (so that a collective a body enqueues is captured into the step's graph and replayed with
//! it), in-place sum all-reduces of candle tensors, and the group membership a
//! [`CandleGraft`](crate::CandleGraft) joins so that all ranks agree on every recording.

use std::sync::Arc;
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Device, Tensor};
use graft_core::Member;
use graft_cuda::{CudaDevice as GraftCuda, NcclBallotBox, NcclComm, NcclDtype, UNIQUE_ID_BYTES};
use graft_launch::{ProcessGroup, Rendezvous, Watchdog};

use super::copy::tensor_range;
use crate::error::Error;

/// What [`TpComm::all_reduce_sum`] reports its refusals as.
const ALL_REDUCE: &str = "all-reducing a tensor";

/// One rank's NCCL communicator on the stream of a candle CUDA device made by
/// [`crate::device`]: its all-reduces run on candle's stream, in order with the model's
/// kernels, and are captured when a graft recording captures that stream.
///
/// Drop it after every [`CandleGraft`](crate::CandleGraft) whose graphs captured its
/// collectives (and after the [`Member`] made from it): a graph must not outlive the
/// communicator it launches on.
#[derive(Clone, Debug)]
pub struct TpComm {
    comm: Arc<NcclComm>,
    device: Device,
    stream: Arc<CudaStream>,
}

impl TpComm {
    /// The communicator of rank `place.rank()` of a job of `place.world()` processes, one per
    /// GPU, on `device`'s stream: rank 0 makes NCCL's unique id and sends it to the others over
    /// `rendezvous` (the job's [`Rendezvous`]); every rank then joins with
    /// `ncclCommInitRank`, non-blocking, waiting at most `timeout` for each part. Needs
    /// `NCCL_RUNTIME_CONNECT=0` in the environment (see graft-cuda's `NcclComm::init_rank`).
    pub fn init_rank(
        device: &Device,
        place: &ProcessGroup,
        rendezvous: &mut Rendezvous,
        timeout: Duration,
    ) -> Result<TpComm, Error> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::NotCuda {
                what: "making an NCCL communicator",
                location: format!("{:?}", device.location()),
            });
        };
        let stream = cuda.cuda_stream();
        let graft = GraftCuda::from_stream(stream.clone()).map_err(|source| Error::Device {
            what: "opening graft's CUDA device on candle's stream for NCCL",
            source,
        })?;
        let mut id = [0; UNIQUE_ID_BYTES];
        if place.rank() == 0 {
            id = NcclComm::unique_id().map_err(|source| Error::Device {
                what: "making NCCL's unique id",
                source,
            })?;
        }
        rendezvous
            .broadcast(&mut id, timeout)
            .map_err(|source| Error::Rendezvous { source })?;
        let comm = NcclComm::init_rank(&graft, &id, place.rank(), place.world(), timeout).map_err(
            |source| Error::Device {
                what: "making this rank's NCCL communicator",
                source,
            },
        )?;
        Ok(TpComm {
            comm: Arc::new(comm),
            device: device.clone(),
            stream,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// Sums `t` over all ranks, in place: every rank's `t` holds the sum once candle's stream
    /// has run the collective (later work on that stream sees it). `t` must be a contiguous
    /// f32, bf16 or f16 tensor on this communicator's device; every rank must call this with
    /// a tensor of the same shape and dtype, in the same order. Inside a graft recording the
    /// collective is captured and runs at every replay.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<(), Error> {
        let refuse = |why| Error::Collective {
            op: ALL_REDUCE,
            why,
        };
        let dtype = match t.dtype() {
            DType::F32 => NcclDtype::F32,
            DType::BF16 => NcclDtype::Bf16,
            DType::F16 => NcclDtype::F16,
            _ => return Err(refuse("the tensor's dtype is not f32, bf16 or f16")),
        };
        if !t.device().same_device(&self.device) {
            return Err(refuse(
                "the tensor is on another device than the communicator",
            ));
        }
        if !t.is_contiguous() {
            return Err(refuse(
                "the tensor is not contiguous: call .contiguous() first",
            ));
        }
        let Some((at, _)) = tensor_range(t, &self.stream) else {
            return Err(refuse("the tensor has no CUDA storage"));
        };
        // SAFETY: `at` is the first of `t.elem_count()` contiguous elements of `dtype` of a
        // live candle tensor on this communicator's device (checked above; candle allocates
        // in the device's primary context). The caller holds `t`, and candle frees a
        // tensor's memory only in the order of this same stream (event tracking is off:
        // `crate::device`), so the memory outlives the collective; everything else that
        // touches it runs on this stream too, ordered before or after it.
        unsafe { self.comm.all_reduce_sum_raw(at, t.elem_count(), dtype) }.map_err(|source| {
            Error::Device {
                what: ALL_REDUCE,
                source,
            }
        })
    }

    /// Sets the largest all-reduce, in bytes, that [`TpComm::all_reduce_sum`] sends through
    /// graft-cuda's one-shot kernel over peer memory (NVLink) instead of NCCL, and returns the
    /// limit now in force. On by default (256 KiB, the most) where every rank's GPU reaches
    /// the others' memory, 0 where it does not; pass 0 for NCCL always, e.g. to compare both
    /// in one process. Every rank must set the same limit between the same two all-reduces
    /// (otherwise ranks take different paths and wait on each other until the watchdog
    /// aborts them); a recording keeps the path it captured, so set it before recording.
    pub fn set_one_shot_limit(&self, bytes: usize) -> usize {
        self.comm.set_one_shot_limit(bytes)
    }

    /// A group membership whose votes travel over this communicator (graft-cuda's
    /// `NcclBallotBox`), each waiting at most `timeout`: pass it to
    /// [`CandleGraft::join`](crate::CandleGraft::join).
    pub fn member(&self, timeout: Duration) -> Result<Member, Error> {
        let ballots = NcclBallotBox::new(self.comm.clone()).map_err(|source| Error::Device {
            what: "making the NCCL ballot box",
            source,
        })?;
        Ok(Member::new(Arc::new(ballots), timeout))
    }

    /// Starts this rank's [`Watchdog`] on its peers (every rank at the same point, after
    /// [`TpComm::init_rank`], with the same rendezvous): a peer whose process ends, or that
    /// stays silent for `bound`, breaks `member`'s group (every later call refuses) and
    /// aborts this communicator, so that a replay or an eager step whose all-reduce waits on
    /// the peer returns. Keep it for the job's life; drop it after the runtimes.
    ///
    /// Tensors a step wrote before the loss was found are the caller's: read them, then ask
    /// `member.is_broken()` (a broken group means an all-reduce may have been cut short, so
    /// discard them).
    pub fn watchdog(
        &self,
        rendezvous: &mut Rendezvous,
        place: &ProcessGroup,
        timeout: Duration,
        bound: Duration,
        member: &Member,
    ) -> Result<Watchdog, Error> {
        self.comm
            .watchdog(rendezvous, place, timeout, bound, member)
            .map_err(|source| Error::Watchdog { source })
    }
}
