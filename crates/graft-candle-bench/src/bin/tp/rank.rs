//! One rank of a `graft-candle-tp` job (`--as-rank`, started by the parent with graft's
//! `launch_local`): its GPU is `LOCAL_RANK`; it makes its NCCL communicator on candle's stream
//! (rank 0's unique id over the job's rendezvous), builds its part of each Llama, joins each
//! `CandleGraft` to the group (votes over NCCL), measures, and writes its report as one JSON
//! line on stdout, after [`REPORT`].

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use graft_candle::candle_core::DType;
use graft_candle::cuda::TpComm;
use graft_candle::{Buckets, CandleGraft};
use graft_candle_bench::common::BenchResult;
use graft_candle_bench::decode::CHECK_STEPS;
use graft_candle_models::llama::{self, Sizes};
use graft_candle_models::{Collective, Decoder, Shard};
use graft_core::Member;
use graft_launch::{ProcessGroup, Rendezvous, Watchdog};
use serde::{Deserialize, Serialize};

use super::Options;
use super::measure::{self, CHECK, SEED, Timed, Tokens};

/// How long a rank may take to join the job and to set up NCCL.
const JOIN: Duration = Duration::from_secs(120);
/// How long a recording's vote may wait for the other ranks.
const AGREEMENT: Duration = Duration::from_secs(120);

/// The start of the stdout line a rank's report is on (JSON after it): anything else a
/// library prints to stdout (NCCL's messages go there) is left aside.
pub(crate) const REPORT: &str = "graft-candle-tp report: ";

/// What one rank reports.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RankReport {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// The f32 check model's tokens: per batch, per step.
    pub(crate) tokens: Tokens,
    /// Per model, per batch size (in the order given).
    pub(crate) timed: Vec<Vec<Timed>>,
}

/// A runtime on `part`'s device that joined the group, with the decode step registered at
/// `batches`.
fn joined(
    part: &Decoder,
    member: &Member,
    batches: &[usize],
) -> BenchResult<(CandleGraft, graft_candle::StepId)> {
    let mut graft = CandleGraft::new(part.device())?;
    graft.join(member.clone());
    let step = graft.register_bucketed("decode", Buckets::new(batches.iter().copied())?);
    Ok((graft, step))
}

/// Runs this process's rank of the job `o` describes and writes its report to `out`: the
/// check model's tokens at `o.batches`, then each of `o.models` in bf16 timed at `o.batches`
/// (`o.steps` timed steps per variant, as `o.timing` splits them).
pub(crate) fn run(o: &Options, out: &mut dyn Write) -> BenchResult<()> {
    let models: Vec<Sizes> = o.models.iter().map(|m| m.sizes()).collect();
    let (batches, steps, timing) = (&o.batches[..], o.steps, &o.timing);
    let place = ProcessGroup::from_env()?;
    let mut rendezvous = Rendezvous::join(&place, JOIN)?;
    let device = graft_candle::device(place.local_rank())?;
    let comm = TpComm::init_rank(&device, &place, &mut rendezvous, JOIN)?;
    if let Some(limit) = o.one_shot_limit {
        comm.set_one_shot_limit(limit);
    }
    // One membership for every runtime of this rank, watched: a lost peer breaks them all and
    // aborts the communicator.
    let member = comm.member(AGREEMENT)?;
    let _watchdog = comm.watchdog(
        &mut rendezvous,
        &place,
        JOIN,
        Watchdog::DEFAULT_BOUND,
        &member,
    )?;
    let collective: Arc<dyn Collective> = Arc::new(comm.clone());
    let shard = || {
        let shard = Shard::new(place.rank(), place.world(), collective.clone())?;
        Ok::<_, graft_candle::candle_core::Error>(if o.split_vocab {
            shard.split_vocab()
        } else {
            shard
        })
    };
    let part = |sizes: &Sizes, dtype| llama::random_sharded(sizes, SEED, dtype, &device, shard()?);

    let model = part(&CHECK, DType::F32)?;
    let (mut graft, step) = joined(&model, &member, batches)?;
    let tokens = measure::tokens(&model, &mut graft, step, batches, CHECK_STEPS)?;
    // The graphs go before the model's tensors and the communicator they captured.
    drop(graft);
    drop(model);

    let mut timed = Vec::new();
    for sizes in &models {
        let mut model = part(sizes, DType::BF16)?;
        model.set_chained_step(!o.per_op);
        let (mut graft, step) = joined(&model, &member, batches)?;
        let per_batch = batches
            .iter()
            .map(|&b| measure::time_step(&model, &mut graft, step, b, steps, timing))
            .collect::<BenchResult<Vec<_>>>()?;
        timed.push(per_batch);
        drop(graft);
    }
    let report = RankReport {
        rank: place.rank(),
        world: place.world(),
        tokens,
        timed,
    };
    write!(out, "{REPORT}")?;
    serde_json::to_writer(&mut *out, &report)?;
    writeln!(out)?;
    device.synchronize()?;
    drop(collective);
    drop(comm);
    drop(rendezvous);
    Ok(())
}
