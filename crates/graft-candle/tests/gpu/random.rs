//! graft-candle's device-side generator on the GPU: the same bits as the CPU, and under graft
//! a replayed dropout step draws new numbers at every call, exactly the numbers of eager calls,
//! and follows a seed set between replays.

use graft_candle::candle_core::{Device, Tensor};
use graft_candle::random::DeviceRng;
use graft_candle::{CandleGraft, StepId, StepOutcome};

use super::{TestResult, diagnostics, gpu};

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

const SEED: u64 = 0x0123_4567_89ab_cdef;

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Draws of several sizes (multiples of 4 and not) in a row, on the GPU and on the CPU, from
/// the same seed: the same bits, and the same offset after each.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_draws_equal_cpu_draws_bit_for_bit() -> TestResult {
    let device = gpu();
    let on_gpu = DeviceRng::new(&device, SEED)?;
    let on_cpu = DeviceRng::new(&Device::Cpu, SEED)?;
    // 4099: a partial block, and more than one CUDA block of threads (256 x 4 elements).
    for n in [1, 4, 7, 1000, 4099, 64] {
        let got = on_gpu.uniform(n)?.to_vec1::<f32>()?;
        let want = on_cpu.uniform(n)?.to_vec1::<f32>()?;
        assert_eq!(bits(&got), bits(&want), "a draw of {n}");
        assert_eq!(on_gpu.offset()?, on_cpu.offset()?, "after a draw of {n}");
    }
    on_gpu.set_seed(5)?;
    on_cpu.set_seed(5)?;
    let got = on_gpu.uniform((3, 5))?.flatten_all()?.to_vec1::<f32>()?;
    let want = on_cpu.uniform((3, 5))?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(bits(&got), bits(&want), "after set_seed");
    assert_eq!(on_gpu.seed()?, 5);
    Ok(())
}

/// One call of the dropout step: `x` as its input, the generator's state as its static.
fn dropout_step(
    graft: &mut CandleGraft,
    step: StepId,
    rng: &DeviceRng,
    x: &Tensor,
) -> Fallible<(Vec<f32>, StepOutcome)> {
    let out = graft.call(step, &[x], &[rng.state()], &[], |inputs| {
        Ok(vec![rng.dropout(&inputs[0], 0.5)?])
    })?;
    let y = out.outputs.first().ok_or("the step returned no output")?;
    Ok((y.to_vec1::<f32>()?, out.outcome))
}

/// Twelve calls of a graphed dropout step (a warmup, a recording, ten replays) give twelve
/// different masks, exactly those of twelve eager calls of a fresh generator; after
/// `set_seed` between replays, the next replay draws what a fresh generator of that seed
/// draws first.
#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_dropout_draws_new_numbers_and_follows_set_seed() -> TestResult {
    let device = gpu();
    let x = Tensor::arange(1f32, 1025., &device)?;
    let rng = DeviceRng::new(&device, SEED)?;
    let mut graft = CandleGraft::new(&device)?;
    let step = graft.register("dropout");
    let mut outputs = Vec::new();
    let mut replays = 0;
    for i in 0..12 {
        let (y, outcome) = dropout_step(&mut graft, step, &rng, &x)?;
        println!("call {i}: {outcome:?}");
        replays += usize::from(matches!(outcome, StepOutcome::Replayed(_)));
        outputs.push(y);
    }
    assert!(
        replays >= 10,
        "{replays} replays of 12\n{}",
        diagnostics(&graft)
    );
    for (i, pair) in outputs.windows(2).enumerate() {
        assert_ne!(
            pair[0],
            pair[1],
            "calls {i} and {} drew the same mask",
            i + 1
        );
    }
    let eager = DeviceRng::new(&device, SEED)?;
    for (i, got) in outputs.iter().enumerate() {
        let want = eager.dropout(&x, 0.5)?.to_vec1::<f32>()?;
        assert_eq!(bits(got), bits(&want), "call {i} against eager call {i}");
    }
    // 1024 elements are 256 blocks per call.
    assert_eq!(rng.offset()?, 12 * 256);
    assert_eq!(eager.offset()?, rng.offset()?);

    for seed in [7, SEED] {
        rng.set_seed(seed)?;
        let fresh = DeviceRng::new(&device, seed)?;
        for call in 0..2 {
            let (y, outcome) = dropout_step(&mut graft, step, &rng, &x)?;
            assert!(
                matches!(outcome, StepOutcome::Replayed(_)),
                "seed {seed}, call {call}: {outcome:?}\n{}",
                diagnostics(&graft)
            );
            let want = fresh.dropout(&x, 0.5)?.to_vec1::<f32>()?;
            assert_eq!(
                bits(&y),
                bits(&want),
                "seed {seed}, call {call} after set_seed"
            );
        }
    }
    // The last seed was the first one: its first two draws again.
    assert_eq!(rng.offset()?, 2 * 256);
    let (y, _) = dropout_step(&mut graft, step, &rng, &x)?;
    assert_eq!(
        bits(&y),
        bits(&outputs[2]),
        "the third draw of the first seed"
    );
    Ok(())
}
