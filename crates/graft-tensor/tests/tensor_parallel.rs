//! The tiny decoder split tensor-parallel over two simulated devices: each rank under graft
//! gives the tokens of the same split run eagerly, every rank gives the same tokens, and the
//! split computes the whole model (the same tokens as one device).

use std::sync::Arc;
use std::time::Duration;

use graft_core::{Config, Coordinator, FunctionId, Graft, Member, Outcome};
use graft_sim::{SimComm, SimDevice};
use graft_tensor::{Collective, Decoder, DecoderConfig, Meta, TensorError};

const SEED: u64 = 7;
const STEPS: usize = 24;

struct Rank {
    graft: Graft<SimDevice, Meta>,
    decoder: Decoder<SimDevice>,
    fid: FunctionId,
}

fn first_tokens(batch: usize) -> Vec<i32> {
    (0..batch).map(|i| ((i * 37 + 1) % 512) as i32).collect()
}

/// `STEPS` tokens of `batch` rows from `decoder`, eagerly or through graft.
fn decode(
    graft: &mut Graft<SimDevice, Meta>,
    decoder: &Decoder<SimDevice>,
    fid: FunctionId,
    batch: usize,
    through_graft: bool,
) -> Result<(Vec<Vec<i32>>, Vec<Outcome>), TensorError> {
    let mut state = decoder.new_state(graft, batch)?;
    let mut tokens = decoder.tokens(graft, &first_tokens(batch))?;
    let (mut out, mut outcomes) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        tokens = if through_graft {
            let (next, outcome) = decoder.step_graft_outcome(graft, fid, &mut state, &tokens)?;
            outcomes.push(outcome);
            next
        } else {
            decoder.step_eager(graft, &mut state, &tokens)?
        };
        out.push(tokens.to_vec_i32(graft.device())?);
    }
    Ok((out, outcomes))
}

fn ranks(world: usize) -> Coordinator<Rank> {
    let devices: Vec<SimDevice> = (0..world).map(|_| SimDevice::new()).collect();
    let comms = SimComm::group(&devices, Duration::from_secs(10));
    let seeds: Vec<_> = devices.into_iter().zip(comms).collect();
    Coordinator::start(
        seeds,
        Duration::from_secs(10),
        |(device, comm): (SimDevice, SimComm), member: Member| {
            let mut graft = Graft::new(device, Config::default());
            graft.join(member);
            let comm: Arc<dyn Collective> = Arc::new(comm);
            let decoder = Decoder::new_sharded(&mut graft, DecoderConfig::tiny(), SEED, comm)?;
            let fid = decoder.register(&mut graft);
            Ok::<_, TensorError>(Rank {
                graft,
                decoder,
                fid,
            })
        },
    )
    .unwrap()
}

#[test]
fn split_decoder_under_graft_matches_eager_on_every_rank() {
    let c = ranks(2);
    for batch in [1, 8] {
        let runs = c
            .step(move |_, r: &mut Rank| {
                let (eager, _) = decode(&mut r.graft, &r.decoder, r.fid, batch, false)?;
                let (grafted, outcomes) = decode(&mut r.graft, &r.decoder, r.fid, batch, true)?;
                Ok::<_, TensorError>((eager, grafted, outcomes, r.graft.stats()))
            })
            .unwrap();
        let runs: Vec<_> = runs.into_iter().map(Result::unwrap).collect();
        for (rank, (eager, grafted, outcomes, stats)) in runs.iter().enumerate() {
            assert_eq!(eager, grafted, "rank {rank}, batch {batch}");
            assert!(matches!(outcomes[1], Outcome::Recorded(_)), "{outcomes:?}");
            assert!(
                outcomes[2..]
                    .iter()
                    .all(|o| matches!(o, Outcome::Replayed(_)))
            );
            assert!(stats.agreements >= 1, "the recording was agreed");
            assert_eq!(eager, &runs[0].0, "rank {rank} and rank 0 differ");
        }
    }
}

#[test]
fn split_decoder_computes_the_whole_model() {
    let mut g = Graft::new(SimDevice::new(), Config::default());
    let whole = Decoder::new(&mut g, DecoderConfig::tiny(), SEED).unwrap();
    let fid = whole.register(&mut g);
    let (expected, _) = decode(&mut g, &whole, fid, 4, false).unwrap();
    let c = ranks(2);
    let split = c
        .step(|_, r: &mut Rank| decode(&mut r.graft, &r.decoder, r.fid, 4, false).map(|t| t.0))
        .unwrap();
    // Sums of two partial products round differently from one whole product, so the logits
    // differ in their last bits: the tokens of this model and seed do not.
    assert_eq!(split[0].as_ref().unwrap(), &expected);
}

#[test]
fn a_split_needs_heads_and_ffn_divisible_by_the_world() {
    let devices: Vec<SimDevice> = (0..3).map(|_| SimDevice::new()).collect();
    let comm: Arc<dyn Collective> = Arc::new(
        SimComm::group(&devices, Duration::from_secs(1))
            .into_iter()
            .next()
            .unwrap(),
    );
    let mut g = Graft::<SimDevice, Meta>::new(devices[0].clone(), Config::default());
    let err = Decoder::new_sharded(&mut g, DecoderConfig::tiny(), SEED, comm).unwrap_err();
    assert!(matches!(err, TensorError::Config { .. }), "{err}");
}
