
// A running (max, sum of exp(x - max)) pair: `add` takes one more value, `merge` another pair.
struct GraftLse {
    float m = GRAFT_NEG_INF;
    float s = 0.0f;

    __device__ __forceinline__ void add(float x) {
        if (x > m) {
            s = s * expf(m - x) + 1.0f;  // 0 * exp(-inf) while the row has seen nothing
            m = x;
        } else if (x != GRAFT_NEG_INF) {  // exp(-inf - -inf) would be NaN
            s += expf(x - m);
        }
    }

    __device__ __forceinline__ void merge(float m2, float s2) {
        const float big = fmaxf(m, m2);
        if (big != GRAFT_NEG_INF) {
            s = s * expf(m - big) + s2 * expf(m2 - big);
            m = big;
        }
    }
};

// Whether 16-byte loads reach every element of a [rows, vocab] tensor at `p`, row by row.
template <typename T>
__device__ __forceinline__ bool graft_ce_wide(const T* p, unsigned int vocab) {
    return ((unsigned long long)p % 16u) == 0u && vocab % GraftVec<T>::E == 0u;
}

// rows_out[row] = lse - logits[row, target] (NaN for a target past the vocabulary),
// rows_out[rows + row] = lse: one pass over the row, 16 bytes a load where the tensor allows
// it, each thread's running max and sum merged over the block in a fixed order.
template <typename T>
__device__ void graft_cross_entropy_rows(const T* logits, const unsigned int* targets,
                                         float* rows_out, unsigned int rows,
                                         unsigned int vocab) {
    const int E = GraftVec<T>::E;
    __shared__ float part_m[32];
    __shared__ float part_s[32];
    const unsigned int r = blockIdx.x;
    const T* x = logits + (unsigned long long)r * vocab;
    GraftLse acc;
    if (graft_ce_wide(logits, vocab)) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (unsigned int i = threadIdx.x; i < vocab / E; i += blockDim.x) {
            float f[E];
            GraftVec<T>::unpack(xv[i], f);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc.add(f[e]);
            }
        }
    } else {
        for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
            acc.add(graft_to_f32(x[i]));
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, acc.m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, acc.s, offset);
        acc.merge(m2, s2);
    }
    if ((threadIdx.x & 31u) == 0u) {
        part_m[threadIdx.x >> 5] = acc.m;
        part_s[threadIdx.x >> 5] = acc.s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        GraftLse all;
        for (unsigned int w = 0; w < (blockDim.x >> 5); ++w) {
            all.merge(part_m[w], part_s[w]);
        }
        const float lse = all.m + logf(all.s);
        const unsigned int t = targets[r];
        rows_out[r] = t < vocab ? lse - graft_to_f32(x[t]) : __uint_as_float(0x7fc00000u);
        rows_out[rows + r] = lse;
    }
}

// out[0] = the mean of the row losses, summed in a fixed order by one block.
extern "C" __global__ void graft_cross_entropy_mean(const float* rows_out, float* out,
                                                    unsigned int rows) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (unsigned int i = threadIdx.x; i < rows; i += blockDim.x) {
        s += rows_out[i];
    }
    s = graft_block_sum(s, scratch);
    if (threadIdx.x == 0) {
        out[0] = s / (float)rows;
    }
}

// dlogits[row, i] = (exp(logits[row, i] - lse) - (i == target)) * dloss / rows, 16 bytes a
// load and a store where both tensors allow it (`out` may be `logits` itself).
template <typename T>
__device__ void graft_cross_entropy_backward(const T* logits, const unsigned int* targets,
                                             const float* saved, const float* dloss, T* out,
                                             unsigned int rows, unsigned int vocab) {
    const int E = GraftVec<T>::E;
    const unsigned int r = blockIdx.x;
    const unsigned long long base = (unsigned long long)r * vocab;
    const float lse = saved[rows + r];
    const unsigned int t = targets[r];
    const float scale = t < vocab ? dloss[0] / (float)rows : __uint_as_float(0x7fc00000u);
    if (graft_ce_wide(logits, vocab) && graft_ce_wide(out, vocab)) {
        const uint4* xv = reinterpret_cast<const uint4*>(logits + base);
        uint4* ov = reinterpret_cast<uint4*>(out + base);
        for (unsigned int i = threadIdx.x; i < vocab / E; i += blockDim.x) {
            float f[E];
            GraftVec<T>::unpack(xv[i], f);
            uint4 packed;
            T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const unsigned int c = i * E + e;
                o[e] = graft_from_f32<T>((expf(f[e] - lse) - (c == t ? 1.0f : 0.0f)) * scale);
            }
            ov[i] = packed;
        }
        return;
    }
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float p = expf(graft_to_f32(logits[base + i]) - lse);
        out[base + i] = graft_from_f32<T>((p - (i == t ? 1.0f : 0.0f)) * scale);
    }
}

#define GRAFT_CROSS_ENTROPY(suffix, T)                                                       \
    extern "C" __global__ void graft_cross_entropy_rows_##suffix(                            \
        const T* logits, const unsigned int* targets, float* rows_out, unsigned int rows,    \
        unsigned int vocab) {                                                                \
        graft_cross_entropy_rows<T>(logits, targets, rows_out, rows, vocab);                 \
    }                                                                                        \
    extern "C" __global__ void graft_cross_entropy_backward_##suffix(                        \
        const T* logits, const unsigned int* targets, const float* saved,                    \
        const float* dloss, T* out, unsigned int rows, unsigned int vocab) {                 \
        graft_cross_entropy_backward<T>(logits, targets, saved, dloss, out, rows, vocab);    \
    }
GRAFT_FOR_DTYPES(GRAFT_CROSS_ENTROPY)
