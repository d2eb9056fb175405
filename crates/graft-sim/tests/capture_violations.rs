//! Everything CUDA forbids during a capture fails with the right operation and reason, and breaks the capture.

use graft_core::backend::CoreOnly;
use graft_core::{CaptureMode, CaptureViolation, Device, DeviceError, DeviceOp, DevicePtr};
use graft_sim::{CaptureStatus, GRANULARITY, SimDevice, SimMemory};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const N: usize = 16;

fn capture_err(op: DeviceOp, violation: CaptureViolation) -> DeviceError {
    DeviceError::Capture { op, violation }
}

/// Begins a capture with one kernel recorded (which writes 7.0 to `seg`), runs `forbidden`
/// inside it, and checks the error, the invalidation and the abort.
fn check_forbidden(
    op: DeviceOp,
    forbidden: impl Fn(&SimDevice, DevicePtr) -> Result<(), DeviceError>,
) {
    let dev = SimDevice::new();
    let seg = dev.raw_alloc(N * 4).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 1.0))
        .unwrap();
    let kernels = dev.stats().kernels_run;

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 7.0))
        .unwrap();
    assert_eq!(
        forbidden(&dev, seg),
        Err(capture_err(op, CaptureViolation::Unsupported)),
        "{op}"
    );
    assert_eq!(
        dev.capture_status().unwrap(),
        CaptureStatus::Invalidated {
            mode: CaptureMode::ThreadLocal
        }
    );
    // Further captured work fails as invalidated.
    assert_eq!(
        dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 8.0)),
        Err(capture_err(
            DeviceOp::KernelLaunch,
            CaptureViolation::Invalidated
        ))
    );
    assert_eq!(
        dev.copy(CORE, seg, seg.offset(N * 2), 8),
        Err(capture_err(DeviceOp::Copy, CaptureViolation::Invalidated))
    );
    assert_eq!(
        dev.synchronize(),
        Err(capture_err(
            DeviceOp::Synchronize,
            CaptureViolation::Invalidated
        ))
    );
    assert_eq!(
        dev.end_capture(CORE).unwrap_err(),
        capture_err(DeviceOp::EndCapture, CaptureViolation::Invalidated)
    );
    // end_capture left the stream idle; it works eagerly again and nothing recorded ran.
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![1.0; N]);
    assert_eq!(dev.stats().kernels_run, kernels);

    // Same again, but leaving through abort_capture.
    dev.begin_capture(CORE, CaptureMode::Global).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 7.0))
        .unwrap();
    assert!(forbidden(&dev, seg).is_err());
    assert!(
        dev.abort_capture(CORE).unwrap(),
        "abort_capture says the capture was invalidated"
    );
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![1.0; N]);
    // An intact capture aborted says so too.
    dev.begin_capture(CORE, CaptureMode::Global).unwrap();
    assert!(!dev.abort_capture(CORE).unwrap());
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 2.0))
        .unwrap();
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![2.0; N]);
    assert_eq!(dev.stats().live_graphs, 0);
}

#[test]
fn synchronize_is_forbidden() {
    check_forbidden(DeviceOp::Synchronize, |d, _| d.synchronize());
}

#[test]
fn read_is_forbidden() {
    check_forbidden(DeviceOp::Read, |d, p| d.read(CORE, p, &mut [0u8; 4]));
    check_forbidden(DeviceOp::Read, |d, p| d.read_f32(p, 1).map(drop));
}

#[test]
fn write_is_forbidden() {
    check_forbidden(DeviceOp::Write, |d, p| d.write(CORE, p, &[0u8; 4]));
    check_forbidden(DeviceOp::Write, |d, p| d.write_f32(p, &[0.0]));
}

#[test]
fn raw_alloc_and_free_are_forbidden() {
    check_forbidden(DeviceOp::RawAlloc, |d, _| d.raw_alloc(64).map(drop));
    let dev = SimDevice::new();
    let raw = dev.raw_alloc(64).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_eq!(
        dev.raw_free(raw),
        Err(capture_err(
            DeviceOp::RawAlloc,
            CaptureViolation::Unsupported
        ))
    );
    dev.abort_capture(CORE).unwrap();
    dev.raw_free(raw).unwrap();
    assert_eq!(dev.stats().live_raw_allocs, 0);
}

#[test]
fn query_is_forbidden() {
    check_forbidden(DeviceOp::Query, |d, _| d.query().map(drop));
}

#[test]
fn unmap_is_forbidden() {
    check_forbidden(DeviceOp::Unmap, |d, _| {
        let extra = d.reserve(CORE, GRANULARITY)?;
        d.map(CORE, extra, GRANULARITY)?;
        d.unmap(CORE, extra, GRANULARITY)
    });
}

#[test]
fn releasing_a_reservation_is_forbidden() {
    check_forbidden(DeviceOp::ReleaseReservation, |d, _| {
        let extra = d.reserve(CORE, GRANULARITY)?;
        d.release_reservation(CORE, extra, GRANULARITY)
    });
}

#[test]
fn forbidden_ops_work_outside_capture() {
    let dev = SimDevice::new();
    dev.synchronize().unwrap();
    assert!(dev.query().unwrap());
    let raw = dev.raw_alloc(64).unwrap();
    assert_eq!(dev.stats().live_raw_allocs, 1);
    assert_eq!(
        dev.stats().mapped_bytes,
        0,
        "raw allocations are not pool memory"
    );
    dev.write(CORE, raw, &[1, 2, 3]).unwrap();
    let mut back = [0u8; 4];
    dev.read(CORE, raw, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3, 0xA5]);
    // A raw allocation is not a reservation, and the other way round.
    assert!(matches!(
        dev.unmap(CORE, raw, GRANULARITY),
        Err(DeviceError::InvalidArgument { .. })
    ));
    let r = dev.reserve(CORE, GRANULARITY).unwrap();
    assert!(matches!(
        dev.raw_free(r),
        Err(DeviceError::InvalidAddress { .. })
    ));
    dev.raw_free(raw).unwrap();
    assert!(matches!(
        dev.raw_free(raw),
        Err(DeviceError::InvalidAddress { .. })
    ));
}

#[test]
fn unjoined_side_stream_fails_end_capture() {
    let dev = SimDevice::new();
    let seg = dev.raw_alloc(N * 4).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 1.0))
        .unwrap();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 5.0))
        .unwrap();
    dev.launch_kernel_on_side_stream("side", move |m: &mut SimMemory| m.fill_f32(seg, N, 6.0))
        .unwrap();
    // The fork itself is legal; work on the main stream can still be recorded.
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 5.0))
        .unwrap();
    assert_eq!(
        dev.end_capture(CORE).unwrap_err(),
        capture_err(DeviceOp::EndCapture, CaptureViolation::Unjoined)
    );
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![1.0; N]);

    // Outside a capture the side stream just runs.
    dev.launch_kernel_on_side_stream("side", move |m: &mut SimMemory| m.fill_f32(seg, N, 6.0))
        .unwrap();
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![6.0; N]);
}

#[test]
fn abort_discards_an_unjoined_capture() {
    let dev = SimDevice::new();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel_on_side_stream("side", |_| Ok(()))
        .unwrap();
    dev.abort_capture(CORE).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.end_capture(CORE).unwrap();
}

#[test]
fn abort_of_a_valid_capture_discards_recorded_work() {
    let dev = SimDevice::new();
    let seg = dev.raw_alloc(N * 4).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 1.0))
        .unwrap();
    dev.begin_capture(CORE, CaptureMode::Relaxed).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 3.0))
        .unwrap();
    dev.copy(CORE, seg.offset(32), seg, 32).unwrap();
    dev.abort_capture(CORE).unwrap();
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![1.0; N]);
    assert_eq!(dev.stats().copies_run, 0);
}

#[test]
fn capture_state_misuse() {
    let dev = SimDevice::new();
    assert!(matches!(
        dev.end_capture(CORE),
        Err(DeviceError::CaptureState {
            op: DeviceOp::EndCapture,
            ..
        })
    ));
    assert!(matches!(
        dev.abort_capture(CORE),
        Err(DeviceError::CaptureState {
            op: DeviceOp::EndCapture,
            ..
        })
    ));
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert!(matches!(
        dev.begin_capture(CORE, CaptureMode::ThreadLocal),
        Err(DeviceError::CaptureState {
            op: DeviceOp::BeginCapture,
            ..
        })
    ));
    // The failed begin left the first capture intact.
    dev.end_capture(CORE).unwrap();

    // Begin while an invalidated capture is underway also fails.
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.synchronize().unwrap_err();
    assert!(matches!(
        dev.begin_capture(CORE, CaptureMode::ThreadLocal),
        Err(DeviceError::CaptureState {
            op: DeviceOp::BeginCapture,
            ..
        })
    ));
    dev.abort_capture(CORE).unwrap();
    assert!(matches!(
        dev.abort_capture(CORE),
        Err(DeviceError::CaptureState { .. })
    ));
}

#[test]
fn kernel_calling_back_into_the_device_fails_instead_of_deadlocking() {
    let dev = SimDevice::new();
    let inner = dev.clone();
    let err = dev
        .launch_kernel("reentrant", move |_| inner.synchronize())
        .unwrap_err();
    assert_eq!(
        err,
        DeviceError::Driver {
            op: DeviceOp::Synchronize,
            code: 800,
            name: "CUDA_ERROR_NOT_PERMITTED"
        }
    );
    // The device is usable afterwards.
    dev.synchronize().unwrap();
}
