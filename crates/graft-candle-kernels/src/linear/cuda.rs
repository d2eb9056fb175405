//! The matrix-vector kernel: 1 to 8 warps per output (per gate-and-up pair for SwiGLU; by the
//! shapes, see `split`), 8 warps a block. Each lane strides the weight row with 16-byte loads
//! when the row length is a multiple of 16 bytes and `x` and every weight start 16-byte
//! aligned (element loads otherwise), four loads in flight before any is used (one at a time
//! ran at 0.8–1.4 TB/s on an H200), and keeps one f32 sum per input row (instantiated for 1
//! and 2 rows); the warp reduces them with shuffles and the output's first warp adds the
//! others' through shared memory. The weights and biases are passed by address (up to three
//! side by side), so none is copied. `decode_step` also runs it with a norm (a `_norm`
//! instantiation: the norm's weight folds into the weights as they load) and with a residual
//! add, as a programmatic dependent that asks L2 for its whole weight rows before its wait.
//! Registers decide how many blocks share a multiprocessor, so each variant keeps only what
//! it uses live: holding a round of weights across the wait, or unpacking a whole round at
//! once, doubled them and slowed every projection. A round's x is loaded beside its weights,
//! before any is used (56 registers for one row without a norm, 76 for gate and up with one,
//! under ptxas for sm_90): loaded chunk by chunk, each L2 latency was paid in turn.
//!
//! From 3 to [`TENSOR_ROWS`] rows in bf16 and f16 the tensor-core kernel (`rows.cu`) runs
//! instead, with the same arguments: tiles of 8 outputs, 1 to 8 warps a tile (`rows_split`),
//! no norm (`decode_step` norms the rows first). Which of the two runs depends on the rows,
//! the dtype and the 16-byte alignment only.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t;
use candle_core::cuda_backend::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice, Map1};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, WithDType};

use super::gemms::Gemms;
use super::{Dims, MATVEC_ROWS, MAX_PARTS, Matvec, OP, TENSOR_ROWS};
use crate::nvrtc::{Args, Kernels, address, capability, view};
use crate::{KernelError, check};

/// Warps per block.
const WARPS: u32 = 8;

/// Warps per output (1, 2, 4 or 8, dividing [`WARPS`]): enough that `n` outputs make about
/// 16,384 warps (a few waves of every multiprocessor, each with its loads in flight: 2,048
/// outputs of one warp each read at 1.6 TB/s on an H200), but no warp with less than 1,024
/// columns of the row (one round of its loads). Targets of 8,192 and 4,096 warps (more
/// rounds per warp, the next round prefetched into L2) made the ~1B Llama's decode step no
/// faster (1,299 and 1,308 µs against 1,274 and 1,301 µs, one H200, one call).
fn split(n: usize, k: usize) -> u32 {
    let want = 16_384usize.div_ceil(n.max(1));
    let most = (k / 1024).max(1);
    let s = want.min(most).min(WARPS as usize);
    // The largest power of two not above it.
    1 << s.ilog2()
}

static KERNELS: Kernels = Kernels::native("graft_kernels_matvec", include_str!("matvec.cu"));
static ROWS_KERNELS: Kernels = Kernels::native("graft_kernels_rows", include_str!("rows.cu"));

/// One matrix-vector launch's operands, by device address (see `matvec.cu`).
pub(crate) struct MatvecLaunch {
    /// `[rows, k]` input.
    pub(crate) x: u64,
    /// Up to three weights side by side (a missing one repeats the first; never read).
    pub(crate) w: [u64; MAX_PARTS],
    /// Their biases (read where `bias_mask` has the part's bit).
    pub(crate) b: [u64; MAX_PARTS],
    pub(crate) bias_mask: u32,
    /// Each row's sigmoid gate, or 0.
    pub(crate) gate: u64,
    /// The RMS norm's weight `[k]` applied to x first, or 0; and its epsilon.
    pub(crate) norm: u64,
    pub(crate) eps: f32,
    /// `[rows, n]` output.
    pub(crate) y: u64,
    pub(crate) rows: usize,
    pub(crate) k: usize,
    pub(crate) ns: [usize; MAX_PARTS],
    /// SwiGLU of the first two weights' outputs.
    pub(crate) pair: bool,
    /// Add the output to what `y` holds.
    pub(crate) residual: bool,
}

impl MatvecLaunch {
    /// Outputs per row.
    fn n(&self) -> usize {
        if self.pair {
            self.ns[0]
        } else {
            self.ns.iter().sum()
        }
    }

    /// Launches the kernel for dtype `T` on `stream`, as a programmatic dependent when
    /// `dependent`.
    ///
    /// # Safety
    /// `x` holds rows * k elements of T, weight i ns[i] * k and its bias ns[i], the gates rows
    /// or none (0), the norm k or none (0), `y` rows * n; all device memory of `device` alive
    /// until the kernel has run; rows <= TENSOR_ROWS (<= MATVEC_ROWS unless bf16 or f16 with
    /// k a multiple of 8 and every operand 16-byte aligned, else an error); a weight of 0 rows and a bias whose mask
    /// bit is 0 are never read. With `residual`, `y` holds the values added to.
    pub(crate) unsafe fn launch<T: WithDType>(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        dependent: bool,
    ) -> Result<()> {
        debug_assert!(self.rows <= TENSOR_ROWS);
        let parts = self.ns.iter().filter(|&&n| n > 0).count().max(1);
        let vec = (self.k * size_of::<T>()).is_multiple_of(16)
            && self.x.is_multiple_of(16)
            && self.norm.is_multiple_of(16)
            && self.w[..parts].iter().all(|a| a.is_multiple_of(16));
        let half = matches!(T::DTYPE, DType::BF16 | DType::F16) && has_tensor_cores(device)?;
        let n = self.n();
        let pair = if self.pair { "_swiglu" } else { "" };
        let dtype = T::DTYPE.as_str();
        // Up to 2 rows the matrix-vector kernel (the smallest instantiation holding the rows;
        // element loads only at 2), above it the tensor-core kernel where its loads fit.
        let tensor = self.rows > MATVEC_ROWS;
        let (kernels, name, split) = if !tensor {
            let variant = match (vec, self.rows) {
                (false, _) => "scalar2",
                (true, 1) => "vec1",
                (true, _) => "vec2",
            };
            let norm = if self.norm != 0 { "_norm" } else { "" };
            let name = format!("graft_matvec_{variant}{pair}{norm}_{dtype}");
            (&KERNELS, name, split(n, self.k))
        } else if half && vec && self.norm == 0 {
            let rounds = self.k.div_ceil(32).div_ceil(if self.pair { 4 } else { 8 });
            let split = rows_split(n.div_ceil(8), rounds);
            let kind = if self.pair { "swiglu" } else { "plain" };
            (&ROWS_KERNELS, format!("graft_rows_{kind}_{dtype}"), split)
        } else {
            return Err(KernelError::Unaligned {
                op: OP,
                input: "x, a weight or the norm",
                rows: self.rows,
            }
            .into());
        };
        // Outputs (tiles of 8 on tensor cores) per block: one per `split` warps.
        let per_block = (WARPS / split) as usize * if tensor { 8 } else { 1 };
        let blocks = check::u32_of(OP, "the blocks", n.div_ceil(per_block))?;
        let [n0, n1, n2] = self.ns.map(|v| v as u32);
        let (rows, k) = (self.rows as u32, self.k as u32);
        let residual = u32::from(self.residual);
        let mut args = Args::new();
        args.arg(&self.x);
        for a in &self.w {
            args.arg(a);
        }
        for a in &self.b {
            args.arg(a);
        }
        args.arg(&self.gate)
            .arg(&self.norm)
            .arg(&self.eps)
            .arg(&self.y)
            .arg(&rows)
            .arg(&k)
            .arg(&n0)
            .arg(&n1)
            .arg(&n2)
            .arg(&self.bias_mask)
            .arg(&split)
            .arg(&residual);
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_matvec_<variant>_<dtype>` and
        // `graft_rows_<plain|swiglu>_<dtype>` alike (const T* x9, float, T*, unsigned int x8), every
        // buffer by address, as the caller guarantees; rows <= 2 on the matrix-vector kernel
        // and <= 16 on the tensor-core one (each kernel's sums per lane and in shared memory,
        // static), which takes no norm (null); `split` divides the block's 8 warps; the 16-byte loads run only when
        // k * size_of::<T>() is a multiple of 16 and x, the norm and every weight start
        // 16-byte aligned, so every row does too; each kernel waits (`graft_pdl_wait`) before
        // it reads x, the gates or y, touching only the weights before.
        unsafe { kernels.launch(device, stream, &name, config, dependent, &mut args) }
    }
}

/// Whether `device` runs the tensor-core kernel (`mma.sync` in bf16 and f16: compute
/// capability 8.0 or later).
pub(crate) fn has_tensor_cores(device: &CudaDevice) -> Result<bool> {
    Ok(capability(OP, device)?.0 >= 8)
}

/// Warps per tile of 8 outputs on tensor cores (1, 2, 4 or 8, dividing [`WARPS`]): enough
/// that the tiles make about 16,384 warps, but never more than the tile has rounds of loads
/// (so no warp idles).
fn rows_split(tiles: usize, rounds: usize) -> u32 {
    let want = 16_384usize.div_ceil(tiles.max(1));
    let s = want.min(rounds.max(1)).min(WARPS as usize);
    1 << s.ilog2()
}

/// The op's `[rows, n]` output on CUDA.
pub(super) fn forward(op: &Matvec, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = op.map(&x.slice, &device, xl)?;
    Ok((CudaStorage { slice, device }, op.dims.out_shape()))
}

impl Map1 for Matvec {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        device: &CudaDevice,
        xl: &Layout,
    ) -> Result<CudaSlice<T>> {
        let d = self.dims;
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
        // SAFETY: the kernel writes all `rows * n` elements (the grid covers every output
        // `j < n`, and lane r of its first warp writes row r's for every r < rows) before
        // anything reads them: it is launched below on the device's stream.
        let y = unsafe { device.alloc::<T>(d.rows * d.n())? };
        let y_at = y.device_ptr(&stream).0;
        // Each row's sigmoid gate, or 0 (none).
        let gate = match &self.gate {
            Some(g) => address(OP, g, "gate", device)?,
            None => 0,
        };
        let launch = MatvecLaunch {
            x: x_at,
            w,
            b,
            bias_mask,
            gate,
            norm: 0,
            eps: 0.0,
            y: y_at,
            rows: d.rows,
            k: d.k,
            ns: d.ns,
            pair: d.pair,
            residual: false,
        };
        // On the side stream, ordered after `y`'s allocation and everything before it.
        let stream = self.side.launch_stream(device)?;
        // SAFETY: `x` holds rows * k elements, weight i n_i * k and its bias n_i, the gates
        // rows or none (checked by the wrapper, contiguous, of T; the op holds clones, so all
        // live; on a side stream the caller keeps them until it joins), `y` rows * n (just
        // allocated); rows <= TENSOR_ROWS (the wrapper's choice of this path).
        unsafe { launch.launch::<T>(device, &stream, false) }?;
        Ok(y)
    }
}

/// The [`Gemms`] op's output on CUDA: one cuBLAS GEMM per weight, written into its columns.
pub(super) fn gemms(op: &Gemms, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let slice = match &x.slice {
        CudaStorageSlice::F32(s) => CudaStorageSlice::F32(gemms_of(op, s, xl, &device)?),
        CudaStorageSlice::BF16(s) => CudaStorageSlice::BF16(gemms_of(op, s, xl, &device)?),
        CudaStorageSlice::F16(s) => CudaStorageSlice::F16(gemms_of(op, s, xl, &device)?),
        _ => {
            return Err(KernelError::UnsupportedDType {
                op: OP,
                input: "x",
                got: x.dtype(),
            }
            .into());
        }
    };
    Ok((CudaStorage { slice, device }, op.dims.out_shape()))
}

/// [`gemms`] for dtype `T`. In cuBLAS's column-major terms weight i's columns of the output
/// (`[rows, total]` row-major: `total x rows`, leading dimension `total`, from row `at`) are
/// `w_iᵀ · x`, with `w_i` (`[n_i, k]` row-major) read as `k x n_i` and transposed and `x`
/// (`[rows, k]`) as `k x rows`.
fn gemms_of<T>(
    op: &Gemms,
    x: &CudaSlice<T>,
    xl: &Layout,
    device: &CudaDevice,
) -> Result<CudaSlice<T>>
where
    T: WithDType + CudaDType + DeviceRepr,
    CudaBlas: Gemm<T>,
{
    let Dims { rows, k, ns, .. } = op.dims;
    let total = op.dims.n();
    let c_int = |what, size: usize| -> Result<i32> {
        i32::try_from(size).map_err(|_| KernelError::TooLarge { op: OP, what, size }.into())
    };
    let (rows_c, k_c, total_c) = (
        c_int("the rows", rows)?,
        c_int("the weights' columns", k)?,
        c_int("the outputs per row", total)?,
    );
    let x = view(OP, "x", x, xl)?;
    // SAFETY: the GEMMs below write weight i's n_i columns of every row, and the n_i sum to
    // `total`: every element is written, on the device's stream, before anything reads it.
    let mut y = unsafe { device.alloc::<T>(rows * total)? };
    let blas = device.cublas_handle();
    let mut at = 0;
    for (w, &n) in op.weights.iter().zip(&ns) {
        let (storage, wl) = w.storage_and_layout();
        let Storage::Cuda(ws) = &*storage else {
            return Err(KernelError::Device { op: OP, input: "w" }.into());
        };
        let w = view(OP, "w", ws.as_cuda_slice::<T>()?, wl)?;
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: c_int("a weight's rows", n)?,
            n: rows_c,
            k: k_c,
            alpha: T::from_f64(1.0),
            lda: k_c,
            ldb: k_c,
            beta: T::from_f64(0.0),
            ldc: total_c,
        };
        let mut columns = y.slice_mut(at..);
        // SAFETY: `w` holds n * k elements (checked `[n, k]` and contiguous by the wrapper),
        // `x` rows * k; the output from element `at` holds (rows - 1) * total + n elements
        // (at + n <= total), every one the GEMM writes; all of `device`, used on its stream,
        // which the handle is bound to.
        unsafe { blas.gemm(cfg, &w, &x, &mut columns) }.map_err(candle_core::Error::wrap)?;
        at += n;
    }
    Ok(y)
}
