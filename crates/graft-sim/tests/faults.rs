//! Fault injection: each injection point fires exactly once, where it was aimed.

use graft_core::{CaptureMode, Device, DeviceError, DeviceOp};
use graft_sim::{CaptureStatus, SimDevice};

fn injected(op: DeviceOp) -> DeviceError {
    DeviceError::Injected { op }
}

#[test]
fn segment_alloc_fault_fires_once_at_the_chosen_allocation() {
    let dev = SimDevice::new();
    dev.fail_segment_alloc_after(2);
    dev.alloc_segment(64).unwrap();
    dev.alloc_segment(64).unwrap();
    assert_eq!(dev.alloc_segment(64), Err(injected(DeviceOp::SegmentAlloc)));
    for _ in 0..5 {
        dev.alloc_segment(64).unwrap();
    }
    assert_eq!(dev.stats().segment_allocs, 7);
    assert_eq!(dev.stats().live_segments, 7);

    dev.fail_segment_alloc_after(0);
    assert_eq!(dev.alloc_segment(64), Err(injected(DeviceOp::SegmentAlloc)));
    dev.alloc_segment(64).unwrap();
}

#[test]
fn segment_alloc_fault_ignores_raw_allocations_and_fires_during_capture() {
    let dev = SimDevice::new();
    dev.fail_segment_alloc_after(0);
    dev.raw_alloc(64).unwrap();
    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    assert_eq!(dev.alloc_segment(64), Err(injected(DeviceOp::SegmentAlloc)));
    // An allocation failure does not invalidate the capture.
    dev.alloc_segment(64).unwrap();
    dev.end_capture().unwrap();
}

#[test]
fn instantiate_fault_fires_once_and_ends_the_capture() {
    let dev = SimDevice::new();
    let seg = dev.alloc_segment(64).unwrap();
    dev.fill_f32(seg, 16, 1.0).unwrap();
    dev.fail_next_instantiate();

    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(seg, 16, 2.0).unwrap();
    assert_eq!(
        dev.end_capture().unwrap_err(),
        injected(DeviceOp::Instantiate)
    );
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);
    assert!(matches!(
        dev.abort_capture(),
        Err(DeviceError::CaptureState { .. })
    ));
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![1.0; 16]);
    assert_eq!(dev.stats().live_graphs, 0);

    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(seg, 16, 2.0).unwrap();
    let graph = dev.end_capture().unwrap();
    dev.launch(&graph).unwrap();
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![2.0; 16]);
}

#[test]
fn instantiate_fault_waits_for_a_capture_that_reaches_instantiation() {
    let dev = SimDevice::new();
    dev.fail_next_instantiate();
    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    dev.synchronize().unwrap_err();
    assert_eq!(
        dev.end_capture().unwrap_err(),
        DeviceError::Capture {
            op: DeviceOp::EndCapture,
            violation: graft_core::CaptureViolation::Invalidated
        }
    );
    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    assert_eq!(
        dev.end_capture().unwrap_err(),
        injected(DeviceOp::Instantiate)
    );
}

#[test]
fn launch_fault_fires_once_and_runs_nothing() {
    let dev = SimDevice::new();
    let seg = dev.alloc_segment(64).unwrap();
    dev.fill_f32(seg, 16, 1.0).unwrap();
    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    dev.axpb_f32(seg, seg, 2.0, 0.0, 16).unwrap();
    let graph = dev.end_capture().unwrap();

    dev.fail_next_launch();
    assert_eq!(dev.launch(&graph), Err(injected(DeviceOp::GraphLaunch)));
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![1.0; 16]);
    assert_eq!(dev.stats().graph_launches, 0);
    dev.launch(&graph).unwrap();
    dev.launch(&graph).unwrap();
    assert_eq!(dev.read_f32(seg, 16).unwrap(), vec![4.0; 16]);
    assert_eq!(dev.stats().graph_launches, 2);
}

#[test]
fn graph_destroy_fault_goes_to_the_sticky_slot_once() {
    let dev = SimDevice::new();
    let mk = || {
        dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
        dev.end_capture().unwrap()
    };
    let (g1, g2) = (mk(), mk());
    dev.fail_next_graph_destroy();
    assert_eq!(dev.take_sticky_error(), None);
    drop(g1);
    drop(g2);
    assert_eq!(
        dev.take_sticky_error(),
        Some(injected(DeviceOp::GraphDestroy))
    );
    assert_eq!(dev.take_sticky_error(), None);
    assert_eq!(dev.stats().live_graphs, 0);
}
