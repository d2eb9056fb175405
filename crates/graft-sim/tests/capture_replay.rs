//! Capture records, launch replays: same results as eager execution, at the recorded addresses.

use graft_core::backend::CoreOnly;
use graft_core::{CaptureMode, Device, DeviceError, DeviceOp, DevicePtr, GraphSummary};
use graft_sim::{CaptureStatus, GRANULARITY, SimDevice};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const N: usize = 64;
const BYTES: usize = N * 4;

/// Pool-style memory for `bytes`: a fresh reservation of whole granules, all mapped. Legal
/// during a capture.
fn pool_memory(dev: &SimDevice, bytes: usize) -> Result<DevicePtr, DeviceError> {
    let size = bytes.next_multiple_of(GRANULARITY);
    let r = dev.reserve(CORE, size)?;
    dev.map(CORE, r, size)?;
    Ok(r)
}

/// The chain under test: x = 2; y = 3x + 1; z = x + y; z *= y.
fn chain(dev: &SimDevice, x: DevicePtr, y: DevicePtr, z: DevicePtr) -> Result<(), DeviceError> {
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(x, N, 2.0))?;
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(y, x, N, |v| f32::mul_add(3.0, v, 1.0))
    })?;
    dev.launch_kernel("add_f32", move |m| m.zip_f32(z, x, y, N, |x, y| x + y))?;
    dev.launch_kernel("mul_f32", move |m| m.zip_f32(z, z, y, N, |x, y| x * y))
}

#[test]
fn replay_reproduces_eager_result_at_recorded_addresses() {
    let dev = SimDevice::new();
    let seg = pool_memory(&dev, 4 * BYTES).unwrap();
    let (x, y, z) = (seg, seg.offset(BYTES), seg.offset(2 * BYTES));

    // Eager run on other buffers.
    let other = pool_memory(&dev, 3 * BYTES).unwrap();
    chain(&dev, other, other.offset(BYTES), other.offset(2 * BYTES)).unwrap();
    let eager = dev.read_f32(other.offset(2 * BYTES), N).unwrap();
    assert_eq!(eager, vec![(2.0 + 7.0) * 7.0; N]);

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_eq!(
        dev.capture_status().unwrap(),
        CaptureStatus::Active {
            mode: CaptureMode::ThreadLocal
        }
    );
    chain(&dev, x, y, z).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.capture_status().unwrap(), CaptureStatus::Idle);

    // Nothing ran during the capture: z still holds poison.
    let before = dev.read_f32(z, N).unwrap();
    assert_eq!(before[0].to_bits(), 0xA5A5_A5A5);
    assert_eq!(
        dev.summarize(&graph).unwrap(),
        GraphSummary {
            kernels: 4,
            ..GraphSummary::default()
        }
    );
    assert_eq!(
        graph.kernel_names(),
        ["fill_f32", "axpb_f32", "add_f32", "mul_f32"]
    );

    let kernels_before = dev.stats().kernels_run;
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(z, N).unwrap(), eager);
    assert_eq!(dev.stats().kernels_run, kernels_before + 4);
    assert_eq!(dev.stats().graph_launches, 1);
}

#[test]
fn replay_rereads_inputs_changed_in_place() {
    let dev = SimDevice::new();
    let seg = pool_memory(&dev, 3 * BYTES).unwrap();
    let (input, out) = (seg, seg.offset(BYTES));
    dev.write_f32(input, &[1.0; N]).unwrap();

    dev.begin_capture(CORE, CaptureMode::Global).unwrap();
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(out, input, N, |v| f32::mul_add(2.0, v, 0.5))
    })
    .unwrap();
    dev.launch_kernel("add_f32", move |m| {
        m.zip_f32(out, out, input, N, |x, y| x + y)
    })
    .unwrap();
    let graph = dev.end_capture(CORE).unwrap();

    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(out, N).unwrap(), vec![3.5; N]);

    dev.write_f32(input, &[10.0; N]).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(out, N).unwrap(), vec![30.5; N]);
    assert_eq!(dev.stats().graph_launches, 2);
}

#[test]
fn copies_are_recorded_and_replayed() {
    let dev = SimDevice::new();
    let a = pool_memory(&dev, BYTES).unwrap();
    let b = pool_memory(&dev, BYTES).unwrap();
    dev.write_f32(a, &[4.0; N]).unwrap();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.copy(CORE, b, a, BYTES).unwrap();
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(b, b, N, |v| f32::mul_add(1.0, v, 1.0))
    })
    .unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.stats().copies_run, 0, "recording does not run the copy");
    assert_eq!(
        dev.summarize(&graph).unwrap(),
        GraphSummary {
            kernels: 1,
            copies: 1,
            ..GraphSummary::default()
        }
    );

    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(b, N).unwrap(), vec![5.0; N]);
    assert_eq!(dev.read_f32(a, N).unwrap(), vec![4.0; N]);
    assert_eq!(dev.stats().copies_run, 1);
}

#[test]
fn graph_launched_inside_a_capture_becomes_a_child_graph() {
    let dev = SimDevice::new();
    let a = pool_memory(&dev, BYTES).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(a, N, 1.0))
        .unwrap();
    let inner = dev.end_capture(CORE).unwrap();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch(CORE, &inner).unwrap();
    dev.launch_kernel("axpb_f32", move |m| {
        m.map_f32(a, a, N, |v| f32::mul_add(2.0, v, 0.0))
    })
    .unwrap();
    let outer = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.stats().kernels_run, 0);
    assert_eq!(dev.summarize(&outer).unwrap().other, 1);

    dev.launch(CORE, &outer).unwrap();
    assert_eq!(dev.read_f32(a, N).unwrap(), vec![2.0; N]);
    assert_eq!(dev.stats().kernels_run, 2);
}

#[test]
fn reserve_and_map_work_during_capture_and_the_capture_stays_valid() {
    let dev = SimDevice::new();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    let seg = pool_memory(&dev, BYTES).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 9.0))
        .unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.stats().mapped_bytes, GRANULARITY);
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(seg, N).unwrap(), vec![9.0; N]);
}

#[test]
fn replay_after_unmap_fails_with_invalid_address() {
    let dev = SimDevice::new();
    let seg = pool_memory(&dev, BYTES).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 1.0))
        .unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    dev.launch(CORE, &graph).unwrap();

    dev.unmap(CORE, seg, GRANULARITY).unwrap();
    // New memory never lands at the unmapped address.
    let fresh = pool_memory(&dev, BYTES).unwrap();
    assert_ne!(fresh, seg);
    assert_eq!(
        dev.launch(CORE, &graph),
        Err(DeviceError::InvalidAddress {
            op: DeviceOp::KernelLaunch,
            addr: seg,
            len: BYTES
        })
    );
    assert_eq!(dev.stats().graph_launches, 1, "failed launch not counted");
}

#[test]
fn graphs_are_counted_and_bound_to_their_device() {
    let dev = SimDevice::new();
    let other = SimDevice::new();
    assert_ne!(dev.id(), other.id());
    assert_eq!(dev.describe(), "host simulator");

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(graph.device(), dev.id());
    assert_eq!(dev.stats().live_graphs, 1);
    assert!(matches!(
        other.launch(CORE, &graph),
        Err(DeviceError::InvalidArgument {
            op: DeviceOp::GraphLaunch,
            ..
        })
    ));
    dev.launch(CORE, &graph).unwrap();
    drop(graph);
    assert_eq!(dev.stats().live_graphs, 0);
    assert_eq!(dev.take_sticky_error(CORE), None);
}

#[test]
fn clones_share_the_device() {
    let dev = SimDevice::new();
    let clone = dev.clone();
    let seg = pool_memory(&dev, BYTES).unwrap();
    clone
        .launch_kernel("fill_f32", move |m| m.fill_f32(seg, N, 3.0))
        .unwrap();
    assert_eq!(dev.read_f32(seg, 1).unwrap(), [3.0]);
    assert_eq!(clone.id(), dev.id());
}

/// A capture records a programmatic edge for each dependent launched right after a kernel
/// (not for one after a copy), and the replay gives the eager results.
#[test]
fn a_capture_counts_programmatic_edges() {
    let dev = SimDevice::new();
    let seg = pool_memory(&dev, 4 * BYTES).unwrap();
    let (x, y, z) = (seg, seg.offset(BYTES), seg.offset(2 * BYTES));
    let dependent_copy = |dst: DevicePtr, src: DevicePtr| {
        let args = [dst.0.to_le_bytes(), src.0.to_le_bytes()];
        dev.launch_dependent(
            "copy_f32",
            &args.each_ref().map(|a| &a[..]),
            |_| Ok(()),
            move |m| m.copy(dst, src, BYTES),
        )
    };
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.launch_kernel("fill_f32", move |m| m.fill_f32(x, N, 2.0))
        .unwrap();
    dependent_copy(y, x).unwrap();
    dependent_copy(z, y).unwrap();
    dev.copy(CORE, z, y, BYTES).unwrap();
    dependent_copy(x, z).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(
        dev.summarize(&graph).unwrap(),
        GraphSummary {
            kernels: 4,
            copies: 1,
            programmatic_edges: 2,
            ..GraphSummary::default()
        }
    );
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(x, N).unwrap(), vec![2.0; N]);
}
