//! The one-shot all-reduce over peer memory (`NcclComm::all_reduce_sum_raw` for small
//! messages): on two GPUs of one process (`NcclComm::init_all`, peer access) its sums equal the
//! host twin (`one_shot_sum`) and NCCL's bit for bit, eagerly and in graphs replayed with new
//! inputs, and an abort frees a kernel waiting on a peer that never comes; on one GPU
//! (`init_rank`, a job of one rank: the IPC setup without peers) it keeps its values. Ignored
//! (CI has no GPU); the two-GPU tests skip themselves with fewer, saying so. They need NCCL
//! and `NCCL_RUNTIME_CONNECT=0`, which `scripts/gpu-run.sh` provides. Ranks as processes
//! (IPC) run in the root crate's `tests/processes.rs` (`::cuda` scenarios), whose bodies
//! all-reduce 16 bytes: the one-shot path.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use graft_core::backend::CoreOnly;
use graft_core::{CaptureMode, Device, DeviceError, DeviceOp, DevicePtr};
use graft_cuda::{CudaDevice, NcclComm, NcclDtype, one_shot_sum};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

/// The one-shot path's default (and largest) limit.
const LIMIT: usize = 256 << 10;

const DEADLINE: Duration = Duration::from_secs(30);

/// Two GPUs with their communicators, or `None` (said why) where the machine has fewer.
/// Panics where the one-shot path is off on them (its reason is in the communicator's Debug):
/// these tests are for GPUs that reach each other's memory.
fn two_gpus() -> Option<(Vec<CudaDevice>, Vec<NcclComm>)> {
    if graft_testkit::skip_without_cuda_gpus(2) {
        return None;
    }
    let devices: Vec<CudaDevice> = (0..2)
        .map(|i| CudaDevice::new(i).expect("open the GPU"))
        .collect();
    let comms = NcclComm::init_all(&devices).expect("NCCL communicators (NCCL_RUNTIME_CONNECT=0?)");
    assert!(
        comms.iter().all(|c| c.one_shot_limit() == LIMIT),
        "the one-shot all-reduce is off on these GPUs: {comms:?}"
    );
    Some((devices, comms))
}

/// A small deterministic generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }
}

/// `count` elements of `dtype` for a rank: any mantissa, exponents within 2^-4..2^4 and both
/// signs, so that two ranks' values add exactly in f32 and the one rounding to the dtype is
/// NCCL's too.
fn values(dtype: NcclDtype, count: usize, seed: u64) -> Vec<u8> {
    let mut g = Lcg(seed);
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let r = g.next();
        let exp = 123 + (r % 9); // 2^-4 ..= 2^4
        let bits = ((r >> 31) << 31) | (exp << 23) | (g.next() & 0x7f_ffff);
        match dtype {
            NcclDtype::F32 => out.extend_from_slice(&bits.to_le_bytes()),
            // The upper half of the f32: a bf16 value.
            NcclDtype::Bf16 => out.extend_from_slice(&((bits >> 16) as u16).to_le_bytes()),
            // An f16 of the same range: sign, exponent 11..=19, any mantissa.
            NcclDtype::F16 => {
                let h = (((r >> 31) << 15) | ((11 + r % 9) << 10) | (g.next() & 0x3ff)) as u16;
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
    }
    out
}

/// Runs one all-reduce of `count` elements at `at[rank]` on every rank, a thread each, and
/// waits for the streams.
fn all_reduce(
    devices: &[CudaDevice],
    comms: &[NcclComm],
    at: &[u64],
    count: usize,
    dtype: NcclDtype,
) {
    std::thread::scope(|s| {
        for ((dev, comm), &at) in devices.iter().zip(comms).zip(at) {
            s.spawn(move || {
                // SAFETY: `at` is the start of a `raw_alloc` of this device large enough for
                // `count` elements (the caller's), freed only after the stream is synchronized
                // just below; nothing else touches it meanwhile.
                unsafe { comm.all_reduce_sum_raw(at, count, dtype) }.expect("the all-reduce");
                Device::synchronize(dev).expect("the all-reduce runs");
            });
        }
    });
}

/// Every rank's input written, then the all-reduce, then every rank's result read.
fn run(
    devices: &[CudaDevice],
    comms: &[NcclComm],
    at: &[u64],
    inputs: &[Vec<u8>],
    dtype: NcclDtype,
) -> Vec<Vec<u8>> {
    for ((dev, &at), input) in devices.iter().zip(at).zip(inputs) {
        dev.write(CORE, DevicePtr(at), input).unwrap();
    }
    let count = inputs[0].len() / dtype.size();
    all_reduce(devices, comms, at, count, dtype);
    devices
        .iter()
        .zip(at)
        .map(|(dev, &at)| {
            let mut out = vec![0u8; inputs[0].len()];
            dev.read(CORE, DevicePtr(at), &mut out).unwrap();
            out
        })
        .collect()
}

#[test]
#[ignore = "needs 2 CUDA GPUs with peer access, and NCCL (skips itself with fewer GPUs)"]
fn one_shot_sums_equal_the_twin_and_nccl_bit_for_bit() {
    let Some((devices, comms)) = two_gpus() else {
        return;
    };
    // One buffer per rank, big enough for the largest case plus a misaligning offset.
    let bufs: Vec<DevicePtr> = devices
        .iter()
        .map(|d| d.raw_alloc(LIMIT + 64).unwrap())
        .collect();
    for dtype in [NcclDtype::F32, NcclDtype::Bf16, NcclDtype::F16] {
        let size = dtype.size();
        let max = LIMIT / size;
        let mut cases: Vec<(usize, u64)> = [1, 2, 3, 7, 255, 1023, 1024, 1025, 2047, 2048, 4097]
            .into_iter()
            .map(|n| (n, 0))
            .collect();
        // 4 bytes; exactly the limit; one element past it (NCCL); and misaligned starts (the
        // kernel's scalar path) for an odd count and for the limit.
        cases.extend([(4 / size, 0), (max - 1, 0), (max, 0), (max + 1, 0)]);
        cases.extend([(1025, size as u64), (max, size as u64)]);
        for (case, &(count, offset)) in cases.iter().enumerate() {
            let at: Vec<u64> = bufs.iter().map(|b| b.0 + offset).collect();
            let inputs: Vec<Vec<u8>> = (0..2)
                .map(|r| values(dtype, count, (case * 2 + r) as u64 + 1))
                .collect();
            let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let want = one_shot_sum(dtype, &parts).unwrap();
            let what = format!("{dtype:?}, {count} elements at +{offset}");
            let one_shot = run(&devices, &comms, &at, &inputs, dtype);
            assert!(
                one_shot.iter().all(|r| *r == want),
                "one-shot (or NCCL past the limit), {what}"
            );
            for c in &comms {
                assert_eq!(c.set_one_shot_limit(0), 0);
            }
            let nccl = run(&devices, &comms, &at, &inputs, dtype);
            assert!(nccl.iter().all(|r| *r == want), "NCCL, {what}");
            for c in &comms {
                assert_eq!(c.set_one_shot_limit(usize::MAX), LIMIT);
            }
        }
    }
    for (dev, b) in devices.iter().zip(bufs) {
        dev.raw_free(b).unwrap();
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs with peer access, and NCCL (skips itself with fewer GPUs)"]
fn captured_one_shot_all_reduces_replay_with_new_inputs() {
    let Some((devices, comms)) = two_gpus() else {
        return;
    };
    // Like a decode step's: 1 x 2048 and 32 x 2048 bf16 (4 KiB and 128 KiB), and an f32
    // message of an odd size, in one graph; an eager all-reduce between replays shares the
    // blocks' epochs with them.
    let shapes = [
        (NcclDtype::Bf16, 2048usize),
        (NcclDtype::Bf16, 32 * 2048),
        (NcclDtype::F32, 1001),
        (NcclDtype::Bf16, 2048),
    ];
    let bufs: Vec<Vec<DevicePtr>> = devices
        .iter()
        .map(|d| {
            shapes
                .iter()
                .map(|&(t, n)| d.raw_alloc(n * t.size()).unwrap())
                .collect()
        })
        .collect();
    let graphs: Vec<_> = devices
        .iter()
        .zip(&comms)
        .zip(&bufs)
        .map(|((dev, comm), bufs)| {
            dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
            for (&(dtype, n), b) in shapes.iter().zip(bufs) {
                // SAFETY: `b` is a `raw_alloc` of `n` elements of `dtype` on this device,
                // freed only after the last replay has been synchronized.
                unsafe { comm.all_reduce_sum_raw(b.0, n, dtype) }.unwrap();
            }
            dev.end_capture(CORE).unwrap()
        })
        .collect();
    for replay in 0..50u64 {
        let inputs: Vec<Vec<Vec<u8>>> = (0..2u64)
            .map(|r| {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &(t, n))| values(t, n, 1000 * replay + 10 * r + i as u64 + 1))
                    .collect()
            })
            .collect();
        for ((dev, bufs), inputs) in devices.iter().zip(&bufs).zip(&inputs) {
            for (b, input) in bufs.iter().zip(inputs) {
                dev.write(CORE, *b, input).unwrap();
            }
        }
        for (dev, graph) in devices.iter().zip(&graphs) {
            dev.launch(CORE, graph).unwrap();
        }
        for dev in &devices {
            Device::synchronize(dev).unwrap();
        }
        for (i, &(dtype, n)) in shapes.iter().enumerate() {
            let want = one_shot_sum(dtype, &[&inputs[0][i], &inputs[1][i]]).unwrap();
            for (dev, bufs) in devices.iter().zip(&bufs) {
                let mut got = vec![0u8; n * dtype.size()];
                dev.read(CORE, bufs[i], &mut got).unwrap();
                assert!(
                    got == want,
                    "replay {replay}, all-reduce {i} ({dtype:?} x {n})"
                );
            }
        }
        if replay % 10 == 3 {
            let at: Vec<u64> = bufs.iter().map(|b| b[2].0).collect();
            let inputs: Vec<Vec<u8>> = (0..2)
                .map(|r| values(NcclDtype::F32, 1001, r + 7))
                .collect();
            let want = one_shot_sum(NcclDtype::F32, &[&inputs[0], &inputs[1]]).unwrap();
            let got = run(&devices, &comms, &at, &inputs, NcclDtype::F32);
            assert!(
                got.iter().all(|g| *g == want),
                "eager after replay {replay}"
            );
        }
    }
    drop(graphs);
    for (dev, bufs) in devices.iter().zip(bufs) {
        for b in bufs {
            dev.raw_free(b).unwrap();
        }
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs with peer access, and NCCL (skips itself with fewer GPUs)"]
fn an_abort_frees_a_kernel_waiting_on_a_peer_that_never_comes() {
    let Some((devices, comms)) = two_gpus() else {
        return;
    };
    let bufs: Vec<DevicePtr> = devices.iter().map(|d| d.raw_alloc(4096).unwrap()).collect();
    // Rank 0 alone: its kernel waits for rank 1's flags.
    // SAFETY: a `raw_alloc` of 4096 bytes on rank 0's device, freed after the stream is
    // synchronized below (or, if the abort fails, after rank 1 released the kernel).
    unsafe { comms[0].all_reduce_sum_raw(bufs[0].0, 1024, NcclDtype::F32) }.unwrap();
    let start = Instant::now();
    let returned = std::thread::scope(|s| {
        let (done, synced) = mpsc::channel();
        let dev = devices[0].clone();
        s.spawn(move || {
            let _ = done.send(Device::synchronize(&dev));
        });
        std::thread::sleep(Duration::from_millis(300));
        let aborted = comms[0].abort();
        let result = synced.recv_timeout(Duration::from_secs(10));
        if result.is_err() {
            // Never hang the test: rank 1's matching all-reduce releases rank 0's kernel.
            // SAFETY: as above, on rank 1's device.
            let _ = unsafe { comms[1].all_reduce_sum_raw(bufs[1].0, 1024, NcclDtype::F32) };
        }
        (aborted, result)
    });
    let took = start.elapsed();
    let (aborted, synced) = returned;
    assert_eq!(aborted, Ok(()));
    assert!(
        matches!(synced, Ok(Ok(()))),
        "rank 0's stream did not return after the abort: {synced:?} ({took:?})"
    );
    assert!(took < Duration::from_secs(5), "returned after {took:?}");
    // SAFETY: as above; refused before anything is enqueued.
    let later = unsafe { comms[0].all_reduce_sum_raw(bufs[0].0, 1024, NcclDtype::F32) };
    assert_eq!(
        later,
        Err(DeviceError::CollectiveAborted {
            op: DeviceOp::Collective
        })
    );
    drop(comms);
    for (dev, b) in devices.iter().zip(bufs) {
        dev.raw_free(b).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn a_one_rank_job_takes_the_one_shot_path_and_keeps_its_values() {
    let dev = CudaDevice::new(0).expect("open cuda:0");
    let id = NcclComm::unique_id().expect("an NCCL unique id");
    let comm = NcclComm::init_rank(&dev, &id, 0, 1, DEADLINE).expect("a one-rank communicator");
    assert_eq!(
        comm.one_shot_limit(),
        LIMIT,
        "the one-shot path is on (see the info log)"
    );
    let buf = dev.raw_alloc(LIMIT).unwrap();
    for (dtype, count) in [
        (NcclDtype::F32, 3usize),
        (NcclDtype::Bf16, LIMIT / 2),
        (NcclDtype::F16, 4097),
    ] {
        let input = values(dtype, count, count as u64);
        dev.write(CORE, buf, &input).unwrap();
        dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
        // SAFETY: a `raw_alloc` of `LIMIT` bytes on this device, freed after the stream is
        // synchronized below.
        unsafe { comm.all_reduce_sum_raw(buf.0, count, dtype) }.unwrap();
        let graph = dev.end_capture(CORE).unwrap();
        for _ in 0..3 {
            dev.launch(CORE, &graph).unwrap();
        }
        // SAFETY: as above.
        unsafe { comm.all_reduce_sum_raw(buf.0, count, dtype) }.unwrap();
        Device::synchronize(&dev).unwrap();
        let mut got = vec![0u8; input.len()];
        dev.read(CORE, buf, &mut got).unwrap();
        assert!(
            got == input,
            "{dtype:?} x {count}: one rank's sum is its own values"
        );
    }
    dev.raw_free(buf).unwrap();
}
