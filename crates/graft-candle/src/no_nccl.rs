//! Tensor parallelism's communicator in a build without the `nccl` feature (chosen in
//! `lib.rs`): the same items as `cuda/tp.rs`, none of which can be made, so that a model's
//! code is the same in every build and only making a communicator fails.

use std::time::Duration;

use candle_core::{Device, Tensor};
use graft_core::Member;
use graft_launch::{ProcessGroup, Rendezvous};

use crate::error::Error;

/// One rank's NCCL communicator: none can exist in this build; [`TpComm::init_rank`] refuses
/// ([`Error::NoCuda`] without the `cuda` feature, [`Error::NoNccl`] with it), so the other
/// methods are never reached.
#[derive(Clone, Debug)]
pub struct TpComm {
    never: Never,
}

/// No values: a [`TpComm`] cannot be made in this build.
#[derive(Clone, Copy, Debug)]
enum Never {}

impl TpComm {
    /// Refuses: this build has no NCCL.
    pub fn init_rank(
        _device: &Device,
        _place: &ProcessGroup,
        _rendezvous: &mut Rendezvous,
        _timeout: Duration,
    ) -> Result<TpComm, Error> {
        let what = "making an NCCL communicator";
        if cfg!(feature = "cuda") {
            Err(Error::NoNccl { what })
        } else {
            Err(Error::NoCuda { what })
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        match self.never {}
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        match self.never {}
    }

    /// Sums `t` over all ranks, in place.
    pub fn all_reduce_sum(&self, _t: &Tensor) -> Result<(), Error> {
        match self.never {}
    }

    /// This rank's watchdog on its peers.
    pub fn watchdog(
        &self,
        _rendezvous: &mut Rendezvous,
        _place: &ProcessGroup,
        _timeout: Duration,
        _bound: Duration,
        _member: &Member,
    ) -> Result<graft_launch::Watchdog, Error> {
        match self.never {}
    }

    /// Sets the largest all-reduce that takes the one-shot kernel instead of NCCL.
    pub fn set_one_shot_limit(&self, _bytes: usize) -> usize {
        match self.never {}
    }

    /// A group membership whose votes travel over this communicator.
    pub fn member(&self, _timeout: Duration) -> Result<Member, Error> {
        match self.never {}
    }
}
