//! Guards on the CPU build: graft-candle runs eagerly there, so candle-nn's optimizers with a
//! schedule train exactly as without it and nothing is guarded; tests/gpu.rs runs the same
//! training graphed, where guards find the host values candle-nn bakes into its kernels.

#[path = "support/guards.rs"]
mod guards;

use candle_core::Device;
use graft_candle::CandleGraft;
use guards::{Fallible, adamw, guarded, sgd, train};

#[test]
fn candle_nn_optimizers_with_a_schedule_run_eagerly_on_the_cpu() -> Fallible<()> {
    let device = Device::Cpu;
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    assert!(!graft.is_graphed());
    let graphed = train(&device, Some(&mut graft), 200, adamw)?;
    let eager = train(&device, None, 200, adamw)?;
    assert_eq!(
        (graphed.losses, graphed.params),
        (eager.losses, eager.params)
    );
    let mut graft = CandleGraft::with_config(&device, guarded())?;
    let graphed = train(&device, Some(&mut graft), 200, sgd)?;
    let eager = train(&device, None, 200, sgd)?;
    assert_eq!(graphed.max_diff(&eager), 0.0);
    assert!(eager.losses[199] < eager.losses[0], "{:?}", eager.losses);
    Ok(())
}
