//! Fault injection: each injection point fires exactly once, where it was aimed.

use graft_core::backend::CoreOnly;
use graft_core::{CaptureMode, Device, DeviceError, DeviceOp};
use graft_sim::{CaptureStatus, GRANULARITY, SimDevice};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

fn injected(op: DeviceOp) -> DeviceError {
    DeviceError::Injected { op }
}

#[test]
fn map_fault_fires_once_at_the_chosen_map() {
    let dev = SimDevice::new();
    let g = GRANULARITY;
    let r = dev.reserve(CORE, 16 * g).unwrap();
    let at = |i: usize| r.offset(i * g);
    dev.fail_map_after(2);
    dev.map(CORE, at(0), g).unwrap();
    dev.map(CORE, at(1), g).unwrap();
    assert_eq!(dev.map(CORE, at(2), g), Err(injected(DeviceOp::Map)));
    assert!(
        dev.read(CORE, at(2), &mut [0u8; 4]).is_err(),
        "a failed map maps nothing"
    );
    for i in 2..7 {
        dev.map(CORE, at(i), g).unwrap();
    }
    assert_eq!(dev.stats().maps, 7);
    assert_eq!(dev.stats().mapped_bytes, 7 * g);

    dev.fail_map_after(0);
    assert_eq!(dev.map(CORE, at(7), g), Err(injected(DeviceOp::Map)));
    dev.map(CORE, at(7), g).unwrap();
}

#[test]
fn map_fault_ignores_raw_allocations_and_fires_during_capture() {
    let dev = SimDevice::new();
    let r = dev.reserve(CORE, 2 * GRANULARITY).unwrap();
    dev.fail_map_after(0);
    dev.raw_alloc(64).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_eq!(dev.map(CORE, r, GRANULARITY), Err(injected(DeviceOp::Map)));
    // A map failure does not invalidate the capture.
    dev.map(CORE, r, GRANULARITY).unwrap();
    dev.end_capture(CORE).unwrap();
}

#[test]
fn instantiate_fault_fires_once_and_ends_the_capture() {
    let dev = SimDevice::new();
    let seg = dev.raw_alloc(64).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, 16, 1.0))
        .unwrap();
    dev.fail_next_instantiate();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, 16, 2.0))
        .unwrap();
    assert_eq!(
        dev.end_capture(CORE).unwrap_err(),
        injected(DeviceOp::Instantiate)
    );
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);
    assert!(matches!(
        dev.abort_capture(CORE),
        Err(DeviceError::CaptureState { .. })
    ));
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![1.0; 16]);
    assert_eq!(dev.stats().live_graphs, 0);

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, 16, 2.0))
        .unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![2.0; 16]);
}

#[test]
fn instantiate_fault_waits_for_a_capture_that_reaches_instantiation() {
    let dev = SimDevice::new();
    dev.fail_next_instantiate();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.synchronize().unwrap_err();
    assert_eq!(
        dev.end_capture(CORE).unwrap_err(),
        DeviceError::Capture {
            op: DeviceOp::EndCapture,
            violation: graft_core::CaptureViolation::Invalidated
        }
    );
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_eq!(
        dev.end_capture(CORE).unwrap_err(),
        injected(DeviceOp::Instantiate)
    );
}

#[test]
fn launch_fault_fires_once_and_runs_nothing() {
    let dev = SimDevice::new();
    let seg = dev.raw_alloc(64).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, 16, 1.0))
        .unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(seg, seg, 16, |v| f32::mul_add(2.0, v, 0.0))
    })
    .unwrap();
    let graph = dev.end_capture(CORE).unwrap();

    dev.fail_next_launch();
    assert_eq!(
        dev.launch(CORE, &graph),
        Err(injected(DeviceOp::GraphLaunch))
    );
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![1.0; 16]);
    assert_eq!(dev.stats().graph_launches, 0);
    dev.launch(CORE, &graph).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![4.0; 16]);
    assert_eq!(dev.stats().graph_launches, 2);
}

#[test]
fn graph_destroy_fault_goes_to_the_sticky_slot_once() {
    let dev = SimDevice::new();
    let mk = || {
        dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
        dev.end_capture(CORE).unwrap()
    };
    let (g1, g2) = (mk(), mk());
    dev.fail_next_graph_destroy();
    assert_eq!(dev.take_sticky_error(CORE), None);
    drop(g1);
    drop(g2);
    assert_eq!(
        dev.take_sticky_error(CORE),
        Some(injected(DeviceOp::GraphDestroy))
    );
    assert_eq!(dev.take_sticky_error(CORE), None);
    assert_eq!(dev.stats().live_graphs, 0);
}
