//! Tensor parallelism on 2 GPUs, one process each: the test starts two copies of this test
//! executable (graft's `launch_local`, which sets each rank's place in the environment), each
//! running this same test as one rank (`TP_RANK_VAR` set): it makes its NCCL communicator on
//! candle's stream, joins its `CandleGraft` to the group, loads its half of the bench Llama
//! (f32) and decodes under graft (the all-reduces captured into the graphs), printing its
//! tokens on one marked line. The parent decodes the whole model on GPU 0 and checks that
//! both ranks' tokens equal its own, step for step. Skipped, with a message, on one GPU.

use std::sync::Arc;
use std::time::Duration;

use graft_candle::candle_core::cuda_backend::cudarc::driver::CudaContext;
use graft_candle::candle_core::{DType, Tensor};
use graft_candle::cuda::TpComm;
use graft_candle::{Buckets, CandleGraft, StepOutcome};
use graft_candle_models::llama::{self, Sizes};
use graft_candle_models::{Collective, Decoder, Shard};
use graft_launch::{ProcessGroup, Rendezvous, Watchdog, launch_local};

use super::{TestResult, decode, first_tokens, gpu, steps};

/// Set in a rank's environment: this copy of the executable is a rank.
const TP_RANK_VAR: &str = "GRAFT_CANDLE_TP_RANK";
/// The start of the stdout line a rank prints its tokens on (JSON after it).
const MARK: &str = "tp-tokens: ";
/// This test's path in the executable (for the copies' `--exact`).
const NAME: &str = "tp::two_processes_decode_the_same_tokens_as_one_gpu";
const WORLD: usize = 2;
const SEED: u64 = 99;
const BATCHES: [usize; 2] = [1, 8];
/// Bounds the job, the rendezvous, NCCL's setup and each vote.
const WAIT: Duration = Duration::from_secs(120);

/// The tokens of `steps` greedy steps under `graft` at each of [`BATCHES`], each step's
/// output the next one's input (a new tensor every step), with every step after the first
/// three a replay: a warmup, a recording, and on a rank one more recording with the moved
/// tokens copied in (a graph holding NCCL's kernels cannot follow them: they find their
/// buffers through work descriptors of their own).
fn run(
    model: &Decoder,
    graft: &mut CandleGraft,
    steps: usize,
) -> Result<Vec<Vec<Vec<u32>>>, Box<dyn std::error::Error>> {
    let step = graft.register_bucketed("decode", Buckets::new(BATCHES)?);
    let mut all = Vec::new();
    for batch in BATCHES {
        let cache = model.new_cache(batch, 96)?;
        let mut t = Tensor::new(first_tokens(batch, model.spec().vocab), model.device())?;
        let mut per_step = Vec::new();
        for i in 0..steps {
            let (next, outcome) = decode(graft, step, model, &cache, &t)?;
            per_step.push(next.to_vec1::<u32>()?);
            t = next;
            if i >= 3 && graft.is_graphed() {
                assert!(
                    matches!(outcome, StepOutcome::Replayed(_)),
                    "step {i} at B={batch}: {outcome:?}"
                );
            }
        }
        all.push(per_step);
    }
    Ok(all)
}

/// One rank: its half of the model, joined to the group, its tokens on stdout.
fn rank(steps: usize) -> TestResult {
    let place = ProcessGroup::from_env()?;
    let mut rendezvous = Rendezvous::join(&place, WAIT)?;
    let device = graft_candle::device(place.local_rank())?;
    let comm = TpComm::init_rank(&device, &place, &mut rendezvous, WAIT)?;
    let collective: Arc<dyn Collective> = Arc::new(comm.clone());
    let shard = Shard::new(place.rank(), place.world(), collective.clone())?;
    let model = llama::random_sharded(&Sizes::BENCH, SEED, DType::F32, &device, shard)?;
    let member = comm.member(WAIT)?;
    let _watchdog = comm.watchdog(
        &mut rendezvous,
        &place,
        WAIT,
        Watchdog::DEFAULT_BOUND,
        &member,
    )?;
    let mut graft = CandleGraft::new(&device)?;
    graft.join(member);
    let tokens = run(&model, &mut graft, steps)?;
    println!("{MARK}{}", serde_json::to_string(&tokens)?);
    // The graphs before the communicator they captured.
    drop(graft);
    drop(model);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_decode_the_same_tokens_as_one_gpu() -> TestResult {
    let steps = steps(32, 4);
    if std::env::var_os(TP_RANK_VAR).is_some() {
        return rank(steps);
    }
    let found = CudaContext::device_count()?;
    if found < WORLD as i32 {
        eprintln!("skipped: needs {WORLD} CUDA GPUs, found {found}");
        return Ok(());
    }
    let want = {
        let device = gpu();
        let model = llama::random(&Sizes::BENCH, SEED, DType::F32, &device)?;
        run(&model, &mut CandleGraft::new(&device)?, steps)?
    };
    let program = std::env::current_exe()?;
    let args = [
        "--exact",
        NAME,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ];
    let env = [
        (TP_RANK_VAR, "1".to_owned()),
        ("NCCL_RUNTIME_CONNECT", "0".to_owned()),
        ("NCCL_NVLS_ENABLE", "0".to_owned()),
    ];
    let exits = launch_local(&program, &args, WORLD, &[0, 1], &env, WAIT * 3, true)?;
    for e in &exits {
        let stdout = String::from_utf8_lossy(&e.stdout);
        assert!(
            e.status.is_some_and(|s| s.success()),
            "rank {} ended with {:?} after {:?}; stderr:\n{}\nstdout:\n{stdout}",
            e.rank,
            e.status,
            e.took,
            e.stderr
        );
        let line = stdout
            .lines()
            // libtest's "test NAME ... " comes first on the line.
            .find_map(|l| l.split_once(MARK).map(|(_, tokens)| tokens))
            .ok_or_else(|| format!("rank {} printed no tokens; stdout:\n{stdout}", e.rank))?;
        let got: Vec<Vec<Vec<u32>>> = serde_json::from_str(line)?;
        for ((batch, want), got) in BATCHES.iter().zip(&want).zip(&got) {
            assert_eq!(
                want, got,
                "rank {}'s tokens at B={batch} differ from one GPU's",
                e.rank
            );
        }
    }
    Ok(())
}
