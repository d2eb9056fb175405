//! NCCL's non-blocking communicator (`NcclComm::init_rank`) and the vote over it
//! (`NcclBallotBox`), on one GPU: a job of one rank, so that the bounded init, the polled
//! enqueues and the vote's all-reduce run on a single-GPU machine. Ignored (CI has no GPU);
//! `scripts/gpu-run.sh` runs them with NCCL and `NCCL_RUNTIME_CONNECT=0`.

use std::sync::Arc;
use std::time::Duration;

use graft_core::{
    Ballot, BallotBox, Config, Ctx, DeviceError, DeviceOp, FunctionSpec, Graft, GroupError, Member,
    Outcome, Output,
};
use graft_cuda::{CudaDevice, NcclBallotBox, NcclComm};
use graft_testkit::{CudaTestKernels, TestQueue};

const DEADLINE: Duration = Duration::from_secs(30);
const N: usize = 256;

/// GPU 0 with the test kernels, and a one-rank communicator on it.
fn one_rank() -> (CudaDevice, CudaTestKernels, Arc<NcclComm>) {
    let dev = CudaDevice::new(0).expect("open cuda:0");
    let kernels = CudaTestKernels::load(&dev).expect("the test kernels load");
    let id = NcclComm::unique_id().expect("an NCCL unique id");
    let comm = NcclComm::init_rank(&dev, &id, 0, 1, DEADLINE).expect("a one-rank communicator");
    (dev, kernels, Arc::new(comm))
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn a_one_rank_job_votes_over_nccl_and_records_its_all_reduce() {
    let (dev, _kernels, comm) = one_rank();
    let ballots = NcclBallotBox::new(comm.clone()).expect("the vote's memory");
    let ballot = Ballot::from_words([2, 5, 9]).unwrap();
    assert_eq!(ballots.exchange(ballot, DEADLINE), Ok(vec![ballot]));

    let mut g: Graft<CudaDevice, ()> = Graft::new(dev, Config::default());
    g.join(Member::new(Arc::new(ballots), DEADLINE));
    let f = g.register("axpb_all_reduce", FunctionSpec::default());
    let x = g.alloc(N * 4).unwrap();
    let mut outcomes = Vec::new();
    for step in 0..6 {
        let input: Vec<f32> = (0..N).map(|i| (step * 1000 + i) as f32).collect();
        g.write_f32(&x, &input).unwrap();
        let mut out = Vec::new();
        let outcome = g
            .call_into(
                f,
                &[&x],
                &[],
                |ctx: &mut Ctx<'_, CudaDevice>| {
                    let x = ctx.input(0).clone();
                    let y = ctx.alloc(x.len())?;
                    ctx.queue().axpb_f32(&y, &x, 2.0, 1.0, N)?;
                    comm.all_reduce_sum_f32(&y, N)?;
                    Ok(vec![Output::new(y, ())])
                },
                &mut out,
            )
            .unwrap();
        let expected: Vec<f32> = input.iter().map(|v| 2.0f32.mul_add(*v, 1.0)).collect();
        assert_eq!(g.read_f32(&out[0].buffer).unwrap(), expected, "step {step}");
        outcomes.push(outcome);
    }
    assert_eq!(outcomes[0], Outcome::Warmup);
    assert!(matches!(outcomes[1], Outcome::Recorded(_)), "{outcomes:?}");
    assert!(
        outcomes[2..]
            .iter()
            .all(|o| matches!(o, Outcome::Replayed(_)))
    );
    let stats = g.stats();
    assert_eq!((stats.agreements, stats.recordings), (1, 1), "{stats:?}");
    assert!(!g.member().unwrap().is_broken());
    // The runtime (its graphs, and the ballot box) goes before the communicator.
    g.close().expect("no error left behind");
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn an_aborted_communicator_fails_votes_and_all_reduces() {
    let (dev, _kernels, comm) = one_rank();
    let ballots = NcclBallotBox::new(comm.clone()).expect("the vote's memory");
    comm.abort().expect("the abort");
    comm.abort().expect("a second abort does nothing");
    let ballot = Ballot::from_words([1, 0, 0]).unwrap();
    let aborted = DeviceError::CollectiveAborted {
        op: DeviceOp::Collective,
    };
    assert_eq!(
        ballots.exchange(ballot, DEADLINE),
        Err(GroupError::Device {
            rank: 0,
            source: aborted.clone()
        })
    );
    let mut g: Graft<CudaDevice, ()> = Graft::new(dev, Config::default());
    let y = g.alloc(16).unwrap();
    assert_eq!(comm.all_reduce_sum_f32(&y, 4), Err(aborted));
}
