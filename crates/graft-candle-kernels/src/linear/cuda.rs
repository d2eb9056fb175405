//! The matrix-vector kernel: 1 to 8 warps per output (per gate-and-up pair for SwiGLU; by the
//! shapes, see `split`), 8 warps a block. Each lane strides the weight row with 16-byte loads
//! when the row length is a multiple of 16 bytes and `x` and every weight start 16-byte
//! aligned (element loads otherwise), four loads in flight before any is used (one at a time
//! ran at 0.8–1.4 TB/s on an H200), and keeps one f32 sum per input row (instantiated for 1
//! and 2 rows); the warp reduces them with shuffles and the output's first warp adds the
//! others' through shared memory. The weights and biases are passed by address (up to three
//! side by side), so none is copied. `decode_step` also runs it with a norm (a `_norm`
//! instantiation: the norm's weight folds into the weights as they load) and with a residual
//! add, as a programmatic dependent that prefetches its first weights into L2 before its wait.
//! Registers decide how many blocks share a multiprocessor, so each variant keeps only what
//! it uses live (40 registers a thread for one row without a norm, 64 for gate and up with
//! one, under ptxas for sm_90): holding a round of weights across the wait, or unpacking a
//! whole round at once, doubled that and slowed every projection.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map1};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::{MATVEC_ROWS, MAX_PARTS, Matvec, OP};
use crate::check;
use crate::nvrtc::{Args, Kernels, address, view};

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

static KERNELS: Kernels =
    Kernels::with_dependents("graft_kernels_matvec", include_str!("matvec.cu"));

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
    /// until the kernel has run; rows <= MATVEC_ROWS; a weight of 0 rows and a bias whose mask
    /// bit is 0 are never read. With `residual`, `y` holds the values added to.
    pub(crate) unsafe fn launch<T: WithDType>(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        dependent: bool,
    ) -> Result<()> {
        debug_assert!(self.rows <= MATVEC_ROWS);
        let parts = self.ns.iter().filter(|&&n| n > 0).count().max(1);
        let vec = (self.k * size_of::<T>()).is_multiple_of(16)
            && self.x.is_multiple_of(16)
            && self.norm.is_multiple_of(16)
            && self.w[..parts].iter().all(|a| a.is_multiple_of(16));
        let n = self.n();
        // The smallest instantiation holding the rows (the element loads only at 2).
        let variant = match (vec, self.rows) {
            (false, _) => "scalar2",
            (true, 1) => "vec1",
            (true, _) => "vec2",
        };
        let name = format!(
            "graft_matvec_{variant}{}{}_{}",
            if self.pair { "_swiglu" } else { "" },
            if self.norm != 0 { "_norm" } else { "" },
            T::DTYPE.as_str()
        );
        let split = split(n, self.k);
        let per_block = (WARPS / split) as usize;
        let blocks = check::u32_of(OP, "the outputs / 8", n.div_ceil(per_block))?;
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
        // SAFETY: the arguments match `graft_matvec_<variant>_<dtype>(const T* x9, float, T*,
        // unsigned int x8)`, every buffer by address, as the caller guarantees; with a norm
        // the dynamic shared memory holds the rows * k normed elements the kernel writes and
        // reads (at most NORMED_ROWS_BYTES, under the 48 KiB a launch has without opting in);
        // rows <= 2
        // (the kernel's sums per lane); `split` divides the block's 8 warps (the shared sums
        // are 8 warps' of 2 * ROWS); the 16-byte loads run only when k * size_of::<T>() is a
        // multiple of 16 and x, the norm and every weight start 16-byte aligned, so every row
        // does too; the kernel waits (`graft_pdl_wait`) before it reads x or y, touching only
        // the weights, biases and norm before.
        unsafe { KERNELS.launch(device, stream, &name, config, dependent, &mut args) }
    }
}

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
        // allocated); rows <= MATVEC_ROWS (the wrapper's choice of this path).
        unsafe { launch.launch::<T>(device, &stream, false) }?;
        Ok(y)
    }
}
