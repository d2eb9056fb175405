//! Guards on the GPU: candle-nn's AdamW and SGD with a learning-rate schedule, which pass
//! host values (bias corrections, the rate) to candle's `affine` kernel, train under
//! graft-candle as eagerly once guards found those values (named once, with the kernel);
//! graft-candle-train's optimizers, whose scalars live on the device, are never flagged; a
//! step-dependent `Tensor::affine` is found and every call is right.

use candle_core::Tensor;
use graft_candle::CandleGraft;
use graft_core::GraphDifference;

use super::guards::{adamw, guarded, sgd, train, train_at};
use super::training::{adamw_step, batches, config, model_and_adamw, schedule};
use super::{TestResult, diagnostics, gpu, steps};

/// Whether graft's findings name candle's `affine` kernel, each difference once.
fn names_affine(graft: &CandleGraft) -> bool {
    let Some(g) = graft.graft() else {
        return false;
    };
    let findings = g.guard_findings();
    let places: Vec<_> = findings
        .iter()
        .filter_map(|f| match &f.difference {
            GraphDifference::Argument { node, index, .. } => Some((*node, *index)),
            _ => None,
        })
        .collect();
    let mut unique = places.clone();
    unique.dedup();
    assert_eq!(places.len(), unique.len(), "reported once: {findings:?}");
    findings.iter().any(|f| {
        matches!(&f.difference, GraphDifference::Argument { kernel, .. } if kernel.contains("affine"))
    })
}

/// candle-nn's AdamW, 200 steps with a schedule: guards find its host values at the first
/// guard; from then on every step is guarded (captured, or eager where that is faster: its
/// bias corrections change on every step), none replays blind, and the run equals eager.
#[test]
#[ignore = "needs a CUDA GPU"]
fn candle_nn_adamw_with_a_schedule_is_guarded_and_equals_eager() -> TestResult {
    let device = gpu();
    let n = steps(200, 8);
    let eager = train(&device, None, n, adamw)?;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let graphed = train(&device, Some(&mut graft), n, adamw)?;
    assert!(graphed.max_diff(&eager) <= 1e-6, "{}", diagnostics(&graft));
    assert!(names_affine(&graft), "{}", diagnostics(&graft));
    Ok(())
}

/// candle-nn's SGD, whose rate from the schedule is `affine`'s multiplier.
#[test]
#[ignore = "needs a CUDA GPU"]
fn candle_nn_sgd_with_a_schedule_is_guarded_and_equals_eager() -> TestResult {
    let device = gpu();
    let n = steps(200, 8);
    let eager = train(&device, None, n, sgd)?;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let graphed = train(&device, Some(&mut graft), n, sgd)?;
    assert!(graphed.max_diff(&eager) <= 1e-6, "{}", diagnostics(&graft));
    assert!(names_affine(&graft), "{}", diagnostics(&graft));
    Ok(())
}

/// The rate of [`a_rate_that_changes_once_replays_again`]: 0.02, then 0.01 from step 50.
fn once(step: usize) -> f64 {
    if step < 50 { 0.02 } else { 0.01 }
}

/// candle-nn's SGD with a rate that changes once, at step 50 of 200, and then holds. The
/// training loop guards the step after the change (`guard_next_call`, closing the guards'
/// window), so no step is stale and the run equals eager; the capture that found the new rate
/// takes the recording's place, and plain replays resume a few steps later.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rate_that_changes_once_replays_again() -> TestResult {
    let device = gpu();
    let n = steps(200, 80);
    let eager = train_at(&device, None, n, sgd, once, false)?;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let graphed = train_at(&device, Some(&mut graft), n, sgd, once, true)?;
    assert!(graphed.max_diff(&eager) <= 1e-6, "{}", diagnostics(&graft));
    let replays = |r: &[bool]| r.iter().filter(|&&r| r).count();
    assert!(
        replays(&graphed.replayed[10..50]) >= 30,
        "{:?}",
        graphed.replayed
    );
    let after = &graphed.replayed[50..];
    assert!(!after[0], "the step after the change does not replay blind");
    let resumed = after.iter().position(|&r| r).expect("replays resume");
    assert!(resumed <= 16, "resumed {resumed} steps after the change");
    assert_eq!(
        replays(&after[resumed..]),
        after.len() - resumed,
        "{:?}",
        graphed.replayed
    );
    assert!(names_affine(&graft), "{}", diagnostics(&graft));
    Ok(())
}

/// graft-candle-train's AdamW with a schedule: its scalars are device tensors, so no guard
/// finds anything and the guarded calls replay.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graft_candle_trains_optimizers_are_never_flagged() -> TestResult {
    let device = gpu();
    let (model, mut opt) = model_and_adamw(&device)?;
    let data = batches(&config(), 2, 16, 2, &device)?;
    let mut fixed: Vec<Tensor> = opt.statics().into_iter().cloned().collect();
    fixed.extend(model.constants().into_iter().cloned());
    let fixed: Vec<&Tensor> = fixed.iter().collect();
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let id = graft.register("train");
    for step in 0..steps(40, 6) {
        opt.set_learning_rate(schedule(step))?;
        let (tokens, targets) = &data[step % data.len()];
        graft.call(id, &[tokens, targets], &fixed, &[], |x| {
            Ok(vec![adamw_step(&model, &mut opt, &x[0], &x[1])?])
        })?;
    }
    let g = graft.graft().ok_or("not graphed")?;
    assert!(
        g.guard_findings().is_empty(),
        "{:#?}\n{}",
        g.guard_findings().iter().take(3).collect::<Vec<_>>(),
        diagnostics(&graft)
    );
    assert!(g.stats().guards > 0);
    assert_eq!(g.stats().guard_differences, 0);
    assert_eq!(g.stats().recordings, 1, "{}", diagnostics(&graft));
    Ok(())
}

/// `Tensor::affine` with a step-dependent multiplier: found at the first guard, every call
/// right.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_step_dependent_affine_is_found_and_every_call_is_right() -> TestResult {
    let device = gpu();
    let x = Tensor::new(&[1f32, 2., 3., 4.], &device)?;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let id = graft.register("scale");
    for step in 0..20 {
        let out = graft.call(id, &[&x], &[], &[], |t| {
            Ok(vec![t[0].affine(step as f64, 1.0)?])
        })?;
        let want: Vec<f32> = [1f32, 2., 3., 4.]
            .iter()
            .map(|v| v * step as f32 + 1.0)
            .collect();
        assert_eq!(out.outputs[0].to_vec1::<f32>()?, want, "step {step}");
    }
    assert!(names_affine(&graft), "{}", diagnostics(&graft));
    Ok(())
}

/// A decode step that takes its position as a host `usize` (`narrow` at the position: the
/// kernel reads the cache at an address the host computed, a pointer into a static): found
/// at the first guard, and every step reads its own row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_host_position_in_a_decode_step_is_found_and_every_step_is_right() -> TestResult {
    let device = gpu();
    let cache = Tensor::arange(0f32, 64., &device)?.reshape((16, 4))?;
    let x = Tensor::ones(4, candle_core::DType::F32, &device)?;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let id = graft.register("decode");
    for pos in 0..16usize {
        let out = graft.call(id, &[&x], &[&cache], &[], |t| {
            Ok(vec![(cache.narrow(0, pos, 1)?.squeeze(0)? + &t[0])?])
        })?;
        let want: Vec<f32> = (0..4).map(|j| (pos * 4 + j) as f32 + 1.0).collect();
        assert_eq!(out.outputs[0].to_vec1::<f32>()?, want, "position {pos}");
    }
    let g = graft.graft().ok_or("not graphed")?;
    assert!(
        g.guard_findings()
            .iter()
            .any(|f| matches!(f.difference, GraphDifference::Argument { .. })),
        "{}",
        diagnostics(&graft)
    );
    Ok(())
}
