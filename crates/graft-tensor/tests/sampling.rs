//! The sampling op against its host reference (Philox4x32-10 draws, the temperature and top-k
//! rule), its distribution, and the token loop's bookkeeping ops, on the simulator and
//! (ignored without a GPU) on CUDA with the same test bodies.

mod common;

use common::{f32s, graft, i32s, values};
use graft_tensor::philox::{draw, rng_parts, rng_words};
use graft_tensor::sampling::sample_row;
use graft_tensor::{Backend, DType, PAD, Sampling, Tensor, TensorError, ops};

/// The generator state of seed `seed` at offset `offset`, on the device.
fn rng<D: Backend>(g: &mut graft_core::Graft<D, graft_tensor::Meta>, seed: u64) -> Tensor {
    Tensor::from_u32(g, &[4], &rng_words(seed, 0)).unwrap()
}

/// The picks the reference makes for `u` nudged both ways: a backend that sums the weights
/// in another order may pick either side of a boundary this close to the draw.
fn acceptable(row: &[f32], s: Sampling, u: f32) -> Vec<i32> {
    let mut picks: Vec<i32> = [u, u * (1.0 - 1e-5), (u * (1.0 + 1e-5)).min(0.999_999_9)]
        .iter()
        .map(|&u| sample_row(row, s, u))
        .collect();
    picks.dedup();
    picks
}

fn sample_step_matches_the_host_reference<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let (rows, cols) = (5, 9000);
    let mut x_h: Vec<f32> = values(rows * cols, 11).iter().map(|v| v * 4.0).collect();
    x_h[2 * cols + 17] = f32::NAN;
    x_h[3 * cols..4 * cols].fill(0.5);
    let bias_h: Vec<f32> = values(cols, 12).iter().map(|v| v * 0.5).collect();
    let x = f32s(&mut g, &[rows, cols], &x_h);
    let bias = f32s(&mut g, &[cols], &bias_h);
    let logits: Vec<Vec<f32>> = x_h
        .chunks(cols)
        .map(|r| r.iter().zip(&bias_h).map(|(a, b)| a + b).collect())
        .collect();
    let seed = 0x5eed_0000_0000_0042;
    for s in [
        Sampling::new(1.0, 0).unwrap(),
        Sampling::new(0.7, 40).unwrap(),
        Sampling::new(2.0, 1).unwrap(),
        Sampling::new(1.3, 8999).unwrap(),
        Sampling::new(0.5, 20_000).unwrap(),
        Sampling::GREEDY,
    ] {
        let state = rng(&mut g, seed);
        let pos = i32s(&mut g, &[1], &[0]);
        for step in 0..3u64 {
            let out =
                ops::sample_step(&kernels, &mut g, &x, Some(&bias), &pos, &state, 2, s).unwrap();
            let got = out.to_vec_i32(g.device()).unwrap();
            for (r, (row, &pick)) in logits.iter().zip(&got).enumerate() {
                let ok = acceptable(row, s, draw(seed, step, r as u32));
                assert!(
                    ok.contains(&pick),
                    "{s:?} step {step} row {r}: {pick} not in {ok:?}"
                );
            }
            let words = state.to_vec_u32(g.device()).unwrap();
            assert_eq!(rng_parts(words.try_into().unwrap()), (seed, step + 1));
            let want_pos = (step as i32 + 1).min(2);
            assert_eq!(pos.to_vec_i32(g.device()).unwrap(), vec![want_pos]);
        }
    }
}
backend_test!(sample_step_matches_the_host_reference);

/// The picks follow the distribution: over many rows (independent draws), each token's share
/// is near its probability, and top-k and the temperature change it as they should.
fn sampling_follows_the_distribution<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let rows = 4000;
    // Probabilities 1/5, 3/5, 1/5 at temperature 1 (a NaN column never wins).
    let row = [0.0, 3f32.ln(), 0.0, f32::NAN];
    let x = f32s(&mut g, &[rows, 4], &row.repeat(rows));
    let pos = i32s(&mut g, &[1], &[0]);
    let share = |picks: &[i32], token: i32| {
        picks.iter().filter(|&&p| p == token).count() as f64 / picks.len() as f64
    };
    let run = |g: &mut graft_core::Graft<D, graft_tensor::Meta>, s: Sampling| {
        let state = rng(g, 99);
        let out = ops::sample_step(&kernels, g, &x, None, &pos, &state, 1000, s).unwrap();
        out.to_vec_i32(g.device()).unwrap()
    };
    let picks = run(&mut g, Sampling::new(1.0, 0).unwrap());
    assert!(!picks.contains(&3), "NaN never picked");
    assert!(
        (share(&picks, 1) - 0.6).abs() < 0.03,
        "{}",
        share(&picks, 1)
    );
    assert!(
        (share(&picks, 0) - 0.2).abs() < 0.03,
        "{}",
        share(&picks, 0)
    );
    // Temperature 2: weights 1, sqrt(3), 1.
    let picks = run(&mut g, Sampling::new(2.0, 0).unwrap());
    let p = 3f64.sqrt() / (2.0 + 3f64.sqrt());
    assert!((share(&picks, 1) - p).abs() < 0.03, "{}", share(&picks, 1));
    // Top 1: only the maximum; top 2 keeps both ties at the second largest.
    assert!(
        run(&mut g, Sampling::new(1.0, 1).unwrap())
            .iter()
            .all(|&p| p == 1)
    );
    let picks = run(&mut g, Sampling::new(1.0, 2).unwrap());
    assert!(
        (share(&picks, 2) - 0.2).abs() < 0.03,
        "{}",
        share(&picks, 2)
    );
}
backend_test!(sampling_follows_the_distribution);

/// Greedy sampling picks what argmax_step picks, and still advances the generator.
fn greedy_sampling_is_the_argmax<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let (rows, cols) = (3, 2500);
    let x = f32s(&mut g, &[rows, cols], &values(rows * cols, 31));
    let pos = i32s(&mut g, &[1], &[0]);
    let state = rng(&mut g, 5);
    let top = ops::argmax_step(&kernels, &mut g, &x, None, &pos, 9).unwrap();
    let s = Sampling::GREEDY;
    let picked = ops::sample_step(&kernels, &mut g, &x, None, &pos, &state, 9, s).unwrap();
    let dev = g.device();
    assert_eq!(
        picked.to_vec_i32(dev).unwrap(),
        top.to_vec_i32(dev).unwrap()
    );
    assert_eq!(pos.to_vec_i32(dev).unwrap(), vec![2]);
    assert_eq!(state.to_vec_u32(dev).unwrap(), rng_words(5, 1).to_vec());

    let hot = Sampling {
        temperature: -1.0,
        top_k: 0,
    };
    assert!(matches!(
        ops::sample_step(&kernels, &mut g, &x, None, &pos, &state, 9, hot),
        Err(TensorError::Temperature { .. })
    ));
    let wrong = i32s(&mut g, &[4], &[0; 4]);
    assert!(matches!(
        ops::sample_step(&kernels, &mut g, &x, None, &pos, &wrong, 9, s),
        Err(TensorError::DType { operand: "rng", .. })
    ));
}
backend_test!(greedy_sampling_is_the_argmax);

/// The loop's bookkeeping on its own: tokens stored while a row has some left, PAD after,
/// the end token stops a row, and the flag clears when every row has stopped, after the last
/// iteration, or when the position reaches the context.
fn token_loop_bookkeeping<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let first = i32s(&mut g, &[3], &[4, 5, 6]);
    let limits = i32s(&mut g, &[3], &[2, 0, 5]);
    let pos = i32s(&mut g, &[1], &[0]);
    let flag = |g: &graft_core::Graft<D, graft_tensor::Meta>, lp: &ops::TokenLoop| {
        let ctl = Tensor::from_buffer(lp.flag().clone(), &[2], DType::U32).unwrap();
        ctl.to_vec_u32(g.device()).unwrap()
    };
    let lp = ops::loop_begin(&kernels, &mut g, &first, &limits, &pos, 4, 10, Some(7)).unwrap();
    assert_eq!(flag(&g, &lp), vec![1, 0]);
    assert_eq!(lp.current().to_vec_i32(g.device()).unwrap(), vec![4, 5, 6]);
    for (next, want_flag) in [
        ([7, 1, 2], 1),
        ([3, 3, 3], 1),
        ([8, 8, 8], 1),
        ([9, 9, 9], 0),
    ] {
        let n = i32s(&mut g, &[3], &next);
        ops::loop_record(&kernels, &lp, &n).unwrap();
        assert_eq!(flag(&g, &lp)[0], want_flag, "after {next:?}");
        assert_eq!(lp.current().to_vec_i32(g.device()).unwrap(), next.to_vec());
    }
    assert_eq!(
        lp.tokens().to_vec_i32(g.device()).unwrap(),
        vec![7, PAD, 2, PAD, PAD, 3, PAD, PAD, 8, PAD, PAD, 9],
        "row 0 stopped at its end token, row 1 never ran, row 2 ran out of iterations"
    );
    // Every row stopped: no first iteration; a full context stops the loop too.
    let none = i32s(&mut g, &[3], &[0, 0, 0]);
    let lp = ops::loop_begin(&kernels, &mut g, &first, &none, &pos, 4, 10, None).unwrap();
    assert_eq!(flag(&g, &lp), vec![0, 0]);
    assert_eq!(lp.tokens().to_vec_i32(g.device()).unwrap(), vec![PAD; 12]);
    let lp = ops::loop_begin(&kernels, &mut g, &first, &limits, &pos, 4, 10, None).unwrap();
    pos.write_i32(g.device(), &[10]).unwrap();
    let n = i32s(&mut g, &[3], &[1, 1, 1]);
    ops::loop_record(&kernels, &lp, &n).unwrap();
    assert_eq!(flag(&g, &lp), vec![0, 1], "the context is full");
    let lp = ops::loop_begin(&kernels, &mut g, &first, &limits, &pos, 4, 10, None).unwrap();
    assert_eq!(flag(&g, &lp)[0], 0, "no room to start");
    assert!(matches!(
        ops::loop_begin(&kernels, &mut g, &first, &limits, &pos, 0, 10, None),
        Err(TensorError::LoopLength { max_tokens: 0, .. })
    ));
}
backend_test!(token_loop_bookkeeping);
