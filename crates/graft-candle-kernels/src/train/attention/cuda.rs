//! The causal attention launches (kernels in `causal_attention.cu`): 128 threads (4 warps) a
//! block, static shared memory only (at most 44 KiB), every launch configuration from the
//! shapes (and the device's multiprocessor count) alone, never from the data.
//!
//! Each kernel has configurations of R rows (or keys) a warp and so 4R a block: many rows
//! (R = 8 or 4 at head dim 64; at 128, 4 for the forward pass and 2 for the backward
//! kernels), which share every staged key or query tile among more rows, and one row (R = 1),
//! with more blocks. A launch takes the most rows that still make [`MIN_BLOCKS_PER_SM`]
//! blocks per multiprocessor (one row when none does): a block walks its tiles serially, so a
//! small grid (one short sequence, few heads) leaves most of the GPU idle. Either way every
//! output element is written by one thread, its sums in one fixed order (no atomics): on one
//! device, the same inputs give bitwise the same results.
//!
//! - `graft_causal_attention_forward_<dtype>_<hd>_r<R>`: grid (ceil(seq / 4R), heads, batch),
//!   the last query tile first; a block's 4R query rows (R a warp) attend to key tiles of 32
//!   (lane = key for the scores, an online softmax per row, lane = output dims for p·v); it
//!   writes the output and each row's log-sum-exp.
//! - `graft_causal_attention_dq_<dtype>_<hd>_r<R>`: grid (ceil(seq / 4R), heads, batch); the
//!   same walk over key tiles, recomputing the weights from the log-sum-exps; it writes dq and
//!   each row's `delta = rowsum(dO * O)`.
//! - `graft_causal_attention_dkv_<dtype>_<hd>_r<R>`: grid (ceil(seq / 4R), kv_heads, batch),
//!   4R keys a block; for each query head of the group, query tiles of 32 from the block's
//!   first key to the end (lane = query row for the weights, lane = dims for the sums); it
//!   writes dk and dv, each element by one thread (no atomics).
//!
//! At seq 128, head dim 64, 8 query heads on 4 KV heads and 132 multiprocessors (264 blocks
//! enough): forward and dq take one row a warp at batch 1 (256 blocks), 4 at batch 8 (512),
//! 8 at batch 32 (1024); dkv one key a warp at batches 1 and 8 (128 and 1024 blocks), 8 at
//! batch 32 (512).
//!
//! bf16 and f16, and f32 at head dim 64 where the grid has [`MIN_BLOCKS_PER_SM`] blocks per
//! multiprocessor, on compute capability 8.0 or later take the tensor-core twins instead (`causal_attention_tc.cu`,
//! `graft_causal_attention_tc_<kernel>_<dtype>_<hd>`, compiled for the device's
//! architecture): the same parameters and outputs, 64 rows (or keys) a block and 16 a warp,
//! grid (ceil(seq / 64), heads or kv_heads, batch), products with f32 sums; in bf16 and f16 as
//! m16n8k16 steps, the weights and their gradients rounded to the input's type before they
//! multiply (as flash attention's kernels do), in f32 as three TF32 products a step, about
//! f32's precision (TF32 alone would keep 10 bits of each operand, and f32 training here runs
//! with TF32 off). Each output element is still written once, in one fixed order.

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, Map3, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, WithDType};

use super::{AttentionDkv, AttentionDq, CausalAttention, Dims, OP};
use crate::check;
use crate::nvrtc::{Args, Kernels, address, capability, view};

/// The kernels' source (`causal_attention.cu`): the forward pass (online softmax over key
/// tiles, the row log-sum-exps kept), the query gradient (with each row's `rowsum(dO * O)`)
/// and the key and value gradients, over token-major q, k, v.
static KERNELS: Kernels = Kernels::new(
    "graft_kernels_causal_attention",
    include_str!("causal_attention.cu"),
);

/// The same three kernels on tensor cores (`causal_attention_tc.cu`), for bf16 and f16 (and
/// f32 at head dim 64) on compute capability 8.0 or later: compiled for the device's
/// architecture.
static TC_KERNELS: Kernels = Kernels::native(
    "graft_kernels_causal_attention_tc",
    include_str!("causal_attention_tc.cu"),
);

/// Rows (or keys) a tensor-core block takes, 16 a warp (the kernels' `GRAFT_CAT_ROWS`).
const TC_ROWS: usize = 64;

/// Warps of every block (the kernels' `GRAFT_CA_WARPS`).
const WARPS: usize = 4;
/// Threads of every block.
const THREADS: u32 = 32 * WARPS as u32;
/// The rows a forward warp may own, most first (the kernels instantiated for the head dim).
fn forward_rows(d: &Dims) -> &'static [usize] {
    if d.head_dim == 64 {
        &[8, 4, 1]
    } else {
        &[4, 1]
    }
}
/// The fewest blocks per multiprocessor of a many-rows grid: below it the launch takes fewer
/// rows a warp. Several blocks (128 threads, at most 44 KiB of shared memory) fit on a
/// multiprocessor at once, so a grid of under 2 a multiprocessor leaves most of its warp slots
/// idle; the one-row blocks stage the same tiles more often, which costs less than that.
const MIN_BLOCKS_PER_SM: usize = 2;

/// The query rows a dq warp and keys a dkv warp may own, most first: 8 or 4 at head dim 64,
/// 2 at 128 (which keeps the kernels' static shared memory under 48 KiB), or 1.
fn backward_rows(d: &Dims) -> &'static [usize] {
    if d.head_dim == 64 {
        &[8, 4, 1]
    } else {
        &[2, 1]
    }
}

/// The device's multiprocessor count (a property of the device, not of any data).
fn multiprocessors(device: &CudaDevice) -> Result<usize> {
    let count = device
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(usize::try_from(count).unwrap_or(1).max(1))
}

/// The sizes the kernels take, as u32.
struct Sizes {
    batch: u32,
    seq: u32,
    heads: u32,
    kv_heads: u32,
}

impl Sizes {
    fn of(d: &Dims) -> Result<Self> {
        Ok(Self {
            batch: check::u32_of(OP, "the batch", d.batch)?,
            seq: check::u32_of(OP, "the sequence length", d.seq)?,
            heads: check::u32_of(OP, "the query head count", d.heads)?,
            kv_heads: check::u32_of(OP, "the KV head count", d.kv_heads)?,
        })
    }
}

/// One launch: the module, the kernel's name and its grid.
struct Plan {
    kernels: &'static Kernels,
    name: String,
    config: LaunchConfig,
}

impl Plan {
    /// Launches the kernel on `stream` (plainly).
    ///
    /// # Safety
    /// As [`Kernels::launch`]: `args` match the kernel's parameters and every address is
    /// memory it may touch, alive until the launch has run.
    unsafe fn run(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        args: &mut Args<'_>,
    ) -> Result<()> {
        // SAFETY: the caller's contract; the configuration is the one `plan` made for this
        // kernel (its block of 4 warps, static shared memory only).
        unsafe {
            self.kernels
                .launch(device, stream, &self.name, self.config, false, args)
        }
    }
}

/// How to launch kernel `kernel` (`forward`, `dq` or `dkv`) over `y` (heads) by `batch`: for
/// bf16 and f16, and f32 at head dim 64 with [`MIN_BLOCKS_PER_SM`] blocks per multiprocessor,
/// on compute capability 8.0 or later, the tensor-core kernel
/// `graft_causal_attention_tc_<kernel>_<dtype>_<head dim>` over `ceil(seq / 64)` tiles;
/// otherwise `graft_causal_attention_<kernel>_<dtype>_<head dim>_r<rows>` over `ceil(seq /
/// (4 * rows))` tiles, with `rows` the first of `choices` (most first, the last 1) whose grid
/// has [`MIN_BLOCKS_PER_SM`] blocks per multiprocessor, or the last.
fn plan(
    kernel: &str,
    dtype: DType,
    d: &Dims,
    choices: &[usize],
    y: u32,
    batch: u32,
    device: &CudaDevice,
) -> Result<Plan> {
    let grid = |tiles: usize| -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (
                check::u32_of(OP, "the sequence's tile count", tiles)?,
                y,
                batch,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    };
    let tiles = |rows: usize| d.seq.div_ceil(WARPS * rows);
    let enough = MIN_BLOCKS_PER_SM.saturating_mul(multiprocessors(device)?);
    let blocks = |rows: usize| {
        tiles(rows)
            .saturating_mul(y as usize)
            .saturating_mul(batch as usize)
    };
    // f32's three products a step make a tensor-core block several times slower than a
    // 16-bit one: it gains only where the grid fills the GPU (as `TC_ROWS / WARPS` rows a warp
    // would), and loses to the CUDA-core kernels' small blocks where it does not.
    let tensor_cores = match dtype {
        DType::BF16 | DType::F16 => true,
        DType::F32 => d.head_dim == 64 && blocks(TC_ROWS / WARPS) >= enough,
        _ => false,
    };
    if tensor_cores && capability(TC_KERNELS.module(), device)?.0 >= 8 {
        return Ok(Plan {
            kernels: &TC_KERNELS,
            name: format!(
                "graft_causal_attention_tc_{kernel}_{}_{}",
                dtype.as_str(),
                d.head_dim
            ),
            config: grid(d.seq.div_ceil(TC_ROWS))?,
        });
    }
    let rows = choices
        .iter()
        .copied()
        .find(|&r| blocks(r) >= enough)
        .or(choices.last().copied())
        .unwrap_or(1);
    Ok(Plan {
        kernels: &KERNELS,
        name: format!(
            "graft_causal_attention_{kernel}_{}_{}_r{rows}",
            dtype.as_str(),
            d.head_dim
        ),
        config: grid(tiles(rows))?,
    })
}

/// `[batch, heads, seq]` f32 as a storage on `device`.
fn rows_storage(slice: CudaSlice<f32>, device: &CudaDevice) -> Storage {
    Storage::Cuda(CudaStorage {
        slice: CudaStorageSlice::F32(slice),
        device: device.clone(),
    })
}

/// The forward pass on CUDA: the output, with the log-sum-exps kept in the op.
pub(super) fn forward(
    op: &CausalAttention,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = q.device.clone();
    let slice = Forward(op).map(&q.slice, ql, &k.slice, kl, &v.slice, vl, &device)?;
    Ok((CudaStorage { slice, device }, op.dims.out_shape()))
}

/// The query gradient on CUDA, with the deltas kept in the op.
pub(super) fn dq(
    op: &AttentionDq,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = q.device.clone();
    let slice = Dq(op).map(&q.slice, ql, &k.slice, kl, &v.slice, vl, &device)?;
    Ok((CudaStorage { slice, device }, op.dims.out_shape()))
}

/// The key and value gradients on CUDA, in one allocation.
pub(super) fn dkv(
    op: &AttentionDkv,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = q.device.clone();
    let slice = Dkv(op).map(&q.slice, ql, &k.slice, kl, &v.slice, vl, &device)?;
    Ok((CudaStorage { slice, device }, op.dims.dkv_shape()))
}

struct Forward<'a>(&'a CausalAttention);

impl Map3 for Forward<'_> {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        q: &CudaSlice<T>,
        ql: &Layout,
        k: &CudaSlice<T>,
        kl: &Layout,
        v: &CudaSlice<T>,
        vl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let d = self.0.dims;
        let (q, k, v) = (
            view(OP, "q", q, ql)?,
            view(OP, "k", k, kl)?,
            view(OP, "v", v, vl)?,
        );
        // SAFETY: the kernel writes every element before anything reads it: a block per
        // (4R-row tile, head, sequence) covers every row below seq (`plan` divides seq by the
        // 4R of the kernel it names), and lane l of the row's warp writes its head dims
        // l * E .. l * E + E (32 * E = head_dim); on tensor cores a block per 64 rows (`plan`
        // divides by `TC_ROWS`), each warp 16, whose dims its lanes 4g .. 4g + 3 write two at
        // a time, 2t + 8n for every n < head_dim / 8. It is launched below on the device's
        // stream, which orders every later use.
        let out = unsafe { device.alloc::<T>(d.q_len())? };
        // SAFETY: as above: lane 0 of each row's warp writes the row's log-sum-exp, for every
        // (sequence, head, row), before the backward kernels read it on the same stream.
        let lse = unsafe { device.alloc::<f32>(d.batch * d.heads * d.seq)? };
        let s = Sizes::of(&d)?;
        let launch = plan(
            "forward",
            T::DTYPE,
            &d,
            forward_rows(&d),
            s.heads,
            s.batch,
            device,
        )?;
        let scale = d.scale();
        let stream = device.cuda_stream();
        let q = q.device_ptr(&stream).0;
        let k = k.device_ptr(&stream).0;
        let v = v.device_ptr(&stream).0;
        let out_ptr = out.device_ptr(&stream).0;
        let lse_ptr = lse.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&out_ptr)
            .arg(&lse_ptr)
            .arg(&s.seq)
            .arg(&s.heads)
            .arg(&s.kv_heads)
            .arg(&scale);
        // SAFETY: the arguments match `graft_causal_attention_forward_<dtype>_<hd>_r<R>` or its
        // tensor-core twin `graft_causal_attention_tc_forward_<dtype>_<hd>` (compute
        // capability 8.0+; bf16 and f16, or f32 at head dim 64, as `plan` checks), both `(const T*, const T*, const T*,
        // T*, float*, unsigned int x3, float)` with T the storage's dtype
        // and hd the head dim (64 or 128, checked): q and out hold batch * seq * heads * hd
        // elements, k and v batch * seq * kv_heads * hd (checked by the wrapper), lse batch *
        // heads * seq; the kernel reads and writes only rows below seq of sequences below
        // batch (the grid's z), heads below heads (its y), KV heads h / (heads / kv_heads)
        // < kv_heads (heads % kv_heads == 0, checked); its shared memory is static and the
        // block is the 4 warps it assumes. All live until the launch is enqueued on the
        // device's stream.
        unsafe { launch.run(device, &stream, &mut args) }?;
        self.0
            .lse
            .put(OP, rows_storage(lse, device), d.rows_shape())?;
        Ok(out)
    }
}

struct Dq<'a>(&'a AttentionDq);

impl Map3 for Dq<'_> {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        q: &CudaSlice<T>,
        ql: &Layout,
        k: &CudaSlice<T>,
        kl: &Layout,
        v: &CudaSlice<T>,
        vl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let op = self.0;
        let d = op.dims;
        let (q, k, v) = (
            view(OP, "q", q, ql)?,
            view(OP, "k", k, kl)?,
            view(OP, "v", v, vl)?,
        );
        let out = address(OP, &op.out, "the output", device)?;
        let grad = address(OP, &op.grad, "the output's gradient", device)?;
        let lse = address(OP, &op.lse, "the log-sum-exps", device)?;
        // SAFETY: the kernel writes every element before anything reads it: a block per
        // (4R-row tile, head, sequence) covers every row below seq (`plan` divides seq by the
        // 4R of the kernel it names), and lane l of the row's warp writes its head dims
        // l * E .. l * E + E; on tensor cores, as the forward pass's. Launched below on the
        // device's stream.
        let dq = unsafe { device.alloc::<T>(d.q_len())? };
        // SAFETY: as above: lane 0 of each row's warp writes the row's delta, for every
        // (sequence, head, row), before the key and value kernel reads it on the same stream.
        let delta = unsafe { device.alloc::<f32>(d.batch * d.heads * d.seq)? };
        let s = Sizes::of(&d)?;
        let launch = plan(
            "dq",
            T::DTYPE,
            &d,
            backward_rows(&d),
            s.heads,
            s.batch,
            device,
        )?;
        let scale = d.scale();
        let stream = device.cuda_stream();
        let q = q.device_ptr(&stream).0;
        let k = k.device_ptr(&stream).0;
        let v = v.device_ptr(&stream).0;
        let delta_ptr = delta.device_ptr(&stream).0;
        let dq_ptr = dq.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&out)
            .arg(&grad)
            .arg(&lse)
            .arg(&delta_ptr)
            .arg(&dq_ptr)
            .arg(&s.seq)
            .arg(&s.heads)
            .arg(&s.kv_heads)
            .arg(&scale);
        // SAFETY: the arguments match `graft_causal_attention_dq_<dtype>_<hd>_r<R>` or its
        // tensor-core twin `graft_causal_attention_tc_dq_<dtype>_<hd>`, both `(const T* x5,
        // const float*, float*, T*, unsigned int x3, float)` with T the storage's dtype and
        // hd the head dim (64 or 128): q, the output, its gradient (contiguous, T, by
        // address: the op holds them) and dq hold batch * seq * heads * hd elements, k and v
        // batch * seq * kv_heads * hd, the log-sum-exps (held) and delta batch * heads * seq
        // f32; the kernel touches only rows below seq of sequences below batch (grid z), heads
        // below heads (grid y) and KV heads below kv_heads; static shared memory, 4 warps.
        // All live until the launch is enqueued on the device's stream.
        unsafe { launch.run(device, &stream, &mut args) }?;
        op.delta
            .put(OP, rows_storage(delta, device), d.rows_shape())?;
        Ok(dq)
    }
}

struct Dkv<'a>(&'a AttentionDkv);

impl Map3 for Dkv<'_> {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        q: &CudaSlice<T>,
        ql: &Layout,
        k: &CudaSlice<T>,
        kl: &Layout,
        v: &CudaSlice<T>,
        vl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let op = self.0;
        let d = op.dims;
        let (q, k, v) = (
            view(OP, "q", q, ql)?,
            view(OP, "k", k, kl)?,
            view(OP, "v", v, vl)?,
        );
        let grad = address(OP, &op.grad, "the output's gradient", device)?;
        let lse = address(OP, &op.lse, "the log-sum-exps", device)?;
        let delta = address(OP, &op.delta, "the deltas", device)?;
        // SAFETY: the kernel writes every element before anything reads it: a block per
        // (4R-key tile, KV head, sequence) covers every key below seq (`plan` divides seq by
        // the 4R of the kernel it names), and lane l of the key's warp writes its head dims
        // l * E .. l * E + E of dk and of dv; on tensor cores, as the forward pass's rows.
        // Launched below on the device's stream.
        let dkv = unsafe { device.alloc::<T>(2 * d.kv_len())? };
        let s = Sizes::of(&d)?;
        let launch = plan(
            "dkv",
            T::DTYPE,
            &d,
            backward_rows(&d),
            s.kv_heads,
            s.batch,
            device,
        )?;
        let scale = d.scale();
        let stream = device.cuda_stream();
        let q = q.device_ptr(&stream).0;
        let k = k.device_ptr(&stream).0;
        let v = v.device_ptr(&stream).0;
        let dkv_ptr = dkv.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&q)
            .arg(&k)
            .arg(&v)
            .arg(&grad)
            .arg(&lse)
            .arg(&delta)
            .arg(&dkv_ptr)
            .arg(&s.batch)
            .arg(&s.seq)
            .arg(&s.heads)
            .arg(&s.kv_heads)
            .arg(&scale);
        // SAFETY: the arguments match `graft_causal_attention_dkv_<dtype>_<hd>_r<R>` or its
        // tensor-core twin `graft_causal_attention_tc_dkv_<dtype>_<hd>`, both `(const T* x4,
        // const float*, const float*, T*, unsigned int x4, float)` with T the storage's dtype
        // and hd the head dim (64 or 128): q and the output's gradient (contiguous, T, held
        // by the op, by address) hold batch * seq * heads * hd elements, k and v batch * seq *
        // kv_heads * hd, the log-sum-exps and deltas (held) batch * heads * seq f32, dkv twice
        // k's elements (dk, then dv); the kernel touches only rows and keys below seq of
        // sequences below batch (grid z), KV heads below kv_heads (grid y) and their group's
        // query heads below heads; static shared memory, 4 warps. All live until the launch
        // is enqueued on the device's stream.
        unsafe { launch.run(device, &stream, &mut args) }?;
        Ok(dkv)
    }
}
