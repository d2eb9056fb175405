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

static KERNELS: Kernels = Kernels::with_dependents(
    "graft_kernels_rope_store",
    r#"
template <typename T, bool INTERLEAVED>
__device__ void graft_rope_store(
    const T* qkv, const T* cos, const T* sin, const unsigned int* positions,
    const unsigned int* rows, unsigned int cache_rows, const T* q_norm, const T* k_norm,
    T* q_out, T* k_cache, T* v_cache, unsigned int heads, unsigned int kv_heads,
    unsigned int hd, unsigned int max_seq, unsigned int table, unsigned int has_norm,
    float eps) {
    // As a programmatic dependent: nothing to do before the wait (qkv is the kernel before's).
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int h = blockIdx.x;
    const unsigned int b = blockIdx.y;
    const unsigned int lane = threadIdx.x;
    // The cache row token b goes to: its own, or rows[b] (never past the cache).
    unsigned int r = b;
    if (rows) {
        r = rows[b] < cache_rows ? rows[b] : cache_rows - 1u;
    }
    unsigned int p = positions[b];
    if (p >= max_seq) {
        p = max_seq - 1u;  // never write outside the cache
    }
    const unsigned int row = p < table ? p : table - 1u;
    const T* src = qkv + ((unsigned long long)b * (heads + 2u * kv_heads) + h) * hd;
    if (h >= heads + kv_heads) {
        const unsigned int kvh = h - heads - kv_heads;
        T* dst = v_cache + (((unsigned long long)r * kv_heads + kvh) * max_seq + p) * hd;
        for (unsigned int i = lane; i < hd; i += 32u) {
            dst[i] = src[i];
        }
        return;
    }
    const bool query = h < heads;
    T* dst = query ? q_out + ((unsigned long long)b * heads + h) * hd
                   : k_cache + (((unsigned long long)r * kv_heads + (h - heads)) * max_seq + p) * hd;
    float inv = 1.0f;
    const T* w = query ? q_norm : k_norm;
    if (has_norm) {
        float squares = 0.0f;
        for (unsigned int i = lane; i < hd; i += 32u) {
            const float x = graft_to_f32(src[i]);
            squares += x * x;
        }
        inv = 1.0f / sqrtf(graft_warp_sum(squares) / (float)hd + eps);
    }
    const unsigned int half = hd / 2u;
    for (unsigned int i = lane; i < half; i += 32u) {
        const unsigned int i1 = INTERLEAVED ? 2u * i : i;
        const unsigned int i2 = INTERLEAVED ? 2u * i + 1u : i + half;
        float x1 = graft_to_f32(src[i1]);
        float x2 = graft_to_f32(src[i2]);
        if (has_norm) {
            // Rounded to T, as the unfused norm leaves it.
            x1 = graft_to_f32(graft_from_f32<T>(x1 * inv * graft_to_f32(w[i1])));
            x2 = graft_to_f32(graft_from_f32<T>(x2 * inv * graft_to_f32(w[i2])));
        }
        const float c = graft_to_f32(cos[(unsigned long long)row * half + i]);
        const float s = graft_to_f32(sin[(unsigned long long)row * half + i]);
        dst[i1] = graft_from_f32<T>(x1 * c - x2 * s);
        dst[i2] = graft_from_f32<T>(x1 * s + x2 * c);
    }
}

#define GRAFT_ROPE_ONE(suffix, T, name, INTERLEAVED)                                         \
    extern "C" __global__ void graft_rope_store_##name##_##suffix(                           \
        const T* qkv, const T* cos, const T* sin, const unsigned int* positions,             \
        const unsigned int* rows, unsigned int cache_rows, const T* q_norm, const T* k_norm, \
        T* q_out, T* k_cache, T* v_cache, unsigned int heads, unsigned int kv_heads,         \
        unsigned int hd, unsigned int max_seq, unsigned int table, unsigned int has_norm,    \
        float eps) {                                                                         \
        graft_rope_store<T, INTERLEAVED>(qkv, cos, sin, positions, rows, cache_rows, q_norm, \
                                         k_norm, q_out, k_cache, v_cache, heads, kv_heads,   \
                                         hd, max_seq, table, has_norm, eps);                 \
    }
#define GRAFT_ROPE(suffix, T)                                                                \
    GRAFT_ROPE_ONE(suffix, T, half, false)                                                   \
    GRAFT_ROPE_ONE(suffix, T, interleaved, true)
GRAFT_FOR_DTYPES(GRAFT_ROPE)
"#,
);

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
        // Null without rows: each token goes to its own row.
        let rows = match &self.rows {
            Some(r) => address(OP, r, "rows", device)?,
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
            rows,
            norms,
            q_out: q_out.device_ptr(&stream).0,
            caches: (k_cache, v_cache),
            dims: d,
            style: self.style,
        };
        // SAFETY: `qkv` holds batch * (heads + 2 kv_heads) * head_dim elements, the tables
        // table * head_dim / 2, `positions` batch u32, `rows` batch u32 when given (null
        // otherwise), the norms head_dim each when given, the caches cache_rows * kv_heads *
        // max_seq * head_dim each (all checked by the wrapper, contiguous, of T; the op holds
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
    /// Each token's cache row (`[batch]` u32), or 0: token b's own.
    pub(crate) rows: u64,
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
    /// head_dim / 2, `positions` batch u32, `rows` batch u32 when not 0, the norms head_dim
    /// each, the caches cache_rows * kv_heads * max_seq * head_dim each, `q_out` batch * heads
    /// * head_dim: all memory of `device` alive until the kernel has run.
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
        let [heads, kv_heads, hd, max_seq, table, cache_rows] = [
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.max_seq,
            d.table,
            d.cache_rows,
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
            .arg(&self.rows)
            .arg(&cache_rows)
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
        // unsigned int* x2, unsigned int, const T* x2, T* x3, unsigned int x6, float)`, the
        // addresses passed by value and sized as the caller guarantees; the kernel clamps each
        // row below cache_rows (token b's own, b < batch = cache_rows, without rows) and each
        // position below max_seq and table, so it writes only the caches' places at those
        // rows and positions and `q_out`. Writing the caches through their addresses is what
        // candle's in-place `scatter_set` does through its storage; the stream orders the
        // writes after every earlier use of them and before every later one. It waits before
        // it reads anything.
        unsafe { KERNELS.launch(device, stream, &name, config, dependent, &mut args) }
    }
}
