
// Whether (v, i) beats (w, j): larger, or equal with the smaller index. NaN never beats.
__device__ __forceinline__ bool graft_beats(float v, unsigned int i, float w, unsigned int j) {
    return v > w || (v == w && i < j);
}

// The winning (v, i) over the warp, in every lane.
__device__ __forceinline__ void graft_warp_argmax(float& v, unsigned int& i) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, offset);
        const unsigned int j = __shfl_xor_sync(0xffffffffu, i, offset);
        if (graft_beats(w, j, v, i)) {
            v = w;
            i = j;
        }
    }
}

template <typename T>
__device__ void graft_argmax(const T* x, unsigned int* out, unsigned int n) {
    __shared__ float best_v[32];
    __shared__ unsigned int best_i[32];
    const T* row = x + (unsigned long long)blockIdx.x * n;
    float v = GRAFT_NEG_INF;
    unsigned int i = 0xffffffffu;
    // Eight elements a thread per round, all loaded before any is compared (one at a time,
    // each load's latency was paid in turn: 14 us for a row of 32,000 on an H200).
    const unsigned int stride = blockDim.x;
    for (unsigned int base = threadIdx.x; base < n; base += 8u * stride) {
        float f[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int c = base + (unsigned int)u * stride;
            f[u] = c < n ? graft_to_f32(row[c]) : GRAFT_NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int c = base + (unsigned int)u * stride;
            if (c < n && graft_beats(f[u], c, v, i)) {
                v = f[u];
                i = c;
            }
        }
    }
    graft_warp_argmax(v, i);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < (blockDim.x >> 5);
        v = has ? best_v[lane] : GRAFT_NEG_INF;
        i = has ? best_i[lane] : 0xffffffffu;
        graft_warp_argmax(v, i);
        if (lane == 0) {
            // A row of NaN (or -inf only) found nothing beating the start: index 0.
            out[blockIdx.x] = i < n ? i : 0u;
        }
    }
}

#define GRAFT_ARGMAX(suffix, T)                                                              \
    extern "C" __global__ void graft_argmax_##suffix(const T* x, unsigned int* out,          \
                                                     unsigned int n) {                       \
        graft_argmax<T>(x, out, n);                                                          \
    }
GRAFT_FOR_DTYPES(GRAFT_ARGMAX)
