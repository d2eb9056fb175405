//! The two backends of tests/processes.rs: simulated devices voting over the job's TCP
//! rendezvous, and one GPU per process with NCCL communicators voting over NCCL; each with the
//! rank's watchdog.

use super::*;

/// One device per process and what carries its votes (and its all-reduces).
pub(crate) trait Backend: 'static {
    type D: TestDevice;
    /// What a rank keeps besides its runtime: its communicator and kernels on CUDA.
    type Extra;
    /// How long a rank waits for the others at a vote.
    const VOTE: Duration;

    /// This process's device, its member of the job's group (watched by a [`Watchdog`] that
    /// aborts the communicator on a loss), and what else it keeps.
    fn open(place: &ProcessGroup) -> (Self::D, Member, Self::Extra, Watchdog, Shared);

    /// The body's collective over `out` (`n` f32s).
    fn all_reduce(extra: &Self::Extra, out: &Buffer, n: usize) -> Result<(), DeviceError>;

    /// What rank `rank` reads after a step whose `n` inputs are `x(r)` on rank `r`.
    fn expected(rank: usize, n: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32>;
}

/// Simulated devices, votes over TCP, no collective in the bodies.
pub(crate) struct Sim;

impl Backend for Sim {
    type D = SimDevice;
    type Extra = ();
    const VOTE: Duration = Duration::from_secs(3);

    fn open(place: &ProcessGroup) -> (SimDevice, Member, (), Watchdog, Shared) {
        let rv = Arc::new(Mutex::new(
            Rendezvous::join(place, JOIN).expect("every rank joins"),
        ));
        let member = Member::new(Arc::new(TcpBallotBox::new(rv.clone())), Self::VOTE);
        let watchdog =
            Watchdog::start(&mut rv.lock().unwrap(), place, JOIN, BOUND, &member, |_| {})
                .expect("the watchdog starts");
        (SimDevice::new(), member, (), watchdog, rv)
    }

    fn all_reduce(_: &(), _: &Buffer, _: usize) -> Result<(), DeviceError> {
        Ok(())
    }

    fn expected(rank: usize, _: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
        x(rank).iter().map(|v| A.mul_add(*v, B)).collect()
    }
}

/// One GPU per process, NCCL communicators from `init_rank`, votes over NCCL.
pub(crate) struct Cuda;

impl Backend for Cuda {
    type D = CudaDevice;
    /// Field order is drop order: the communicator after the runtime's graphs.
    type Extra = (Arc<NcclComm>, CudaTestKernels);
    /// Longer than the watchdog's bound: a stopped peer is the watchdog's to find, not the
    /// vote's (NCCL cannot tell which rank is missing).
    const VOTE: Duration = Duration::from_secs(5);

    fn open(place: &ProcessGroup) -> (CudaDevice, Member, Self::Extra, Watchdog, Shared) {
        let (dev, comm, kernels, mut rv) = nccl_rank(place);
        let comm = Arc::new(comm);
        let ballots = NcclBallotBox::new(comm.clone()).expect("the vote's memory");
        let member = Member::new(Arc::new(ballots), Self::VOTE);
        let watchdog = comm
            .watchdog(&mut rv, place, JOIN, BOUND, &member)
            .expect("the watchdog starts");
        (
            dev,
            member,
            (comm, kernels),
            watchdog,
            Arc::new(Mutex::new(rv)),
        )
    }

    fn all_reduce(extra: &Self::Extra, out: &Buffer, n: usize) -> Result<(), DeviceError> {
        extra.0.all_reduce_sum_f32(out, n)
    }

    fn expected(_: usize, n: usize, x: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
        (0..n)
            .map(|i| (0..WORLD).map(|r| A.mul_add(x(r)[i], B)).sum())
            .collect()
    }
}

/// The GPU of this process (its `LOCAL_RANK`) with the test kernels, its NCCL communicator
/// (rank 0 makes the unique id, the rendezvous broadcasts it), and the rendezvous.
pub(crate) fn nccl_rank(
    place: &ProcessGroup,
) -> (CudaDevice, NcclComm, CudaTestKernels, Rendezvous) {
    let dev = CudaDevice::new(place.local_rank()).expect("this rank's GPU");
    let kernels = CudaTestKernels::load(&dev).expect("the test kernels load");
    let (id, rv) = nccl_id(place);
    let comm = NcclComm::init_rank(&dev, &id, place.rank(), place.world(), JOIN)
        .expect("the NCCL communicator");
    (dev, comm, kernels, rv)
}

/// Rank 0's NCCL unique id on every rank, and the job's rendezvous.
pub(crate) fn nccl_id(place: &ProcessGroup) -> ([u8; graft::cuda::UNIQUE_ID_BYTES], Rendezvous) {
    let mut rv = Rendezvous::join(place, JOIN).expect("every rank joins");
    let mut id = if place.rank() == 0 {
        NcclComm::unique_id().expect("an NCCL unique id")
    } else {
        [0; graft::cuda::UNIQUE_ID_BYTES]
    };
    rv.broadcast(&mut id, JOIN)
        .expect("the id reaches every rank");
    (id, rv)
}
