//! Unit tests of the simulated memory: placement, poisoning, mapping, limits, bounds,
//! alignment and aliasing.

use super::*;

const K: DeviceOp = DeviceOp::KernelLaunch;

/// A reservation of `bytes` (rounded up to granules) with all of it mapped.
fn mapped(m: &mut SimMemory, bytes: usize) -> DevicePtr {
    let size = bytes.max(1).next_multiple_of(GRANULARITY);
    let p = m.reserve(DeviceOp::Reserve, size).unwrap();
    m.map(DeviceOp::Map, p, size).unwrap();
    p
}

#[test]
fn placement_is_aligned_gapped_and_monotonic() {
    let mut m = SimMemory::new(1 << 30);
    let a = m.alloc_raw(DeviceOp::RawAlloc, 100).unwrap();
    let b = m.reserve(DeviceOp::Reserve, GRANULARITY).unwrap();
    let c = m.alloc_raw(DeviceOp::RawAlloc, 0).unwrap();
    let d = m.alloc_raw(DeviceOp::RawAlloc, 1).unwrap();
    assert_eq!(a, DevicePtr(ADDRESS_BASE));
    // 100 bytes round up to one 2 MiB unit, then a 2 MiB gap.
    assert_eq!(b.0, ADDRESS_BASE + 2 * GRAN);
    // exactly 2 MiB: ends on a boundary, then the gap.
    assert_eq!(c.0, b.0 + 2 * GRAN);
    // zero bytes still leave a gap.
    assert_eq!(d.0, c.0 + GRAN);
    for p in [a, b, c, d] {
        assert_eq!(p.0 % GRAN, 0);
    }
    m.free_raw(DeviceOp::RawAlloc, a).unwrap();
    m.release_reservation(DeviceOp::ReleaseReservation, b, GRANULARITY)
        .unwrap();
    let e = m.alloc_raw(DeviceOp::RawAlloc, 8).unwrap();
    assert!(e.0 > d.0, "addresses are never reused");
}

#[test]
fn fresh_memory_is_poisoned() {
    let mut m = SimMemory::new(4 << 20);
    let a = m.alloc_raw(DeviceOp::RawAlloc, 16).unwrap();
    assert!(m.bytes(a, 16).unwrap().iter().all(|&b| b == POISON_BYTE));
    let r = mapped(&mut m, 16);
    assert!(m.bytes(r, 16).unwrap().iter().all(|&b| b == POISON_BYTE));
}

#[test]
fn a_huge_reservation_costs_no_host_memory_and_accesses_need_mapping() {
    let mut m = SimMemory::new(16 << 20);
    let r = m.reserve(DeviceOp::Reserve, 256 << 30).unwrap();
    let far = r.offset(4 * GRANULARITY);
    assert_eq!(m.bytes(far, 4), Err(invalid(K, far, 4)));
    m.map(DeviceOp::Map, far, GRANULARITY).unwrap();
    m.bytes_mut(far, 4).unwrap().copy_from_slice(&[1, 2, 3, 4]);
    assert_eq!(m.regions[0].data.len(), 5 * GRANULARITY);
    assert_eq!(m.bytes(r, 4), Err(invalid(K, r, 4)), "below the mapping");
    let edge = far.offset(GRANULARITY - 2);
    assert_eq!(
        m.bytes(edge, 4),
        Err(invalid(K, edge, 4)),
        "past the mapping"
    );
    m.unmap(DeviceOp::Unmap, far, GRANULARITY).unwrap();
    assert_eq!(m.bytes(far, 4), Err(invalid(K, far, 4)));
    assert!(m.regions[0].data.is_empty());
    m.map(DeviceOp::Map, far, GRANULARITY).unwrap();
    assert_eq!(
        m.bytes(far, 4).unwrap(),
        &[POISON_BYTE; 4],
        "remapped memory is fresh"
    );
}

#[test]
fn misuse_is_an_invalid_argument() {
    let mut m = SimMemory::new(1 << 30);
    let r = m.reserve(DeviceOp::Reserve, 4 * GRANULARITY).unwrap();
    let is_bad = |e: Result<(), DeviceError>| matches!(e, Err(DeviceError::InvalidArgument { .. }));
    assert!(matches!(
        m.reserve(DeviceOp::Reserve, 100),
        Err(DeviceError::InvalidArgument { .. })
    ));
    assert!(is_bad(m.map(DeviceOp::Map, r.offset(512), GRANULARITY)));
    assert!(is_bad(m.map(DeviceOp::Map, r, 0)));
    assert!(
        is_bad(m.map(DeviceOp::Map, r, 5 * GRANULARITY)),
        "past the end"
    );
    m.map(DeviceOp::Map, r, GRANULARITY).unwrap();
    assert!(
        is_bad(m.map(DeviceOp::Map, r, 2 * GRANULARITY)),
        "mapped twice"
    );
    assert!(
        is_bad(m.unmap(DeviceOp::Unmap, r, 2 * GRANULARITY)),
        "not all mapped"
    );
    assert!(is_bad(m.release_reservation(
        DeviceOp::ReleaseReservation,
        r,
        4 * GRANULARITY
    )));
    m.unmap(DeviceOp::Unmap, r, GRANULARITY).unwrap();
    assert!(is_bad(m.release_reservation(
        DeviceOp::ReleaseReservation,
        r,
        GRANULARITY
    )));
    m.release_reservation(DeviceOp::ReleaseReservation, r, 4 * GRANULARITY)
        .unwrap();
}

#[test]
fn the_limit_counts_mapped_and_raw_bytes() {
    let mut m = SimMemory::new(3 * GRANULARITY);
    let r = m.reserve(DeviceOp::Reserve, 8 * GRANULARITY).unwrap();
    m.map(DeviceOp::Map, r, 2 * GRANULARITY).unwrap();
    m.alloc_raw(DeviceOp::RawAlloc, GRANULARITY).unwrap();
    assert_eq!(
        m.map(DeviceOp::Map, r.offset(2 * GRANULARITY), GRANULARITY),
        Err(DeviceError::OutOfMemory {
            op: DeviceOp::Map,
            bytes: GRANULARITY
        })
    );
    m.unmap(DeviceOp::Unmap, r, GRANULARITY).unwrap();
    m.map(DeviceOp::Map, r.offset(2 * GRANULARITY), GRANULARITY)
        .unwrap();
}

#[test]
fn accesses_must_stay_inside_one_allocation() {
    let mut m = SimMemory::new(1 << 30);
    let a = m.alloc_raw(DeviceOp::RawAlloc, 64).unwrap();
    assert!(m.bytes(a, 64).is_ok());
    assert_eq!(
        m.bytes(a, 65),
        Err(invalid(K, a, 65)),
        "one byte past the end"
    );
    assert_eq!(m.bytes(a.offset(64), 1), Err(invalid(K, a.offset(64), 1)));
    assert_eq!(
        m.bytes(DevicePtr(ADDRESS_BASE - 4), 4),
        Err(invalid(K, DevicePtr(ADDRESS_BASE - 4), 4)),
        "below the first allocation"
    );
    assert_eq!(
        m.bytes(DevicePtr(u64::MAX - 1), 8),
        Err(invalid(K, DevicePtr(u64::MAX - 1), 8)),
        "address overflow"
    );
    assert!(m.bytes(DevicePtr(3), 0).unwrap().is_empty());
    assert_eq!(
        m.f32s(a, usize::MAX),
        Err(invalid(K, a, usize::MAX)),
        "length overflow"
    );
}

#[test]
fn typed_access_round_trips_and_checks_alignment() {
    let mut m = SimMemory::new(1 << 30);
    let a = mapped(&mut m, 64);
    m.write_i32(a, &[-1, 2]).unwrap();
    assert_eq!(m.bytes(a, 4).unwrap(), &[0xff; 4]);
    let mut u = [0u32; 2];
    m.read_u32(a, &mut u).unwrap();
    assert_eq!(u, [u32::MAX, 2]);
    m.write_f32(a.offset(8), &[1.5]).unwrap();
    assert_eq!(m.bytes(a.offset(8), 4).unwrap(), &1.5f32.to_le_bytes());
    assert!(matches!(
        m.write_f32(a.offset(2), &[1.0]),
        Err(DeviceError::Driver { code: 716, .. })
    ));
}

#[test]
fn elementwise_rejects_partial_overlap_but_allows_in_place() {
    let mut m = SimMemory::new(1 << 30);
    let a = mapped(&mut m, 64);
    m.fill_f32(a, 16, 1.0).unwrap();
    m.map_f32(a, a, 4, |x| x + 1.0).unwrap();
    assert_eq!(m.f32s(a, 5).unwrap(), [2.0, 2.0, 2.0, 2.0, 1.0]);
    assert!(matches!(
        m.zip_f32(a.offset(4), a, a.offset(32), 4, |x, y| x + y),
        Err(DeviceError::OverlappingCopy { .. })
    ));
}
