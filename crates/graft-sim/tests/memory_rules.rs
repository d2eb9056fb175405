//! Memory rules: fixed addresses, poison, mapping, bounds, use after free or unmap, overlapping copies, limits.

use graft_core::backend::CoreOnly;
use graft_core::{CaptureMode, Device, DeviceError, DeviceOp, DevicePtr};
use graft_sim::{ADDRESS_BASE, GRANULARITY, POISON_BYTE, SimDevice, SimMemory};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

/// A fresh reservation of `granules` granules, all mapped.
fn mapped(dev: &SimDevice, granules: usize) -> DevicePtr {
    let r = dev.reserve(CORE, granules * GRANULARITY).unwrap();
    dev.map(CORE, r, granules * GRANULARITY).unwrap();
    r
}

#[test]
fn memory_is_placed_deterministically() {
    let place = || {
        let dev = SimDevice::new();
        let a = dev.raw_alloc(1000).unwrap();
        let b = dev.reserve(CORE, 4 * GRANULARITY).unwrap();
        dev.raw_free(a).unwrap();
        let c = dev.raw_alloc(1000).unwrap();
        (a, b, c)
    };
    let (a, b, c) = place();
    assert_eq!(place(), (a, b, c), "same program, same addresses");
    assert_eq!(a, DevicePtr(ADDRESS_BASE));
    assert_eq!(b.0, ADDRESS_BASE + 2 * GRANULARITY as u64);
    // 4 granules, then a one-granule gap.
    assert_eq!(c.0, b.0 + 5 * GRANULARITY as u64);
}

#[test]
fn fresh_memory_is_poisoned() {
    let dev = SimDevice::new();
    for a in [dev.raw_alloc(4096).unwrap(), mapped(&dev, 1)] {
        let mut buf = vec![0u8; 4096];
        dev.read(CORE, a, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == POISON_BYTE));
    }
}

#[test]
fn unmap_needs_mapped_granules_of_a_reservation() {
    let dev = SimDevice::new();
    let a = mapped(&dev, 2);
    let g = GRANULARITY;
    for (ptr, bytes) in [
        (a, g - 512),
        (a, 3 * g),
        (a.offset(512), g),
        (DevicePtr(0), g),
        (a, 0),
    ] {
        assert!(
            matches!(
                dev.unmap(CORE, ptr, bytes),
                Err(DeviceError::InvalidArgument {
                    op: DeviceOp::Unmap,
                    ..
                })
            ),
            "{ptr}+{bytes}"
        );
    }
    assert_eq!(dev.stats().mapped_bytes, 2 * g);
    assert_eq!(dev.stats().reservations, 1);
    dev.unmap(CORE, a.offset(g), g).unwrap();
    assert_eq!(dev.stats().mapped_bytes, g);
    assert!(dev.unmap(CORE, a.offset(g), g).is_err(), "double unmap");
    dev.unmap(CORE, a, g).unwrap();
    dev.release_reservation(CORE, a, 2 * g).unwrap();
    assert_eq!((dev.stats().mapped_bytes, dev.stats().reservations), (0, 0));
}

#[test]
fn use_after_unmap_is_rejected() {
    let dev = SimDevice::new();
    let a = mapped(&dev, 1);
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, 16, 1.0))
        .unwrap();
    dev.unmap(CORE, a, GRANULARITY).unwrap();
    assert_eq!(
        dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, 16, 1.0)),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::KernelLaunch,
            addr: a,
            len: 64
        })
    );
    assert_eq!(
        dev.read(CORE, a, &mut [0u8; 4]),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::Read,
            addr: a,
            len: 4
        })
    );
    assert!(matches!(
        dev.write(CORE, a, &[0u8; 4]),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::Write,
            ..
        })
    ));
    let b = dev.raw_alloc(64).unwrap();
    dev.raw_free(b).unwrap();
    assert!(
        dev.launch_kernel("fill_f32", move |m| m.fill_f32(b, 16, 1.0))
            .is_err(),
        "use after raw free"
    );
}

#[test]
fn out_of_bounds_kernel_access_is_an_error() {
    let dev = SimDevice::new();
    let a = dev.raw_alloc(64).unwrap();
    // One element past the end.
    assert_eq!(
        dev.launch_kernel("add_f32", move |m| m.zip_f32(a, a, a, 17, |x, y| x + y)),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::KernelLaunch,
            addr: a,
            len: 68
        })
    );
    // Into the gap after the segment, with a hand-written kernel.
    let past = a.offset(GRANULARITY);
    let err = dev
        .launch_kernel("oob", move |m: &mut SimMemory| {
            m.bytes_mut(past, 1)?[0] = 1;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, DeviceError::InvalidAddress { addr, .. } if addr == past));
    // Absurd sizes are errors too, not panics or huge host allocations.
    assert!(
        dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, usize::MAX, 0.0))
            .is_err()
    );
    assert!(dev.read_f32(a, usize::MAX / 2).is_err());
    assert!(dev.copy(CORE, a, DevicePtr(u64::MAX - 4), 64).is_err());
}

#[test]
fn overlapping_copy_is_rejected_eagerly() {
    let dev = SimDevice::new();
    let a = dev.raw_alloc(64).unwrap();
    let expected = DeviceError::OverlappingCopy {
        op: DeviceOp::Copy,
        dst: a.offset(8),
        src: a,
        len: 16,
    };
    assert_eq!(dev.copy(CORE, a.offset(8), a, 16), Err(expected));
    assert!(
        dev.copy(CORE, a, a, 16).is_err(),
        "a copy onto itself overlaps"
    );
    // Adjacent ranges do not overlap.
    dev.copy(CORE, a.offset(16), a, 16).unwrap();
    assert_eq!(dev.stats().copies_run, 3);
}

#[test]
fn overlapping_copy_is_rejected_on_replay() {
    let dev = SimDevice::new();
    let a = dev.raw_alloc(64).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, 16, 1.0))
        .unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, 4, 2.0))
        .unwrap();
    dev.copy(CORE, a, a.offset(4), 16).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(
        dev.launch(CORE, &graph),
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
    let a = dev.raw_alloc(64).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, 16, 1.0))
        .unwrap();
    dev.launch_kernel("add_f32", move |m| m.zip_f32(a, a, a, 8, |x, y| x + y))
        .unwrap();
    assert!(matches!(
        dev.launch_kernel("axpb_f32", move |m| m
            .map_f32(a.offset(4), a, 8, |v| f32::mul_add(1.0, v, 0.0))),
        Err(DeviceError::OverlappingCopy { .. })
    ));
    assert_eq!(dev.read_f32(a, 9).unwrap()[7..], [2.0, 1.0]);
}

#[test]
fn memory_limit_gives_out_of_memory() {
    let g = GRANULARITY;
    let dev = SimDevice::with_memory_limit(2 * g);
    let r = dev.reserve(CORE, 8 * g).unwrap();
    dev.map(CORE, r, g).unwrap();
    assert_eq!(
        dev.map(CORE, r.offset(g), 2 * g),
        Err(DeviceError::OutOfMemory {
            op: DeviceOp::Map,
            bytes: 2 * g
        })
    );
    assert_eq!(
        dev.raw_alloc(usize::MAX),
        Err(DeviceError::OutOfMemory {
            op: DeviceOp::RawAlloc,
            bytes: usize::MAX
        })
    );
    assert!(
        dev.raw_alloc(g + 1).is_err(),
        "mapped bytes count against the limit"
    );
    dev.unmap(CORE, r, g).unwrap();
    dev.map(CORE, r.offset(g), 2 * g).unwrap();
}

#[test]
fn misaligned_typed_access_fails() {
    let dev = SimDevice::new();
    let a = dev.raw_alloc(64).unwrap();
    assert!(matches!(
        dev.launch_kernel("fill_f32", move |m| m.fill_f32(a.offset(1), 4, 0.0)),
        Err(DeviceError::Driver { code: 716, .. })
    ));
}

#[test]
fn axpb_is_fused() {
    let dev = SimDevice::new();
    let a = dev.raw_alloc(64).unwrap();
    // (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24: the rounded product loses the 2^-24 term, FMA keeps it.
    let x = 1.0 + 2f32.powi(-12);
    dev.write_f32(a, &[x]).unwrap();
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(a, a, 1, |v| f32::mul_add(x, v, -1.0))
    })
    .unwrap();
    assert_eq!(
        dev.read_f32(a, 1).unwrap(),
        [2f32.powi(-11) + 2f32.powi(-24)]
    );
    assert_ne!(x * x - 1.0, 2f32.powi(-11) + 2f32.powi(-24));
}
