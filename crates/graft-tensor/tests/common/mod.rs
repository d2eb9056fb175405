//! Shared test support: run one test body on the simulator (always) and on CUDA (ignored
//! without a GPU), and compare against plain Rust references.
#![allow(dead_code, unreachable_pub)]

use graft_core::{Config, Graft};
use graft_cuda::CudaDevice;
use graft_tensor::{Backend, Meta, Tensor};

/// One CUDA device per test process.
pub fn cuda() -> CudaDevice {
    static DEVICE: std::sync::OnceLock<CudaDevice> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| CudaDevice::new(0).expect("a CUDA GPU is required for the ignored tests"))
        .clone()
}

/// Defines `mod $body { sim, cuda }` running `fn $body<D: Backend>(D)` on each backend.
#[macro_export]
macro_rules! backend_test {
    ($body:ident) => {
        mod $body {
            #[test]
            fn sim() {
                super::$body(graft_sim::SimDevice::new());
            }
            #[test]
            #[ignore = "needs a CUDA GPU"]
            fn cuda() {
                super::$body(super::common::cuda());
            }
        }
    };
}

pub fn graft<D: Backend>(device: D) -> Graft<D, Meta> {
    Graft::new(device, Config::default())
}

pub fn f32s<D: Backend>(g: &mut Graft<D, Meta>, shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_f32(g, shape, data).unwrap()
}

pub fn i32s<D: Backend>(g: &mut Graft<D, Meta>, shape: &[usize], data: &[i32]) -> Tensor {
    Tensor::from_i32(g, shape, data).unwrap()
}

pub fn read<D: Backend>(g: &Graft<D, Meta>, t: &Tensor) -> Vec<f32> {
    t.to_vec_f32(g.device()).unwrap()
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}
