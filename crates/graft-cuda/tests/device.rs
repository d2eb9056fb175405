//! graft-cuda against a real GPU: the capture lifecycle, copies, kernels and the failures CUDA
//! imposes inside a capture. Every GPU test is `#[ignore]`d (CI has no GPU); run them with
//! `--include-ignored` on a machine with one (scripts/gpu-run.sh does).

use graft_core::backend::CoreOnly;
use graft_core::{
    Buffer, CaptureMode, CaptureViolation, Config, Device, DeviceError, DeviceOp, DevicePtr, Graft,
};
use graft_cuda::{CudaDevice, CudaQueue};
use graft_testkit::{CudaTestKernels, TestQueue};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const N: usize = 1000;
const F32: usize = std::mem::size_of::<f32>();

/// A GPU with the test kernels loaded, and a runtime to allocate the kernels' buffers from.
struct Gpu {
    dev: CudaDevice,
    g: Graft<CudaDevice, ()>,
    kernels: CudaTestKernels,
}

fn device() -> CudaDevice {
    CudaDevice::new(0).expect("open cuda:0")
}

fn gpu() -> Gpu {
    let dev = device();
    // GPU machines have NVRTC: the test kernels compile there.
    let kernels = CudaTestKernels::load(&dev).expect("the test kernels compile and load");
    let g = Graft::new(dev.clone(), Config::default());
    Gpu { dev, g, kernels }
}

fn assert_capture_err(result: Result<impl std::fmt::Debug, DeviceError>, op: DeviceOp) {
    match result {
        Err(DeviceError::Capture { op: got, .. }) if got == op => {}
        other => panic!("expected a Capture error for {op:?}, got {other:?}"),
    }
}

/// Pool-style memory for `bytes`: a fresh reservation of whole granules, all mapped.
fn pool_memory(dev: &CudaDevice, bytes: usize) -> Result<DevicePtr, DeviceError> {
    let size = bytes.max(1).next_multiple_of(dev.granularity());
    let r = dev.reserve(CORE, size)?;
    dev.map(CORE, r, size)?;
    Ok(r)
}

/// Unmaps and releases memory from [`pool_memory`].
fn free_pool_memory(dev: &CudaDevice, ptr: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
    let size = bytes.max(1).next_multiple_of(dev.granularity());
    dev.unmap(CORE, ptr, size)?;
    dev.release_reservation(CORE, ptr, size)
}

/// Four graft buffers of `N` f32, for the kernels, and their addresses, for the rest.
struct Arrays {
    xb: Buffer,
    yb: Buffer,
    tb: Buffer,
    outb: Buffer,
    x: DevicePtr,
    y: DevicePtr,
    t: DevicePtr,
    out: DevicePtr,
}

fn arrays(gpu: &mut Gpu) -> Arrays {
    let mut buffer = || gpu.g.alloc(N * F32).expect("allocate a buffer");
    let (xb, yb, tb, outb) = (buffer(), buffer(), buffer(), buffer());
    let addr = |b: &Buffer| b.addr().expect("a fresh buffer is valid");
    Arrays {
        x: addr(&xb),
        y: addr(&yb),
        t: addr(&tb),
        out: addr(&outb),
        xb,
        yb,
        tb,
        outb,
    }
}

/// A buffer of `n` f32 holding `value`, for a copy to write into raw pool memory.
fn filled(gpu: &mut Gpu, n: usize, value: f32) -> Buffer {
    let b = gpu.g.alloc(n * F32).expect("allocate a buffer");
    gpu.g.write_f32(&b, &vec![value; n]).unwrap();
    b
}

/// out = 0.5 * ((x + y) * x) + 1
fn chain(dev: &CudaDevice, a: &Arrays) {
    dev.add_f32(&a.tb, &a.xb, &a.yb, N).unwrap();
    dev.mul_f32(&a.tb, &a.tb, &a.xb, N).unwrap();
    dev.axpb_f32(&a.outb, &a.tb, 0.5, 1.0, N).unwrap();
}

fn expected(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(&x, &y)| 0.5 * ((x + y) * x) + 1.0)
        .collect()
}

#[test]
fn is_available_does_not_panic() {
    let available = CudaDevice::is_available();
    eprintln!("CudaDevice::is_available() = {available}");
    if !available {
        // Without a GPU, opening one is an error, not a panic.
        assert!(CudaDevice::new(0).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn describe_names_the_device() {
    let dev = device();
    let text = dev.describe();
    eprintln!("{text}; {dev:?}");
    assert!(text.ends_with("(cuda:0)"), "{text}");
    assert!(CudaDevice::device_count().unwrap() >= 1);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_then_launch_reproduces_eager() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    let x: Vec<f32> = (0..N).map(|i| (i % 17) as f32).collect();
    let y: Vec<f32> = (0..N).map(|i| (i % 5) as f32 - 2.0).collect();
    dev.write_f32(a.x, &x).unwrap();
    dev.write_f32(a.y, &y).unwrap();

    // Eager.
    chain(&dev, &a);
    let eager = dev.read_f32(a.out, N).unwrap();
    assert_eq!(eager, expected(&x, &y));

    // Capture: recorded, not run.
    dev.fill_f32(&a.outb, N, -7.0).unwrap();
    dev.synchronize().unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert!(dev.is_capturing().unwrap());
    chain(&dev, &a);
    let graph = dev.end_capture(CORE).unwrap();
    assert!(!dev.is_capturing().unwrap());
    assert_eq!(
        dev.read_f32(a.out, N).unwrap(),
        vec![-7.0; N],
        "capture must not run the work"
    );

    // Replay.
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(a.out, N).unwrap(), eager);

    // Replay reads its inputs at the recorded addresses: new inputs, new outputs.
    let x2: Vec<f32> = (0..N).map(|i| (i % 3) as f32 + 0.5).collect();
    dev.write_f32(a.x, &x2).unwrap();
    dev.launch(CORE, &graph).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(a.out, N).unwrap(), expected(&x2, &y));

    drop(graph);
    assert_eq!(dev.take_sticky_error(CORE), None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_modes_all_work() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    for (i, mode) in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ]
    .into_iter()
    .enumerate()
    {
        dev.begin_capture(CORE, mode).unwrap();
        dev.fill_f32(&a.xb, N, i as f32).unwrap();
        let graph = dev.end_capture(CORE).unwrap();
        dev.launch(CORE, &graph).unwrap();
        assert_eq!(dev.read_f32(a.x, N).unwrap(), vec![i as f32; N], "{mode:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn synchronize_inside_capture_fails_and_abort_recovers() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(&a.xb, N, 1.0).unwrap();
    assert_capture_err(dev.synchronize(), DeviceOp::Synchronize);
    dev.abort_capture(CORE).unwrap();
    assert!(!dev.is_capturing().unwrap());

    // The stream works eagerly again...
    dev.fill_f32(&a.xb, N, 3.0).unwrap();
    assert_eq!(dev.read_f32(a.x, N).unwrap(), vec![3.0; N]);
    // ...and captures again.
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(&a.xb, N, 4.0).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(a.x, N).unwrap(), vec![4.0; N]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_transfers_and_query_inside_capture_fail() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    let mut host = vec![0u8; 16];

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_capture_err(dev.read(CORE, a.x, &mut host), DeviceOp::Read);
    dev.abort_capture(CORE).unwrap();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_capture_err(dev.write(CORE, a.x, &host), DeviceOp::Write);
    dev.abort_capture(CORE).unwrap();

    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_capture_err(dev.query(), DeviceOp::Query);
    dev.abort_capture(CORE).unwrap();

    dev.synchronize().unwrap();
    assert!(dev.query().unwrap(), "an idle stream has finished its work");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_lifecycle_misuse_is_capture_state() {
    let dev = device();
    assert!(matches!(
        dev.end_capture(CORE),
        Err(DeviceError::CaptureState {
            op: DeviceOp::EndCapture,
            ..
        })
    ));
    assert!(matches!(
        dev.abort_capture(CORE),
        Err(DeviceError::CaptureState { .. })
    ));
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert!(matches!(
        dev.begin_capture(CORE, CaptureMode::ThreadLocal),
        Err(DeviceError::CaptureState {
            op: DeviceOp::BeginCapture,
            ..
        })
    ));
    // An empty capture instantiates and launches.
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.summarize(&graph).unwrap(), Default::default());
    dev.launch(CORE, &graph).unwrap();
    dev.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_and_read_write_round_trip() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    let bytes: Vec<u8> = (0..N * F32).map(|i| (i * 7 % 251) as u8).collect();
    dev.write(CORE, a.x, &bytes).unwrap();
    dev.copy(CORE, a.y, a.x, bytes.len()).unwrap();
    let mut back = vec![0u8; bytes.len()];
    dev.read(CORE, a.y, &mut back).unwrap();
    assert_eq!(back, bytes);

    // Unaligned offsets and odd lengths.
    dev.copy(CORE, a.t.offset(3), a.x.offset(1), 1001).unwrap();
    let mut odd = vec![0u8; 1001];
    dev.read(CORE, a.t.offset(3), &mut odd).unwrap();
    assert_eq!(odd, bytes[1..1002]);

    // Overlap is rejected before CUDA sees it; adjacency is fine; zero bytes is a no-op.
    assert_eq!(
        dev.copy(CORE, a.x.offset(8), a.x, 16),
        Err(DeviceError::OverlappingCopy {
            op: DeviceOp::Copy,
            dst: a.x.offset(8),
            src: a.x,
            len: 16
        })
    );
    assert!(matches!(
        dev.copy(CORE, a.x, a.x, 4),
        Err(DeviceError::OverlappingCopy { .. })
    ));
    dev.copy(CORE, a.x.offset(16), a.x, 16).unwrap();
    dev.copy(CORE, a.x, a.y, 0).unwrap();

    // Empty transfers work too.
    dev.write(CORE, a.x, &[]).unwrap();
    dev.read(CORE, a.x, &mut []).unwrap();

    // A copy inside a capture is recorded and replayed.
    dev.write_f32(a.x, &[5.0; N]).unwrap();
    dev.fill_f32(&a.outb, N, 0.0).unwrap();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.copy(CORE, a.out, a.x, N * F32).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.read_f32(a.out, N).unwrap(), vec![0.0; N]);
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(a.out, N).unwrap(), vec![5.0; N]);

    // The queue's own copies, reads and writes take graft buffers, checked before CUDA sees
    // them (the raw-address versions are the `Device` trait's, for core's pool).
    let q: &CudaQueue = &dev;
    q.write(&a.yb, &bytes).unwrap();
    q.copy(&a.tb, &a.yb, bytes.len()).unwrap();
    let mut again = vec![0u8; bytes.len()];
    q.read(&a.tb, &mut again).unwrap();
    assert_eq!(again, bytes);
    assert!(matches!(
        q.copy(&a.tb, &a.yb, bytes.len() + 1),
        Err(DeviceError::InvalidArgument {
            op: DeviceOp::Copy,
            ..
        })
    ));
    assert!(matches!(
        q.read(&a.tb, &mut vec![0u8; bytes.len() + 1]),
        Err(DeviceError::InvalidArgument {
            op: DeviceOp::Read,
            ..
        })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn summarize_counts_kernels_and_copies() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    chain(&dev, &a);
    dev.copy(CORE, a.y, a.out, N * F32).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    let summary = dev.summarize(&graph).unwrap();
    eprintln!("{summary:?}");
    assert_eq!(summary.kernels, 3);
    assert_eq!(summary.copies, 1);
    assert_eq!(summary.memsets, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reserve_and_map_during_capture_work() {
    let mut gpu = gpu();
    let dev = gpu.dev.clone();
    let nines = filled(&mut gpu, N, 9.0);
    for mode in [CaptureMode::Global, CaptureMode::ThreadLocal] {
        dev.begin_capture(CORE, mode).unwrap();
        let seg = pool_memory(&dev, 1 << 20).expect("reserve and map inside a capture");
        // Pool memory is not a graft buffer: a captured copy writes it.
        dev.copy(CORE, seg, nines.addr().unwrap(), N * F32).unwrap();
        let graph = dev
            .end_capture(CORE)
            .expect("the capture survives the allocation");
        dev.launch(CORE, &graph).unwrap();
        assert_eq!(dev.read_f32(seg, N).unwrap(), vec![9.0; N], "{mode:?}");
        free_pool_memory(&dev, seg, 1 << 20).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_alloc_during_capture_fails() {
    let dev = device();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    assert_capture_err(dev.raw_alloc(4096), DeviceOp::RawAlloc);
    dev.abort_capture(CORE).unwrap();

    let ptr = dev.raw_alloc(4096).expect("raw_alloc outside a capture");
    dev.write_f32(ptr, &[2.0; 1024]).unwrap();
    assert_eq!(dev.read_f32(ptr, 4).unwrap(), vec![2.0; 4]);
    dev.raw_free(ptr).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn side_stream_left_unjoined_fails_end_capture() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(&a.xb, N, 1.0).unwrap();
    gpu.kernels
        .fill_f32_on_side_stream(&dev, &a.yb, N, 2.0)
        .unwrap();
    match dev.end_capture(CORE) {
        Err(DeviceError::Capture {
            op: DeviceOp::EndCapture,
            violation: CaptureViolation::Unjoined,
        }) => {}
        other => panic!("expected Capture {{ EndCapture, Unjoined }}, got {other:?}"),
    }
    assert!(
        !dev.is_capturing().unwrap(),
        "a failed end leaves no capture"
    );

    // Both streams work eagerly afterwards.
    gpu.kernels
        .fill_f32_on_side_stream(&dev, &a.yb, N, 6.0)
        .unwrap();
    dev.join_side_stream().unwrap();
    assert_eq!(dev.read_f32(a.y, N).unwrap(), vec![6.0; N]);

    // Joined, the same fork captures fine and replays both kernels.
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(&a.xb, N, 7.0).unwrap();
    gpu.kernels
        .fill_f32_on_side_stream(&dev, &a.yb, N, 8.0)
        .unwrap();
    dev.join_side_stream().unwrap();
    let graph = dev.end_capture(CORE).expect("joined fork captures");
    assert_eq!(dev.summarize(&graph).unwrap().kernels, 2);
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(a.x, N).unwrap(), vec![7.0; N]);
    assert_eq!(dev.read_f32(a.y, N).unwrap(), vec![8.0; N]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graphs_launch_from_another_thread_and_drop_cleanly() {
    let mut gpu = gpu();
    let a = arrays(&mut gpu);
    let dev = gpu.dev.clone();
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.fill_f32(&a.xb, N, 11.0).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    let dev2 = dev.clone();
    std::thread::spawn(move || {
        dev2.launch(CORE, &graph).unwrap();
        dev2.synchronize().unwrap();
        drop(graph);
    })
    .join()
    .unwrap();
    assert_eq!(dev.read_f32(a.x, N).unwrap(), vec![11.0; N]);
    assert_eq!(dev.take_sticky_error(CORE), None);

    // A graph of another device instance is refused.
    let other = device();
    other.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    let foreign = other.end_capture(CORE).unwrap();
    assert!(matches!(
        dev.launch(CORE, &foreign),
        Err(DeviceError::InvalidArgument {
            op: DeviceOp::GraphLaunch,
            ..
        })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_fill_covers_every_element() {
    // More elements than one launch has threads (65536 blocks x 256): the grid-stride loop.
    let mut gpu = gpu();
    let n = (1 << 24) + 3;
    let seg = gpu.g.alloc(n * F32).unwrap();
    gpu.dev.fill_f32(&seg, n, 0.25).unwrap();
    let all = gpu.g.read_f32(&seg).unwrap();
    assert!(all.iter().all(|&v| v == 0.25));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn map_write_read_unmap_remap() {
    let mut gpu = gpu();
    let fives = filled(&mut gpu, N, 5.0);
    let dev = gpu.dev.clone();
    let g = dev.granularity();
    eprintln!("granularity: {g} bytes");
    assert!(g >= 512 && g.is_multiple_of(512));
    let r = dev.reserve(CORE, 64 * g).unwrap();
    // Map two granules in the middle of a large reservation; nothing else is backed.
    let at = r.offset(10 * g);
    dev.map(CORE, at, 2 * g).unwrap();
    let n = 2 * g / F32;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    dev.write_f32(at, &values).unwrap();
    assert_eq!(dev.read_f32(at, n).unwrap(), values);
    // Unmap one granule: the other keeps its contents.
    dev.unmap(CORE, at, g).unwrap();
    assert_eq!(
        dev.read_f32(at.offset(g), g / F32).unwrap(),
        values[g / F32..]
    );
    // Remap it: new physical memory, usable again.
    dev.map(CORE, at, g).unwrap();
    dev.write_f32(at, &vec![3.0; g / F32]).unwrap();
    assert_eq!(dev.read_f32(at, g / F32).unwrap(), vec![3.0; g / F32]);
    // Misuse is an error, not undefined behaviour.
    let bad = |e: Result<(), DeviceError>| matches!(e, Err(DeviceError::InvalidArgument { .. }));
    assert!(bad(dev.map(CORE, at, g)), "mapping twice");
    assert!(bad(dev.map(CORE, at.offset(512), g)), "unaligned");
    assert!(
        bad(dev.map(CORE, r.offset(64 * g), g)),
        "outside the reservation"
    );
    assert!(bad(dev.unmap(CORE, r, g)), "unmapping what is not mapped");
    assert!(
        bad(dev.release_reservation(CORE, r, 64 * g)),
        "still mapped"
    );
    // Map during a capture, after the reservation.
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.map(CORE, r, g).expect("map inside a capture");
    // Mapped memory is not a graft buffer: a captured copy writes it.
    dev.copy(CORE, r, fives.addr().unwrap(), N * F32).unwrap();
    let graph = dev.end_capture(CORE).expect("the capture survives the map");
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(dev.read_f32(r, N).unwrap(), vec![5.0; N]);
    drop(graph);
    dev.unmap(CORE, r, g).unwrap();
    dev.unmap(CORE, at, 2 * g).unwrap();
    dev.release_reservation(CORE, r, 64 * g).unwrap();
}
