//! The matrix-vector kernel: 1 to 8 warps per output (per gate-and-up pair for SwiGLU; by the
//! shapes, see `split`), 8 warps a block. Each lane strides the weight row with 16-byte loads
//! when the row length is a multiple of 16 bytes and `x` and every weight start 16-byte
//! aligned (element loads otherwise), four loads in flight before any is used (one at a time
//! ran at 0.8–1.4 TB/s on an H200), and keeps one f32 sum per input row (instantiated for 1
//! and 2 rows); the warp reduces them with shuffles and the output's first warp adds the
//! others' through shared memory. The weights and biases are passed by address (up to three
//! side by side), so none is copied.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map1, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::{MATVEC_ROWS, MAX_PARTS, Matvec, OP};
use crate::check;
use crate::nvrtc::{Kernels, address, view};

/// Warps per block.
const WARPS: u32 = 8;

/// Warps per output (1, 2, 4 or 8, dividing [`WARPS`]): enough that `n` outputs make about
/// 16,384 warps (a few waves of every multiprocessor, each with its loads in flight: 2,048
/// outputs of one warp each read at 1.6 TB/s on an H200), but no warp with less than 1,024
/// columns of the row (one round of its loads).
fn split(n: usize, k: usize) -> u32 {
    let want = 16_384usize.div_ceil(n.max(1));
    let most = (k / 1024).max(1);
    let s = want.min(most).min(WARPS as usize);
    // The largest power of two not above it.
    1 << s.ilog2()
}

static KERNELS: Kernels = Kernels::new(
    "graft_kernels_matvec",
    r#"
// 16-byte chunks of a weight row each lane loads before using any.
#define GRAFT_MATVEC_U 4

// Output j of row r: x[r] . (row j of the weights side by side) + its bias; with PAIR,
// silu(x[r] . gate[j]) * (x[r] . up[j]) (gate = w0, up = w1). `split` warps per j (a block's 8
// warps serve 8 / split outputs), each summing every split-th 32-chunk stretch of the row; the
// first warp of each output adds the others' sums from shared memory. ROWS >= rows.
template <typename T, int ROWS, bool VEC, bool PAIR>
__device__ void graft_matvec(const T* __restrict__ x, const T* w0, const T* w1, const T* w2,
                             const T* b0, const T* b1, const T* b2, const T* gate,
                             T* __restrict__ y, unsigned int rows, unsigned int k,
                             unsigned int n0, unsigned int n1, unsigned int n2,
                             unsigned int bias_mask, unsigned int split) {
    __shared__ float partial[8][2 * ROWS];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int j = blockIdx.x * ((blockDim.x >> 5) / split) + warp / split;
    const unsigned int part = warp % split;
    const unsigned int n = PAIR ? n0 : n0 + n1 + n2;
    const bool active = j < n;
    // The weight row (and bias) of output j: uniform over the warp.
    const T* wa = w0;
    const T* bias = 0;
    if (!active) {
    } else if (PAIR || j < n0) {
        wa = w0 + (unsigned long long)j * k;
        bias = (bias_mask & 1u) ? b0 + j : 0;
    } else if (j < n0 + n1) {
        wa = w1 + (unsigned long long)(j - n0) * k;
        bias = (bias_mask & 2u) ? b1 + (j - n0) : 0;
    } else {
        wa = w2 + (unsigned long long)(j - n0 - n1) * k;
        bias = (bias_mask & 4u) ? b2 + (j - n0 - n1) : 0;
    }
    const T* wb = PAIR && active ? w1 + (unsigned long long)j * k : wa;
    float a0[ROWS];
    float a1[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        a0[r] = 0.0f;
        a1[r] = 0.0f;
    }
    if (!active) {
    } else if (VEC) {
        // GRAFT_MATVEC_U 16-byte chunks of the row per lane in flight: all loads of a round
        // are issued before any is used, then each is unpacked once for every input row.
        const unsigned int E = GraftVec<T>::E;
        const unsigned int chunks = k / E;
        const unsigned int stride = 32u * split;
        const uint4* wa4 = reinterpret_cast<const uint4*>(wa);
        const uint4* wb4 = reinterpret_cast<const uint4*>(wb);
        for (unsigned int base = 32u * part + lane; base < chunks;
             base += stride * GRAFT_MATVEC_U) {
            uint4 raw0[GRAFT_MATVEC_U];
            uint4 raw1[GRAFT_MATVEC_U];
#pragma unroll
            for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
                const unsigned int c = base + stride * u;
                const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                raw0[u] = c < chunks ? __ldg(wa4 + c) : zero;
                raw1[u] = PAIR && c < chunks ? __ldg(wb4 + c) : zero;
            }
            float f0[GRAFT_MATVEC_U][GraftVec<T>::E];
            float f1[GRAFT_MATVEC_U][GraftVec<T>::E];
#pragma unroll
            for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
                GraftVec<T>::unpack(raw0[u], f0[u]);
                if (PAIR) {
                    GraftVec<T>::unpack(raw1[u], f1[u]);
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (unsigned long long)r * k);
#pragma unroll
                    for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
                        const unsigned int c = base + stride * u;
                        if (c < chunks) {
                            float fx[GraftVec<T>::E];
                            GraftVec<T>::unpack(__ldg(xr + c), fx);
#pragma unroll
                            for (unsigned int e = 0; e < E; ++e) {
                                a0[r] += fx[e] * f0[u][e];
                                if (PAIR) {
                                    a1[r] += fx[e] * f1[u][e];
                                }
                            }
                        }
                    }
                }
            }
        }
    } else {
        for (unsigned int i = 32u * part + lane; i < k; i += 32u * split) {
            const float f0 = graft_to_f32(wa[i]);
            const float f1 = PAIR ? graft_to_f32(wb[i]) : 0.0f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rows) {
                    const float fx = graft_to_f32(x[(unsigned long long)r * k + i]);
                    a0[r] += fx * f0;
                    if (PAIR) {
                        a1[r] += fx * f1;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float s0 = graft_warp_sum(a0[r]);
        const float s1 = PAIR ? graft_warp_sum(a1[r]) : 0.0f;
        if (lane == 0) {
            partial[warp][r] = s0;
            partial[warp][ROWS + r] = s1;
        }
    }
    __syncthreads();
    // Lane r of each output's first warp sums row r over the output's warps and writes it.
    if (active && part == 0 && lane < rows) {
        float s0 = 0.0f;
        float s1 = 0.0f;
        for (unsigned int q = 0; q < split; ++q) {
            s0 += partial[warp + q][lane];
            s1 += partial[warp + q][ROWS + lane];
        }
        float out = s0;
        if (PAIR) {
            out = s0 / (1.0f + expf(-s0)) * s1;
        } else if (bias) {
            out += graft_to_f32(*bias);
        }
        if (gate) {
            out = out / (1.0f + expf(-graft_to_f32(gate[lane])));
        }
        y[(unsigned long long)lane * n + j] = graft_from_f32<T>(out);
    }
}

#define GRAFT_MATVEC_ONE(suffix, T, name, ROWS, VEC, PAIR)                                   \
    extern "C" __global__ void graft_matvec_##name##_##suffix(                               \
        const T* x, const T* w0, const T* w1, const T* w2, const T* b0, const T* b1,         \
        const T* b2, const T* gate, T* y, unsigned int rows, unsigned int k,                 \
        unsigned int n0, unsigned int n1, unsigned int n2, unsigned int bias_mask,           \
        unsigned int split) {                                                                \
        graft_matvec<T, ROWS, VEC, PAIR>(x, w0, w1, w2, b0, b1, b2, gate, y, rows, k, n0,    \
                                         n1, n2, bias_mask, split);                          \
    }
#define GRAFT_MATVEC(suffix, T)                                                              \
    GRAFT_MATVEC_ONE(suffix, T, vec1, 1, true, false)                                        \
    GRAFT_MATVEC_ONE(suffix, T, vec2, 2, true, false)                                        \
    GRAFT_MATVEC_ONE(suffix, T, scalar2, 2, false, false)                                    \
    GRAFT_MATVEC_ONE(suffix, T, vec1_swiglu, 1, true, true)                                  \
    GRAFT_MATVEC_ONE(suffix, T, vec2_swiglu, 2, true, true)                                  \
    GRAFT_MATVEC_ONE(suffix, T, scalar2_swiglu, 2, false, true)
GRAFT_FOR_DTYPES(GRAFT_MATVEC)
"#,
);

/// The op's `[rows, n]` output on CUDA.
pub(super) fn forward(op: &Matvec, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = op.map(&x.slice, &device, xl)?;
    Ok((CudaStorage { slice, device }, op.out_shape()))
}

impl Map1 for Matvec {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        device: &CudaDevice,
        xl: &Layout,
    ) -> Result<CudaSlice<T>> {
        let d = self.dims;
        debug_assert!(d.rows <= MATVEC_ROWS);
        let x = view(OP, "x", x, xl)?;
        let stream = device.cuda_stream();
        let x_at = x.device_ptr(&stream).0;
        // Each weight's and bias's address; a missing weight or bias repeats the first weight's
        // (never read: its rows are 0, its bit of the mask is 0).
        let mut w = [0u64; MAX_PARTS];
        let mut b = [0u64; MAX_PARTS];
        let mut bias_mask = 0u32;
        for (i, (wi, bi)) in self.parts.iter().enumerate() {
            w[i] = address(OP, wi, "w", device)?;
            if let Some(bi) = bi {
                b[i] = address(OP, bi, "bias", device)?;
                bias_mask |= 1 << i;
            }
        }
        for i in 0..MAX_PARTS {
            if i >= self.parts.len() {
                w[i] = w[0];
            }
            if bias_mask & (1 << i) == 0 {
                b[i] = w[0];
            }
        }
        let vec = (d.k * size_of::<T>()).is_multiple_of(16)
            && x_at.is_multiple_of(16)
            && w[..self.parts.len()].iter().all(|a| a.is_multiple_of(16));
        let n = d.n();
        // SAFETY: the kernel writes all `rows * n` elements (the grid covers every output
        // `j < n`, and lane r of its first warp writes row r's for every r < rows) before
        // anything reads them: it is launched below on the device's stream.
        let mut y = unsafe { device.alloc::<T>(d.rows * n)? };
        // The smallest instantiation holding the rows (the element loads only at 2).
        let variant = match (vec, d.rows) {
            (false, _) => "scalar2",
            (true, 1) => "vec1",
            (true, _) => "vec2",
        };
        let name = format!(
            "graft_matvec_{variant}{}_{}",
            if d.pair { "_swiglu" } else { "" },
            T::DTYPE.as_str()
        );
        let func = device.get_or_load_custom_func(&name, KERNELS.module(), KERNELS.ptx()?)?;
        // Each row's sigmoid gate, or 0 (none).
        let gate = match &self.gate {
            Some(g) => address(OP, g, "gate", device)?,
            None => 0,
        };
        let split = split(n, d.k);
        let per_block = (WARPS / split) as usize;
        let blocks = check::u32_of(OP, "the outputs / 8", n.div_ceil(per_block))?;
        let [n0, n1, n2] = d.ns.map(|v| v as u32);
        let (rows, k) = (d.rows as u32, d.k as u32);
        // On the side stream, ordered after `y`'s allocation and everything before it.
        let stream = self.side.launch_stream(device)?;
        let mut launch = stream.launch_builder(&func);
        launch.arg(&x);
        for a in &w {
            launch.arg(a);
        }
        for a in &b {
            launch.arg(a);
        }
        launch.arg(&gate);
        launch.arg(&mut y);
        launch.arg(&rows);
        launch.arg(&k);
        launch.arg(&n0);
        launch.arg(&n1);
        launch.arg(&n2);
        launch.arg(&bias_mask);
        launch.arg(&split);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_matvec_<variant>_<dtype>(const T* x8, T*,
        // unsigned int x7)`, the weights, biases and gates passed by address: `x` holds rows *
        // k elements, weight i n_i * k and its bias n_i, the gates rows or none (0) (checked by
        // the wrapper, contiguous, of T; the op holds clones, so all live; on a side stream the
        // caller keeps them until it joins), `y` rows * n; rows <= 2 (the kernel's sums
        // per lane); `split` divides the block's 8 warps (the shared sums are 8 warps' of
        // 2 * ROWS); a weight of 0 rows and a bias whose mask bit is 0 are never read; the
        // 16-byte loads run only when k * size_of::<T>() is a multiple of 16 and x and every
        // weight start 16-byte aligned, so every row does too.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(y)
    }
}
