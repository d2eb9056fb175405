//! graft-candle's device-side generator on the CPU: one stream per seed, draws that continue
//! it, reseeding, the range and mean of its uniforms, and dropout's mask, scale, gradient and
//! refusals (tests/gpu/random.rs checks the GPU against these numbers, graphed).

use candle_core::{DType, Device, Tensor, Var};
use graft_candle::random::DeviceRng;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn rng(seed: u64) -> DeviceRng {
    DeviceRng::new(&Device::Cpu, seed).expect("a generator on the CPU")
}

fn draw(rng: &DeviceRng, n: usize) -> Vec<f32> {
    rng.uniform(n)
        .and_then(|t| t.to_vec1::<f32>())
        .expect("a draw on the CPU")
}

#[test]
fn the_same_seed_gives_the_same_numbers_and_another_seed_others() -> TestResult {
    let (a, b) = (rng(7), rng(7));
    assert_eq!(draw(&a, 64), draw(&b, 64));
    assert_eq!(draw(&a, 64), draw(&b, 64));
    // The seed's high word is part of the key too.
    assert_ne!(draw(&rng(7), 64), draw(&rng(7 | 1 << 32), 64));
    assert_ne!(draw(&rng(7), 64), draw(&rng(8), 64));
    assert_eq!(rng(7 | 1 << 32).seed()?, 7 | 1 << 32);
    Ok(())
}

/// Draws of multiples of 4 continue one stream; any other size leaves the rest of its last
/// block unused, so the next draw starts at the next block.
#[test]
fn consecutive_draws_differ_and_continue_the_stream() -> TestResult {
    let (split, whole) = (rng(3), rng(3));
    let first = draw(&split, 8);
    let second = draw(&split, 8);
    assert_ne!(first, second);
    assert_eq!([first, second].concat(), draw(&whole, 16));
    assert_eq!(split.offset()?, 4);

    let (odd, whole) = (rng(3), rng(3));
    let first = draw(&odd, 5);
    assert_eq!(odd.offset()?, 2);
    let second = draw(&odd, 3);
    let all = draw(&whole, 12);
    assert_eq!(first, all[..5]);
    assert_eq!(second, all[8..11]);
    assert_eq!(odd.offset()?, 3);
    // An empty draw changes nothing.
    assert_eq!(odd.uniform((2, 0))?.dims(), [2, 0]);
    assert_eq!(odd.offset()?, 3);
    Ok(())
}

#[test]
fn set_seed_restarts_the_stream() -> TestResult {
    let g = rng(11);
    let first = draw(&g, 32);
    draw(&g, 32);
    g.set_seed(11)?;
    assert_eq!(g.offset()?, 0);
    assert_eq!(draw(&g, 32), first);
    g.set_seed(12)?;
    assert_eq!(g.seed()?, 12);
    assert_eq!(draw(&g, 32), draw(&rng(12), 32));
    Ok(())
}

#[test]
fn uniforms_are_in_the_unit_interval_with_mean_one_half() -> TestResult {
    let values = rng(5)
        .uniform((100, 1000))?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64;
    // The mean of 1e5 uniforms has a standard deviation of 0.0009.
    assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    Ok(())
}

/// The mask of a dropout at `p` by a fresh generator seeded `seed`: `1 / (1 - p)` where the
/// uniform drawn for an element is at least `p`, 0 elsewhere.
fn expected_mask(seed: u64, n: usize, p: f32) -> Vec<f32> {
    let scale = (1.0 / (1.0 - f64::from(p))) as f32;
    draw(&rng(seed), n)
        .into_iter()
        .map(|u| if u >= p { scale } else { 0.0 })
        .collect()
}

#[test]
fn dropout_keeps_about_one_minus_p_and_scales_what_it_keeps() -> TestResult {
    let n = 100_000;
    let x = Tensor::arange(1u32, n as u32 + 1, &Device::Cpu)?.to_dtype(DType::F32)?;
    for p in [0.1f32, 0.5, 0.8] {
        let out = rng(21).dropout(&x, p)?.to_vec1::<f32>()?;
        let kept = out.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
        assert!(
            (kept - f64::from(1.0 - p)).abs() < 0.01,
            "p {p}: kept {kept}"
        );
        let scale = (1.0 / (1.0 - f64::from(p))) as f32;
        let mask = expected_mask(21, n, p);
        for (i, (&got, &m)) in out.iter().zip(&mask).enumerate() {
            let want = (i + 1) as f32 * m;
            assert!(
                (got - want).abs() <= want.abs() * 1e-6,
                "p {p}, element {i}: {got}, want {want} (scale {scale})"
            );
        }
    }
    // In x's dtype; p = 0 keeps everything (and still draws).
    let ones = Tensor::ones(16, DType::F64, &Device::Cpu)?;
    let g = rng(1);
    let out = g.dropout(&ones, 0.0)?;
    assert_eq!(out.dtype(), DType::F64);
    assert_eq!(out.to_vec1::<f64>()?, vec![1.0; 16]);
    assert_eq!(g.offset()?, 4);
    Ok(())
}

#[test]
fn the_gradient_through_dropout_is_the_scaled_mask() -> TestResult {
    let n = 1000;
    let p = 0.3;
    let x = Var::from_tensor(&Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(0.01, -3.0)?)?;
    let y = rng(9).dropout(x.as_tensor(), p)?;
    let grads = (y.sqr()?.sum_all()? * 0.5)?.backward()?;
    let grad = grads.get(&x).ok_or("no gradient for x")?.to_vec1::<f32>()?;
    // d/dx of (x m)^2 / 2 is x m^2: divide x out where it is not zero.
    let xs = x.as_tensor().to_vec1::<f32>()?;
    let y = y.to_vec1::<f32>()?;
    for (i, (m, (&g, (&x, &y)))) in expected_mask(9, n, p)
        .into_iter()
        .zip(grad.iter().zip(xs.iter().zip(&y)))
        .enumerate()
    {
        let want = x * m * m;
        assert!(
            (g - want).abs() <= 1e-5 * want.abs().max(1.0),
            "element {i}: {g}, want {want}"
        );
        assert!(
            (y - x * m).abs() <= 1e-6 * (x * m).abs().max(1.0),
            "element {i}"
        );
    }
    // And the plain gradient of the sum is the mask itself.
    let y = rng(9).dropout(x.as_tensor(), p)?;
    let grad = y.sum_all()?.backward()?;
    let grad = grad.get(&x).ok_or("no gradient for x")?.to_vec1::<f32>()?;
    assert_eq!(grad, expected_mask(9, n, p));
    Ok(())
}

#[test]
fn dropout_refuses_probabilities_outside_zero_to_one() -> TestResult {
    let g = rng(1);
    let x = Tensor::ones(8, DType::F32, &Device::Cpu)?;
    for p in [1.0f32, 1.5, -0.1, f32::NAN] {
        let error = g.dropout(&x, p).expect_err("refused").to_string();
        assert!(error.contains("outside [0, 1)"), "p {p}: {error}");
    }
    // Refused before drawing.
    assert_eq!(g.offset()?, 0);
    Ok(())
}
