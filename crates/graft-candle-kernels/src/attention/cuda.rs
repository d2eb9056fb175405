//! The split-KV decode attention kernels and their launches.
//!
//! - `graft_decode_attention_partial_g<G>_<dtype>`: grid (splits, kv_heads, batch), 128
//!   threads (4 warps), `gs * (head_dim + CHUNK) * 4` bytes of dynamic shared memory (the
//!   group's queries and its scores over the chunk, the group padded with zero queries to gs,
//!   a multiple of G: the group's size rounded up to a power of two, at most 8), then, from
//!   the next 8-byte boundary, `(CHUNK / block_size + 1) * 8` more (the first cache row of
//!   each block the chunk's positions are in, each looked up once; a static cache's row is
//!   one block), then, from the next 16-byte boundary, a stage of value rows (a whole chunk's
//!   up to 16 KiB). Its loads come in three rounds: the queries and block ids; then every key
//!   row's stretch (two threads per row, 16-byte loads into registers) together with the
//!   chunk's value rows (cp.async into the stage); nothing more until the partial is
//!   written. Scores: each thread dots its stretch with G query heads at a time (the queries
//!   read 4 elements a shared-memory load), the pair summed with one shuffle. Softmax
//!   partial: one warp per query head. Values, from the stage: two threads per head-dim
//!   element, each summing every other position for G query heads (a position's G scores in
//!   one load), the pair's sums added through shared memory. Earlier forms waited on one
//!   load per position (about 0.5 µs a position a layer), then on eight at a time, and then
//!   issued a shared-memory load per multiply-add (about 88 µs a layer at batch 32 and
//!   position 1,000 under ncu on an H200; four heads a load made that step 1.34x faster).
//! - `graft_prefill_attention_partial_<bf16|f16>` (`prefill_attention` on compute
//!   capability 8.0+, head_dim a multiple of 16 up to 128, a group dividing 64): grid
//!   (splits, kv_heads, tiles), 128 threads (4 warps of 16 query rows on tensor cores), a
//!   tile of 64 / group queries a block and a split of the chunks run through with an online
//!   softmax (`Tiled`: at most 8 splits, from max_seq alone), a chunk's keys and values in shared memory
//!   (`tiled_shared_bytes`); its partials go to the same combine kernel.
//! - `graft_decode_attention_combine_<dtype>`: grid (heads, batch), `head_dim` rounded up to
//!   a warp threads, one per head-dim element: the partials' largest max first (their maxes
//!   loaded side by side, a block reduction), then every non-empty partial weighted by
//!   exp(its max - that), no load waiting on the one before.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map3};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, WithDType};

use super::{CHUNK, DecodeAttention, OP};
use crate::KernelError;
use crate::check;
use crate::linear::cuda::has_tensor_cores;
use crate::nvrtc::{Args, Kernels, address, view};

/// Threads of a split-kernel block.
const THREADS: u32 = 128;

static KERNELS: Kernels = Kernels::native(
    "graft_kernels_decode_attention",
    concat!(
        include_str!("decode_attention.cu"),
        include_str!("prefill_attention.cu")
    ),
);

/// Query rows a block of the tensor-core split kernel takes (4 warps of one m16 tile).
const TILE_ROWS: usize = 64;

/// The most splits of a row's chunks the tensor-core split kernel makes. From max_seq alone,
/// so a query's result does not depend on how many run beside it; 8 keeps the scratch of
/// partials at 8 a query head, whatever max_seq (at 4,096 positions, one partial a chunk
/// made a 512-token chunk's scratch 268 MB a layer, and graphs holding it failed to upload
/// beside a planned cache), while a short chunk still has 8 blocks a KV head and tile.
const TILED_SPLITS: usize = 8;

/// The op's output on CUDA: the split kernel into f32 scratch, then the combine kernel.
pub(super) fn forward(
    op: &DecodeAttention,
    q: &CudaStorage,
    ql: &Layout,
    k: &CudaStorage,
    kl: &Layout,
    v: &CudaStorage,
    vl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (positions, pl) = op.positions.storage_and_layout();
    let Storage::Cuda(positions) = &*positions else {
        return Err(KernelError::Device {
            op: OP,
            input: "positions",
        }
        .into());
    };
    let positions = view(OP, "positions", positions.as_cuda_slice::<u32>()?, pl)?;
    let device = q.device.clone();
    let launch = Launch {
        op,
        positions: &positions,
    };
    let slice = launch.map(&q.slice, ql, &k.slice, kl, &v.slice, vl, &device)?;
    Ok((CudaStorage { slice, device }, op.dims.out_shape()))
}

/// The two launches over candle's dtype dispatch, with the positions beside.
struct Launch<'a> {
    op: &'a DecodeAttention,
    positions: &'a CudaView<'a, u32>,
}

impl Map3 for Launch<'_> {
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
        let d = self.op.dims;
        let stream = device.cuda_stream();
        let at = |view: CudaView<'_, T>| view.device_ptr(&stream).0;
        let q = at(view(OP, "q", q, ql)?);
        let k = at(view(OP, "k_cache", k, kl)?);
        let v = at(view(OP, "v_cache", v, vl)?);
        // Queries in runs on tensor cores: a tile of them a block.
        let tiled = match self.op.runs && tensor_cores::<T>(device)? {
            true => tiled(d, [ql, kl, vl]),
            false => None,
        };
        let splits = tiled.map_or(d.splits(), |t| t.splits);
        let partials = d.batch * d.heads * splits;
        // SAFETY: the split kernel writes the max and sum of every partial (each block writes
        // those of its group's heads, empty or not, and the grid covers every (split, KV
        // head, sequence)); it writes the outputs of every non-empty partial, and the combine
        // kernel uses the outputs only of partials whose max is not -inf, which are non-empty
        // (it loads the others' too, in bounds, and discards them by a select).
        // Both run on the device's stream in order, before the scratch is freed.
        let part_o = unsafe { device.alloc::<f32>(partials * d.head_dim)? };
        // SAFETY: as above: every element is written by the split kernel before the combine
        // kernel reads it.
        let part_ml = unsafe { device.alloc::<f32>(partials * 2)? };
        // SAFETY: the combine kernel writes every element (one block per (head, sequence),
        // one thread per head-dim element) before anything reads them, on the device's stream.
        let out = unsafe { device.alloc::<T>(d.batch * d.heads * d.head_dim)? };
        // Null without a table (or rows): each query reads its own row.
        let table = match &self.op.table {
            Some(t) => address(OP, t, "the block table", device)?,
            None => 0u64,
        };
        let launch = AttentionLaunch {
            q,
            k,
            v,
            positions: self.positions.device_ptr(&stream).0,
            table,
            part_o: part_o.device_ptr(&stream).0,
            part_ml: part_ml.device_ptr(&stream).0,
            out: out.device_ptr(&stream).0,
            dims: d,
            reach: self.op.reach,
            scale: self.op.scale,
            tiled,
        };
        // SAFETY: the wrapper checked the shapes: q holds batch * heads * head_dim elements,
        // k and v blocks * kv_heads * block_size * head_dim, positions batch, the table (when
        // given, held by the op) batch * max_blocks; the scratch and `out` were just allocated with the
        // sizes `AttentionLaunch` needs; all live until the launches are enqueued.
        unsafe { launch.launch::<T>(device, &stream, false) }?;
        Ok(out)
    }
}

/// Whether dtype `T` takes the tensor-core split kernel on `device`: bf16 or f16 on compute
/// capability 8.0 or later.
fn tensor_cores<T: WithDType>(device: &CudaDevice) -> Result<bool> {
    Ok(matches!(T::DTYPE, DType::BF16 | DType::F16) && has_tensor_cores(device)?)
}

/// How the tensor-core split kernel covers a call: queries a block, and the chunks of
/// `CHUNK` positions a block runs through one after another (`per`, in `splits` splits).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tiled {
    tile: usize,
    splits: usize,
    per: usize,
}

/// The tensor-core split kernel's cover of a call, where it takes these sizes (head_dim a
/// multiple of 16 up to 128, a group dividing [`TILE_ROWS`]) and operands (q and the caches
/// starting at an even element: the kernel loads two elements at a time); from the shapes
/// only.
fn tiled(d: super::Dims, layouts: [&Layout; 3]) -> Option<Tiled> {
    let group = d.heads / d.kv_heads;
    let fits = d.head_dim.is_multiple_of(16)
        && d.head_dim <= 128
        && TILE_ROWS.is_multiple_of(group)
        && layouts.iter().all(|l| l.start_offset().is_multiple_of(2));
    if !fits {
        return None;
    }
    let chunks = d.splits();
    let per = chunks.div_ceil(TILED_SPLITS);
    Some(Tiled {
        tile: TILE_ROWS / group,
        splits: chunks.div_ceil(per),
        per,
    })
}

/// The split and combine launches' operands, by device address.
pub(crate) struct AttentionLaunch {
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) positions: u64,
    /// Each query's blocks (`[batch, max_blocks]` u32; rows are one block each), or 0: query
    /// b's own row.
    pub(crate) table: u64,
    /// f32 scratch: the partials' outputs (`batch * heads * splits * head_dim`) and their
    /// maxes and sums (`2 * batch * heads * splits`).
    pub(crate) part_o: u64,
    pub(crate) part_ml: u64,
    /// `[batch, heads * head_dim]` output.
    pub(crate) out: u64,
    pub(crate) dims: super::Dims,
    pub(crate) reach: usize,
    pub(crate) scale: f32,
    /// The tensor-core split kernel's cover (queries in runs, see `prefill_attention`), or
    /// `None`: the decode split kernel, a chunk a block.
    pub(crate) tiled: Option<Tiled>,
}

impl AttentionLaunch {
    /// The split kernel, then the combine kernel, for dtype `T` on `stream`; each a
    /// programmatic dependent of the kernel before it when `dependent`.
    ///
    /// # Safety
    /// q holds batch * heads * head_dim elements of T, the caches blocks * kv_heads *
    /// block_size * head_dim, positions batch u32, the table batch * max_blocks u32 when not
    /// 0, `part_o` batch *
    /// heads * splits * head_dim f32, `part_ml` 2 * batch * heads * splits f32, `out` batch *
    /// heads * head_dim T: all memory of `device` alive until the kernels have run; the dims
    /// passed the wrapper's checks (`decode_attention_fits`).
    pub(crate) unsafe fn launch<T: WithDType>(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        dependent: bool,
    ) -> Result<()> {
        let d = self.dims;
        let dtype = T::DTYPE.as_str();
        let u32_of = |what, size| check::u32_of(OP, what, size);
        let heads = u32_of("the query head count", d.heads)?;
        let kv_heads = u32_of("the KV head count", d.kv_heads)?;
        let batch = u32_of("the batch", d.batch)?;
        let max_seq = u32_of("max_seq", d.index.max_seq())?;
        let max_blocks = u32_of("the blocks per sequence", d.index.max_blocks)?;
        let blocks = u32_of("the cache's blocks", d.index.blocks)?;
        let block_size = u32_of("the block size", d.index.block_size)?;
        let head_dim = u32_of("the head dim", d.head_dim)?;
        let chunk = u32_of("the chunk", CHUNK)?;
        let reach = u32_of("the window", self.reach)?;
        let splits = u32_of(
            "the chunk count",
            self.tiled.map_or(d.splits(), |t| t.splits),
        )?;
        let shared = match self.tiled {
            Some(t) => tiled_shared_bytes::<T>(d, t.tile),
            None => d.shared_bytes(T::DTYPE.size_in_bytes()),
        };
        let shared = u32_of("the shared memory", shared)?;
        let stage = u32_of(
            "the staged value rows",
            d.stage_rows(T::DTYPE.size_in_bytes()),
        )?;

        let mut args = Args::new();
        args.arg(&self.q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&self.positions)
            .arg(&self.table)
            .arg(&max_blocks)
            .arg(&blocks)
            .arg(&block_size)
            .arg(&self.part_o)
            .arg(&self.part_ml)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&max_seq)
            .arg(&head_dim)
            .arg(&chunk)
            .arg(&reach)
            .arg(&self.scale);
        let cover = match self.tiled {
            Some(t) => Some((
                u32_of("the tile", t.tile)?,
                u32_of("the chunks a split", t.per)?,
            )),
            None => None,
        };
        let (kernel, tiles) = match &cover {
            Some((tile, per)) => {
                args.arg(&batch).arg(tile).arg(per);
                (
                    "graft_prefill_attention_partial".to_string(),
                    batch.div_ceil(*tile),
                )
            }
            None => {
                args.arg(&stage);
                let g = d.heads_at_once();
                (format!("graft_decode_attention_partial_g{g}"), batch)
            }
        };
        let config = LaunchConfig {
            grid_dim: (splits, kv_heads, tiles),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: the arguments match `graft_decode_attention_partial_g<G>_<dtype>(const
        // T*, const T*, const T*, const unsigned int*, const unsigned int*, unsigned int x3,
        // float*, float*, unsigned int x6, float, unsigned int)` with T the storage's dtype,
        // every buffer by address and sized as the caller guarantees; the kernel clamps each
        // position below max_seq = max_blocks * block_size (so it indexes the table row within
        // max_blocks) and each block id below blocks (a query's own row, without a table, is b
        // < batch = blocks), and reads only positions start..end of those blocks, 16 bytes at a
        // time only where the rows and both caches' addresses are 16-byte aligned; head_dim <=
        // 256; heads % kv_heads == 0; the scratch holds batch * heads * splits partials,
        // indexed by (head * splits + split) < that; the dynamic shared memory is the group
        // rounded up to a multiple of G (`heads_at_once`) * (head_dim + chunk) f32, rounded
        // up to 8 bytes, one u64 per block a chunk's positions
        // can be in, rounded up to 16 bytes, and `stage` value rows of head_dim elements (at
        // most 48 KiB, checked), exactly what the kernel indexes; the block is 4 whole warps; it
        // waits before it reads anything. The tensor-core kernel
        // (`graft_prefill_attention_partial_<dtype>`, bf16 or f16 on compute capability 8.0+)
        // takes the same arguments but `stage`, then the batch, the tile and the
        // chunks a split (each block clamps its queries below the batch and its chunks below
        // max_seq / chunk; `splits` is the grid's x and the scratch's, sized by it): its shared memory is
        // `tiled_shared_bytes`' (under 48 KiB for head_dim <= 128), q and the caches start at
        // an even element (two-element loads), head_dim is a multiple of 16 and the group
        // divides its 64 query rows (`tile`).
        unsafe {
            KERNELS.launch(
                device,
                stream,
                &format!("{kernel}_{dtype}"),
                config,
                dependent,
                &mut args,
            )
        }?;

        let mut args = Args::new();
        args.arg(&self.part_o)
            .arg(&self.part_ml)
            .arg(&self.out)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&splits);
        let config = LaunchConfig {
            grid_dim: (heads, batch, 1),
            block_dim: (head_dim.next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_decode_attention_combine_<dtype>(const float*,
        // const float*, T*, unsigned int, unsigned int, unsigned int)`: the scratch written by
        // the split kernel just before on the same stream, `out` batch * heads * head_dim
        // elements, indexed by ((b * heads + h) * head_dim + d) with d < head_dim <= 256
        // threads; it waits before it reads anything.
        unsafe {
            KERNELS.launch(
                device,
                stream,
                &format!("graft_decode_attention_combine_{dtype}"),
                config,
                dependent,
                &mut args,
            )
        }
    }
}

/// Dynamic shared memory of a tensor-core split-kernel block: a chunk's keys and values,
/// each row padded by 8 elements, then three u32 a query of the tile and three of the run
/// (rounded up to 8 bytes), then the first cache row of each block a chunk's positions are
/// in (u64).
fn tiled_shared_bytes<T: WithDType>(d: super::Dims, tile: usize) -> usize {
    let kv = 2 * CHUNK * (d.head_dim + 8) * T::DTYPE.size_in_bytes();
    let words = 3 * tile + 3;
    let blocks = CHUNK.div_ceil(d.index.block_size.max(1)) + 1;
    kv + (words + words % 2) * size_of::<u32>() + blocks * size_of::<u64>()
}
