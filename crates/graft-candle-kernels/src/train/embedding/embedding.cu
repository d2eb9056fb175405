
template <typename T>
__device__ void graft_embedding(const T* table, const unsigned int* ids, T* out,
                                unsigned long long total, unsigned int vocab, unsigned int d) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) {
        return;
    }
    const unsigned int id = ids[i / d];
    const unsigned int c = (unsigned int)(i % d);
    out[i] = id < vocab ? table[(unsigned long long)id * d + c]
                        : graft_from_f32<T>(__uint_as_float(0x7fc00000u));
}

// counts[v] += the number of ids equal to v (counts zeroed before; ids past the vocabulary
// counted nowhere): one thread per id.
extern "C" __global__ void graft_embedding_counts(const unsigned int* ids, unsigned int* counts,
                                                  unsigned int n, unsigned int vocab) {
    const unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n && ids[t] < vocab) {
        atomicAdd(&counts[ids[t]], 1u);
    }
}

// Row v of the table's gradient: the sum of dy's rows whose id is v, in token order. A row no
// id names is zeros at once; the others read the ids 256 at a time (a ballot per warp finds
// the row's tokens) until they have found counts[v] of them, up to 2,048 columns a pass held in
// registers (8 a thread).
template <typename T>
__device__ void graft_embedding_backward(const T* dy, const unsigned int* ids,
                                         const unsigned int* counts, T* out, unsigned int n,
                                         unsigned int d) {
    __shared__ unsigned int masks[8];
    const unsigned int v = blockIdx.x;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int want = counts[v];
    for (unsigned int c0 = 0; c0 < d; c0 += 2048u) {
        float acc[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            acc[u] = 0.0f;
        }
        unsigned int found = 0;
        for (unsigned int t0 = 0; t0 < n && found < want; t0 += 256u) {
            const unsigned int t = t0 + threadIdx.x;
            const unsigned int hits = __ballot_sync(0xffffffffu, t < n && ids[t] == v);
            if (lane == 0) {
                masks[warp] = hits;
            }
            __syncthreads();
            for (unsigned int w = 0; w < 8u; ++w) {
                unsigned int bits = masks[w];
                found += __popc(bits);
                while (bits != 0u) {
                    const unsigned int b = __ffs(bits) - 1u;
                    bits &= bits - 1u;
                    const unsigned long long row = (unsigned long long)(t0 + w * 32u + b) * d;
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        const unsigned int c = c0 + u * 256u + threadIdx.x;
                        if (c < d) {
                            acc[u] += graft_to_f32(dy[row + c]);
                        }
                    }
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int c = c0 + u * 256u + threadIdx.x;
            if (c < d) {
                out[(unsigned long long)v * d + c] = graft_from_f32<T>(acc[u]);
            }
        }
    }
}

#define GRAFT_EMBEDDING(suffix, T)                                                           \
    extern "C" __global__ void graft_embedding_##suffix(                                     \
        const T* table, const unsigned int* ids, T* out, unsigned long long total,           \
        unsigned int vocab, unsigned int d) {                                                \
        graft_embedding<T>(table, ids, out, total, vocab, d);                                \
    }                                                                                        \
    extern "C" __global__ void graft_embedding_backward_##suffix(                            \
        const T* dy, const unsigned int* ids, const unsigned int* counts, T* out,            \
        unsigned int n, unsigned int d) {                                                    \
        graft_embedding_backward<T>(dy, ids, counts, out, n, d);                             \
    }
GRAFT_FOR_DTYPES(GRAFT_EMBEDDING)
