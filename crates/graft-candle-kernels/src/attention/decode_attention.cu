
// The partial of query heads first .. first + group (first = b * heads + kvh * group) over the
// visible positions start .. end of chunk `split`, at index (head * splits + split).
template <typename T>
__device__ void graft_decode_attention_partial(
    const T* q, const T* k, const T* v, const unsigned int* positions,
    const unsigned int* rows, unsigned int cache_rows, float* part_o, float* part_ml,
    unsigned int heads, unsigned int kv_heads, unsigned int max_seq, unsigned int hd,
    unsigned int chunk, unsigned int reach, float scale) {
    // As a programmatic dependent: nothing to do before the wait (q and the newest key and
    // value are the kernel before's).
    graft_pdl_trigger();
    graft_pdl_wait();
    extern __shared__ float graft_smem[];
    const unsigned int split = blockIdx.x;
    const unsigned int kvh = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int splits = gridDim.x;
    const unsigned int group = heads / kv_heads;
    const unsigned long long first =
        (unsigned long long)b * heads + (unsigned long long)kvh * group;

    unsigned int pos = positions[b];
    if (pos >= max_seq) {
        pos = max_seq - 1u;  // never read outside the cache row
    }
    const unsigned int lo = pos > reach ? pos - reach : 0u;
    const unsigned int c0 = split * chunk;
    const unsigned int start = lo > c0 ? lo : c0;
    const unsigned int end = pos + 1u < c0 + chunk ? pos + 1u : c0 + chunk;
    if (start >= end) {
        // Nothing visible in this chunk: an empty partial, and no K/V read.
        for (unsigned int g = threadIdx.x; g < group; g += blockDim.x) {
            const unsigned long long p = (first + g) * splits + split;
            part_ml[2 * p] = GRAFT_NEG_INF;
            part_ml[2 * p + 1] = 0.0f;
        }
        return;
    }

    float* qs = graft_smem;               // [group][hd]
    float* ps = graft_smem + group * hd;  // [group][chunk]
    const T* qg = q + first * hd;
    for (unsigned int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        qs[i] = graft_to_f32(qg[i]);
    }
    __syncthreads();

    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = blockDim.x >> 5;
    // The cache row query b reads: its own, or rows[b] (never past the cache).
    unsigned int row = b;
    if (rows) {
        row = rows[b] < cache_rows ? rows[b] : cache_rows - 1u;
    }
    const unsigned long long row0 = ((unsigned long long)row * kv_heads + kvh) * max_seq;

    // Scores: one warp per key row, the row loaded once for the whole group.
    for (unsigned int j = start + warp; j < end; j += warps) {
        const T* kr = k + (row0 + j) * hd;
        float kj[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int d = lane + 32u * i;
            kj[i] = d < hd ? graft_to_f32(kr[d]) : 0.0f;
        }
        for (unsigned int g = 0; g < group; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned int d = lane + 32u * i;
                if (d < hd) {
                    s += qs[g * hd + d] * kj[i];
                }
            }
            s = graft_warp_sum(s);
            if (lane == 0) {
                ps[g * chunk + (j - c0)] = s * scale;
            }
        }
    }
    __syncthreads();

    // Softmax partial: one warp per query head; scores become exp(score - max).
    for (unsigned int g = warp; g < group; g += warps) {
        float* pg = ps + g * chunk;
        float m = GRAFT_NEG_INF;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            m = fmaxf(m, pg[j - c0]);
        }
        m = graft_warp_max(m);
        float l = 0.0f;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            const float e = expf(pg[j - c0] - m);
            pg[j - c0] = e;
            l += e;
        }
        l = graft_warp_sum(l);
        if (lane == 0) {
            const unsigned long long p = (first + g) * splits + split;
            part_ml[2 * p] = m;
            part_ml[2 * p + 1] = l;
        }
    }
    __syncthreads();

    // Values: one thread per head-dim element, 8 query heads at a time.
    for (unsigned int d = threadIdx.x; d < hd; d += blockDim.x) {
        for (unsigned int g0 = 0; g0 < group; g0 += 8u) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (unsigned int j = start; j < end; ++j) {
                const float x = graft_to_f32(v[(row0 + j) * hd + d]);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (g0 + i < group) {
                        acc[i] += ps[(g0 + i) * chunk + (j - c0)] * x;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (g0 + i < group) {
                    part_o[((first + g0 + i) * splits + split) * hd + d] = acc[i];
                }
            }
        }
    }
}

// out[(b * heads + h) * hd + d]: the partials of (b, h) merged; empty ones (max -inf) skipped
// (their outputs were never written).
template <typename T>
__device__ void graft_decode_attention_combine(
    const float* part_o, const float* part_ml, T* out, unsigned int heads, unsigned int hd,
    unsigned int splits) {
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int d = threadIdx.x;
    if (d >= hd) {
        return;
    }
    const unsigned long long bh = (unsigned long long)blockIdx.y * heads + blockIdx.x;
    float m_all = GRAFT_NEG_INF;
    float l_all = 0.0f;
    float acc = 0.0f;
    for (unsigned int s = 0; s < splits; ++s) {
        const unsigned long long p = bh * splits + s;
        const float m = part_ml[2 * p];
        if (m == GRAFT_NEG_INF) {
            continue;
        }
        const float m_new = fmaxf(m_all, m);
        const float old_scale = expf(m_all - m_new);
        const float new_scale = expf(m - m_new);
        l_all = l_all * old_scale + part_ml[2 * p + 1] * new_scale;
        acc = acc * old_scale + part_o[p * hd + d] * new_scale;
        m_all = m_new;
    }
    out[bh * hd + d] = graft_from_f32<T>(acc / l_all);
}

#define GRAFT_DECODE_ATTENTION(suffix, T)                                                    \
    extern "C" __global__ void graft_decode_attention_partial_##suffix(                      \
        const T* q, const T* k, const T* v, const unsigned int* positions,                   \
        const unsigned int* rows, unsigned int cache_rows, float* part_o, float* part_ml,    \
        unsigned int heads, unsigned int kv_heads, unsigned int max_seq, unsigned int hd,    \
        unsigned int chunk, unsigned int reach, float scale) {                               \
        graft_decode_attention_partial<T>(q, k, v, positions, rows, cache_rows, part_o,      \
                                          part_ml, heads, kv_heads, max_seq, hd, chunk,      \
                                          reach, scale);                                     \
    }                                                                                        \
    extern "C" __global__ void graft_decode_attention_combine_##suffix(                      \
        const float* part_o, const float* part_ml, T* out, unsigned int heads,               \
        unsigned int hd, unsigned int splits) {                                              \
        graft_decode_attention_combine<T>(part_o, part_ml, out, heads, hd, splits);          \
    }
GRAFT_FOR_DTYPES(GRAFT_DECODE_ATTENTION)
