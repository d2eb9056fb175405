//! Memory rules: fixed addresses, poison, bounds, use after free, overlapping copies, limits.

use graft_core::{CaptureMode, Device, DeviceError, DeviceOp, DevicePtr};
use graft_sim::{ADDRESS_BASE, POISON_BYTE, SEGMENT_ALIGN, SimDevice, SimMemory};

#[test]
fn segments_are_placed_deterministically() {
    let place = || {
        let dev = SimDevice::new();
        let a = dev.alloc_segment(1000).unwrap();
        let b = dev.alloc_segment(3 << 20).unwrap();
        dev.free_segment(a, 1000).unwrap();
        let c = dev.alloc_segment(1000).unwrap();
        (a, b, c)
    };
    let (a, b, c) = place();
    assert_eq!(place(), (a, b, c), "same program, same addresses");
    assert_eq!(a, DevicePtr(ADDRESS_BASE));
    assert_eq!(b.0, ADDRESS_BASE + 2 * SEGMENT_ALIGN);
    // 3 MiB rounds to 4 MiB, then a 2 MiB gap.
    assert_eq!(c.0, b.0 + 3 * SEGMENT_ALIGN);
}

#[test]
fn fresh_segments_are_poisoned() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(4096).unwrap();
    let mut buf = vec![0u8; 4096];
    dev.read(a, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == POISON_BYTE));
}

#[test]
fn free_needs_an_exact_live_segment() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(4096).unwrap();
    for (ptr, bytes) in [
        (a, 4095),
        (a, 4097),
        (a.offset(512), 3584),
        (DevicePtr(0), 0),
    ] {
        assert_eq!(
            dev.free_segment(ptr, bytes),
            Err(DeviceError::InvalidAddress {
                op: DeviceOp::SegmentFree,
                addr: ptr,
                len: bytes
            })
        );
    }
    assert_eq!(dev.stats().live_segments, 1);
    assert_eq!(dev.stats().live_bytes, 4096);
    dev.free_segment(a, 4096).unwrap();
    assert_eq!(dev.stats().live_bytes, 0);
    assert!(dev.free_segment(a, 4096).is_err(), "double free");
}

#[test]
fn use_after_free_is_rejected() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    dev.fill_f32(a, 16, 1.0).unwrap();
    dev.free_segment(a, 64).unwrap();
    assert_eq!(
        dev.fill_f32(a, 16, 1.0),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::KernelLaunch,
            addr: a,
            len: 64
        })
    );
    assert_eq!(
        dev.read(a, &mut [0u8; 4]),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::Read,
            addr: a,
            len: 4
        })
    );
    assert!(matches!(
        dev.write(a, &[0u8; 4]),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::Write,
            ..
        })
    ));
}

#[test]
fn out_of_bounds_kernel_access_is_an_error() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    // One element past the end.
    assert_eq!(
        dev.add_f32(a, a, a, 17),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::KernelLaunch,
            addr: a,
            len: 68
        })
    );
    // Into the gap after the segment, with a hand-written kernel.
    let past = a.offset(SEGMENT_ALIGN as usize);
    let err = dev
        .launch_kernel("oob", move |m: &mut SimMemory| {
            m.bytes_mut(past, 1)?[0] = 1;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, DeviceError::InvalidAddress { addr, .. } if addr == past));
    // Absurd sizes are errors too, not panics or huge host allocations.
    assert!(dev.fill_f32(a, usize::MAX, 0.0).is_err());
    assert!(dev.read_f32(a, usize::MAX / 2).is_err());
    assert!(dev.copy(a, DevicePtr(u64::MAX - 4), 64).is_err());
}

#[test]
fn overlapping_copy_is_rejected_eagerly() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    let expected = DeviceError::OverlappingCopy {
        op: DeviceOp::Copy,
        dst: a.offset(8),
        src: a,
        len: 16,
    };
    assert_eq!(dev.copy(a.offset(8), a, 16), Err(expected));
    assert!(dev.copy(a, a, 16).is_err(), "a copy onto itself overlaps");
    // Adjacent ranges do not overlap.
    dev.copy(a.offset(16), a, 16).unwrap();
    assert_eq!(dev.stats().copies_run, 3);
}

#[test]
fn overlapping_copy_is_rejected_on_replay() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    dev.fill_f32(a, 16, 1.0).unwrap();
    dev.begin_capture(CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(a, 4, 2.0).unwrap();
    dev.copy(a, a.offset(4), 16).unwrap();
    let graph = dev.end_capture().unwrap();
    assert_eq!(
        dev.launch(&graph),
        Err(DeviceError::OverlappingCopy {
            op: DeviceOp::Copy,
            dst: a,
            src: a.offset(4),
            len: 16
        })
    );
    // Ops before the failing one ran (as on a GPU); the copy did not.
    assert_eq!(dev.read_f32(a, 5).unwrap(), [2.0, 2.0, 2.0, 2.0, 1.0]);
}

#[test]
fn elementwise_partial_overlap_is_rejected_in_place_is_fine() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    dev.fill_f32(a, 16, 1.0).unwrap();
    dev.add_f32(a, a, a, 8).unwrap();
    assert!(matches!(
        dev.axpb_f32(a.offset(4), a, 1.0, 0.0, 8),
        Err(DeviceError::OverlappingCopy { .. })
    ));
    assert_eq!(dev.read_f32(a, 9).unwrap()[7..], [2.0, 1.0]);
}

#[test]
fn memory_limit_gives_out_of_memory() {
    let dev = SimDevice::with_memory_limit(1 << 20);
    let a = dev.alloc_segment(1 << 19).unwrap();
    assert_eq!(
        dev.alloc_segment((1 << 19) + 1),
        Err(DeviceError::OutOfMemory {
            op: DeviceOp::SegmentAlloc,
            bytes: (1 << 19) + 1
        })
    );
    assert_eq!(
        dev.raw_alloc(usize::MAX),
        Err(DeviceError::OutOfMemory {
            op: DeviceOp::RawAlloc,
            bytes: usize::MAX
        })
    );
    dev.free_segment(a, 1 << 19).unwrap();
    dev.alloc_segment(1 << 20).unwrap();
}

#[test]
fn misaligned_typed_access_fails() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    assert!(matches!(
        dev.fill_f32(a.offset(1), 4, 0.0),
        Err(DeviceError::Driver { code: 716, .. })
    ));
}

#[test]
fn axpb_is_fused() {
    let dev = SimDevice::new();
    let a = dev.alloc_segment(64).unwrap();
    // (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24: the rounded product loses the 2^-24 term, FMA keeps it.
    let x = 1.0 + 2f32.powi(-12);
    dev.write_f32(a, &[x]).unwrap();
    dev.axpb_f32(a, a, x, -1.0, 1).unwrap();
    assert_eq!(
        dev.read_f32(a, 1).unwrap(),
        [2f32.powi(-11) + 2f32.powi(-24)]
    );
    assert_ne!(x * x - 1.0, 2f32.powi(-11) + 2f32.powi(-24));
}
