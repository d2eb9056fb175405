//! The rope-and-store kernel: grid (heads + 2 * kv_heads, batch), one warp per block. A query
//! or key head is optionally RMS-normed (a warp reduction of its squares), rotated pairwise
//! with its position's table row, and written to the output (queries) or the key cache; a value
//! head is copied into the value cache.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, Map3};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};

use super::{OP, Part, RopeStore, RopeStyle};
use crate::check;
use crate::nvrtc::{Args, Kernels, address, view};

static KERNELS: Kernels =
    Kernels::native("graft_kernels_rope_store", include_str!("rope_store.cu"));

/// The rotated queries on CUDA, the keys and values stored in the same launch.
pub(super) fn forward(
    op: &RopeStore,
    qkv: &CudaStorage,
    ql: &Layout,
    cos: &CudaStorage,
    cl: &Layout,
    sin: &CudaStorage,
    sl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    // The keys-only call is the CPU's (`rope_store` makes it only there).
    debug_assert_eq!(op.part, Part::Queries);
    let device = qkv.device.clone();
    let slice = op.map(&qkv.slice, ql, &cos.slice, cl, &sin.slice, sl, &device)?;
    Ok((
        CudaStorage { slice, device },
        op.dims.out_shape(Part::Queries),
    ))
}

impl Map3 for RopeStore {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        qkv: &CudaSlice<T>,
        ql: &Layout,
        cos: &CudaSlice<T>,
        cl: &Layout,
        sin: &CudaSlice<T>,
        sl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let d = self.dims;
        let qkv = view(OP, "qkv", qkv, ql)?;
        let cos = view(OP, "cos", cos, cl)?;
        let sin = view(OP, "sin", sin, sl)?;
        let positions = address(OP, &self.positions, "positions", device)?;
        // Null without a table (or rows): each token goes to its own row.
        let table = match &self.table {
            Some(t) => address(OP, t, "the block table", device)?,
            None => 0u64,
        };
        let (k_cache, v_cache) = (
            address(OP, &self.caches.0, "k_cache", device)?,
            address(OP, &self.caches.1, "v_cache", device)?,
        );
        let norms = match &self.norm {
            Some((q, k, eps)) => Some((
                address(OP, q, "q norm", device)?,
                address(OP, k, "k norm", device)?,
                *eps,
            )),
            None => None,
        };
        // SAFETY: the kernel writes all `batch * heads * head_dim` elements (one block per
        // (query head, sequence), its lanes striding every dim pair) before anything reads
        // them: it is launched below on the device's stream.
        let q_out = unsafe { device.alloc::<T>(d.batch * d.heads * d.head_dim)? };
        let stream = device.cuda_stream();
        let launch = RopeLaunch {
            qkv: qkv.device_ptr(&stream).0,
            cos: cos.device_ptr(&stream).0,
            sin: sin.device_ptr(&stream).0,
            positions,
            table,
            norms,
            q_out: q_out.device_ptr(&stream).0,
            caches: (k_cache, v_cache),
            dims: d,
            style: self.style,
        };
        // SAFETY: `qkv` holds batch * (heads + 2 kv_heads) * head_dim elements, the tables
        // table * head_dim / 2, `positions` batch u32, the block table batch * max_blocks
        // u32 when given (null otherwise), the norms head_dim each when given, the caches
        // blocks * kv_heads * block_size * head_dim each (all checked by the wrapper, contiguous, of T; the op holds
        // clones, so all live), `q_out` just allocated.
        unsafe { launch.launch::<T>(device, &stream, false) }?;
        Ok(q_out)
    }
}

/// The rope-and-store launch's operands, by device address.
pub(crate) struct RopeLaunch {
    pub(crate) qkv: u64,
    pub(crate) cos: u64,
    pub(crate) sin: u64,
    pub(crate) positions: u64,
    /// Each token's blocks (`[batch, max_blocks]` u32; rows are one block each), or 0: token
    /// b's own row.
    pub(crate) table: u64,
    /// Qwen3's query and key norm weights and epsilon.
    pub(crate) norms: Option<(u64, u64, f32)>,
    /// `[batch, heads * head_dim]` rotated queries.
    pub(crate) q_out: u64,
    pub(crate) caches: (u64, u64),
    pub(crate) dims: super::Dims,
    pub(crate) style: RopeStyle,
}

impl RopeLaunch {
    /// Launches the kernel for dtype `T` on `stream`, as a programmatic dependent of the
    /// kernel before it when `dependent`.
    ///
    /// # Safety
    /// `qkv` holds batch * (heads + 2 kv_heads) * head_dim elements of T, the tables table *
    /// head_dim / 2, `positions` batch u32, `table` batch * max_blocks u32 when not 0, the
    /// norms head_dim each, the caches blocks * kv_heads * block_size * head_dim each, `q_out`
    /// batch * heads * head_dim: all memory of `device` alive until the kernel has run.
    pub(crate) unsafe fn launch<T: WithDType>(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        dependent: bool,
    ) -> Result<()> {
        let d = self.dims;
        let style = match self.style {
            RopeStyle::Half => "half",
            RopeStyle::Interleaved => "interleaved",
        };
        let name = format!("graft_rope_store_{style}_{}", T::DTYPE.as_str());
        let blocks = check::u32_of(OP, "the head count", d.heads + 2 * d.kv_heads)?;
        let [
            heads,
            kv_heads,
            hd,
            max_seq,
            table,
            max_blocks,
            cache_blocks,
            block_size,
        ] = [
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.index.max_seq(),
            d.table,
            d.index.max_blocks,
            d.index.blocks,
            d.index.block_size,
        ]
        .map(|v| v as u32);
        // Never read without norms: has_norm is 0.
        let (q_norm, k_norm, eps) = self.norms.unwrap_or((self.caches.0, self.caches.0, 0.0));
        let has_norm = u32::from(self.norms.is_some());
        let mut args = Args::new();
        args.arg(&self.qkv)
            .arg(&self.cos)
            .arg(&self.sin)
            .arg(&self.positions)
            .arg(&self.table)
            .arg(&max_blocks)
            .arg(&cache_blocks)
            .arg(&block_size)
            .arg(&q_norm)
            .arg(&k_norm)
            .arg(&self.q_out)
            .arg(&self.caches.0)
            .arg(&self.caches.1)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&hd)
            .arg(&max_seq)
            .arg(&table)
            .arg(&has_norm)
            .arg(&eps);
        let config = LaunchConfig {
            grid_dim: (blocks, d.batch as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `graft_rope_store_<style>_<dtype>(const T* x3, const
        // unsigned int* x2, unsigned int x3, const T* x2, T* x3, unsigned int x6, float)`, the
        // addresses passed by value and sized as the caller guarantees (every size fits u32:
        // the wrapper checked them); the kernel clamps each position below max_seq =
        // max_blocks * block_size (so it indexes the table row within max_blocks) and the
        // table, and each block id below blocks (token b's own row, without a table, is b <
        // batch = blocks), so it writes only the caches' places at those blocks and positions
        // and `q_out`. Writing the caches through their addresses is what
        // candle's in-place `scatter_set` does through its storage; the stream orders the
        // writes after every earlier use of them and before every later one. It waits before
        // it reads anything.
        unsafe { KERNELS.launch(device, stream, &name, config, dependent, &mut args) }
    }
}
