//! The generic kernel API (`load_module` / `launch_function`) and cuBLAS `sgemm` against a
//! real GPU. Every GPU test is `#[ignore]`d (CI has no GPU); run them with `--include-ignored`
//! on a machine with one.

use graft_core::backend::CoreOnly;
use graft_core::{Buffer, CaptureMode, Config, Device, DeviceError, Graft};
use graft_cuda::{CudaDevice, KernelArg, Operand, Sgemm};

/// The token of the device's sealed methods, which these tests call directly.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

const SOURCE: &str = r#"
extern "C" __global__ void scale_add(float* out, const float* x, float a, int b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + (float)b;
}
extern "C" __global__ void iota(int* out, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (int)i;
}
"#;

/// A fresh device, and a runtime on it whose eager pool holds the tests' buffers.
fn device() -> (CudaDevice, Graft<CudaDevice, ()>) {
    let dev = CudaDevice::new(0).expect("open cuda:0");
    (dev.clone(), Graft::new(dev, Config::default()))
}

fn upload(g: &mut Graft<CudaDevice, ()>, values: &[f32]) -> Buffer {
    let b = g.alloc(values.len().max(1) * 4).unwrap();
    g.write_f32(&b, values).unwrap();
    b
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn module_kernels_launch_with_checked_arguments() {
    let (dev, mut g) = device();
    let m = dev.load_module(SOURCE, &["scale_add", "iota"]).unwrap();
    assert_eq!(m.index("iota"), Some(1));
    assert_eq!(m.param_sizes(0), Some(&[8, 8, 4, 4, 4][..]));
    assert_eq!(m.param_sizes(1), Some(&[8, 8][..]));
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let xp = upload(&mut g, &x);
    let out = upload(&mut g, &vec![0.0; n]);
    let args = [
        KernelArg::Buffer(&out),
        KernelArg::Buffer(&xp),
        KernelArg::F32(2.0),
        KernelArg::I32(-3),
        KernelArg::U32(n as u32),
    ];
    dev.launch_function(&m, 0, (n.div_ceil(128) as u32, 1, 1), (128, 1, 1), 0, &args)
        .unwrap();
    let got = g.read_f32(&out).unwrap();
    for i in 0..n {
        assert_eq!(got[i], 2.0 * x[i] - 3.0);
    }

    // Wrong count, wrong size, bad index, zero grid, an offset past the buffer, a buffer of
    // another device: refused before the driver sees them.
    let (_other_dev, mut other) = device();
    let foreign = upload(&mut other, &[0.0; 4]);
    let past_end = [KernelArg::BufferAt(&out, n * 4 + 4), KernelArg::U64(1)];
    let elsewhere = [KernelArg::Buffer(&foreign), KernelArg::U64(1)];
    for (kernel, args, grid) in [
        (0, &args[..4], 1),
        (1, &[KernelArg::Buffer(&out), KernelArg::U32(4)][..], 1),
        (7, &args[..], 1),
        (0, &args[..], 0),
        (1, &past_end[..], 1),
        (1, &elsewhere[..], 1),
    ] {
        let r = dev.launch_function(&m, kernel, (grid, 1, 1), (32, 1, 1), 0, args);
        assert!(
            matches!(r, Err(DeviceError::InvalidArgument { .. })),
            "{r:?}"
        );
    }

    // A compile error is an error, not a panic.
    assert!(dev.load_module("this is not CUDA", &["k"]).is_err());
    assert!(dev.load_module(SOURCE, &["missing_kernel"]).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn module_launches_are_captured_and_replayed() {
    let (dev, mut g) = device();
    let m = dev.load_module(SOURCE, &["scale_add", "iota"]).unwrap();
    let n = 300usize;
    let xp = upload(&mut g, &vec![1.0; n]);
    let out = upload(&mut g, &vec![0.0; n]);
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    let args = [
        KernelArg::Buffer(&out),
        KernelArg::Buffer(&xp),
        KernelArg::F32(3.0),
        KernelArg::I32(1),
        KernelArg::U32(n as u32),
    ];
    dev.launch_function(&m, 0, (3, 1, 1), (128, 1, 1), 0, &args)
        .unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    assert_eq!(dev.summarize(&graph).unwrap().kernels, 1);
    assert_eq!(
        g.read_f32(&out).unwrap(),
        vec![0.0; n],
        "capture ran nothing"
    );
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(g.read_f32(&out).unwrap(), vec![4.0; n]);
    g.write_f32(&xp, &vec![2.0; n]).unwrap();
    dev.launch(CORE, &graph).unwrap();
    assert_eq!(
        g.read_f32(&out).unwrap(),
        vec![7.0; n],
        "replay reads memory anew"
    );
    drop(graph);
    // A buffer graft freed (its runtime closed) is refused with the buffer's error.
    g.close().unwrap();
    let r = dev.launch_function(
        &m,
        1,
        (1, 1, 1),
        (32, 1, 1),
        0,
        &[KernelArg::Buffer(&out), KernelArg::U64(1)],
    );
    assert!(matches!(r, Err(DeviceError::InvalidBuffer { .. })), "{r:?}");
    drop(m);
    assert!(dev.take_sticky_error(CORE).is_none());
}

/// Row-major reference: C = A[m,k] · op(B) (+ beta C).
fn host_gemm(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], bt: bool) -> Vec<f32> {
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let bv = if bt { b[j * k + p] } else { b[p * n + j] };
                c[i * n + j] += a[i * k + p] as f64 * bv as f64;
            }
        }
    }
    c.into_iter().map(|v| v as f32).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgemm_is_row_major_in_both_layouts_and_captures() {
    let (dev, mut g) = device();
    dev.init_cublas().unwrap();
    let (m, n, k) = (5usize, 7usize, 33usize);
    let a: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
        .collect();
    let (ap, bp) = (upload(&mut g, &a), upload(&mut g, &b));
    let cp = upload(&mut g, &vec![0.0; m * n]);
    for bt in [false, true] {
        let want = host_gemm(m, n, k, &a, &b, bt);
        let gemm = Sgemm {
            m,
            n,
            k,
            a: Operand::new(&ap),
            b: Operand::new(&bp),
            c: Operand::new(&cp),
            b_transposed: bt,
            alpha: 1.0,
            beta: 0.0,
        };
        dev.sgemm(&gemm).unwrap();
        let got = g.read_f32(&cp).unwrap();
        for (v, w) in got.iter().zip(&want) {
            assert!((v - w).abs() < 1e-4, "b_transposed={bt}: {v} vs {w}");
        }
        // beta = 1 accumulates.
        dev.sgemm(&Sgemm { beta: 1.0, ..gemm }).unwrap();
        let twice = g.read_f32(&cp).unwrap();
        for (t, w) in twice.iter().zip(&want) {
            assert!((t - 2.0 * w).abs() < 2e-4);
        }
    }

    // Captured: the graph replays the product on the memory's current values.
    let gemm = Sgemm {
        m,
        n,
        k,
        a: Operand::new(&ap),
        b: Operand::new(&bp),
        c: Operand::new(&cp),
        b_transposed: false,
        alpha: 1.0,
        beta: 0.0,
    };
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    dev.sgemm(&gemm).unwrap();
    let graph = dev.end_capture(CORE).unwrap();
    let a2: Vec<f32> = a.iter().map(|v| v * 2.0).collect();
    g.write_f32(&ap, &a2).unwrap();
    dev.launch(CORE, &graph).unwrap();
    let got = g.read_f32(&cp).unwrap();
    let want = host_gemm(m, n, k, &a2, &b, false);
    for (v, w) in got.iter().zip(&want) {
        assert!((v - w).abs() < 2e-4);
    }
    // Bit-identical to the eager call of the same product.
    dev.sgemm(&gemm).unwrap();
    assert_eq!(g.read_f32(&cp).unwrap(), got);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn first_sgemm_inside_a_capture_is_a_capture_error() {
    // A fresh device whose handle does not exist yet: creating it would allocate.
    let (dev, mut g) = device();
    let c = upload(&mut g, &[0.0; 4]);
    dev.begin_capture(CORE, CaptureMode::ThreadLocal).unwrap();
    let r = dev.sgemm(&Sgemm {
        m: 2,
        n: 2,
        k: 1,
        a: Operand::new(&c),
        b: Operand::new(&c),
        c: Operand::new(&c),
        b_transposed: false,
        alpha: 1.0,
        beta: 0.0,
    });
    assert!(matches!(r, Err(DeviceError::Capture { .. })), "{r:?}");
    dev.abort_capture(CORE).unwrap();
    dev.init_cublas().unwrap();
}
