// A decode step's own kernels (after the prelude of nvrtc.rs): the embedding, and the RMS norm
// of rows the tensor-core projections take.

// The embedding of the step's tokens: grid (batch), row b of the output is row tokens[b] of
// the table (a token past the table reads its last row: the kernel cannot report it; the
// CPU's index_select fails instead). With `split` (a rank's rows of a table split by
// vocabulary, from row `first`), row tokens[b] - first where the token is in the rank's range,
// zeros where it is not.
template <typename T>
__device__ void graft_step_embed(const unsigned int* tokens, const T* table, T* out,
                                 unsigned int hidden, unsigned int vocab, unsigned int first,
                                 unsigned int split) {
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int b = blockIdx.x;
    unsigned int t = tokens[b];
    T* dst = out + (unsigned long long)b * hidden;
    if (split) {
        if (t < first || t - first >= vocab) {
            for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
                dst[i] = graft_from_f32<T>(0.0f);
            }
            return;
        }
        t -= first;
    } else if (t >= vocab) {
        t = vocab - 1u;
    }
    const T* src = table + (unsigned long long)t * hidden;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = src[i];
    }
}

#define GRAFT_STEP_EMBED(suffix, T)                                                          \
    extern "C" __global__ void graft_step_embed_##suffix(                                    \
        const unsigned int* tokens, const T* table, T* out, unsigned int hidden,             \
        unsigned int vocab, unsigned int first, unsigned int split) {                        \
        graft_step_embed<T>(tokens, table, out, hidden, vocab, first, split);                \
    }
GRAFT_FOR_DTYPES(GRAFT_STEP_EMBED)

// x / sqrt(mean(x^2) + eps) * weight, each row computed in f32 and rounded once to T (as
// rms_norm): grid (rows), one block of whole warps per row; hidden a multiple of 8 and every
// row 16-byte aligned (what the tensor-core projections after it need too), read and written
// 16 bytes at a time, the second pass from L1.
template <typename T>
__device__ void graft_step_norm(const T* x, const T* weight, float eps, T* out,
                                unsigned int hidden) {
    __shared__ float scratch[32];
    graft_pdl_trigger();
    graft_pdl_wait();
    const uint4* row = reinterpret_cast<const uint4*>(x + (unsigned long long)blockIdx.x * hidden);
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    uint4* dst = reinterpret_cast<uint4*>(out + (unsigned long long)blockIdx.x * hidden);
    const unsigned int chunks = hidden / 8u;
    float squares = 0.0f;
    for (unsigned int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float f[8];
        GraftVec<T>::unpack(row[c], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            squares += f[e] * f[e];
        }
    }
    const float r = 1.0f / sqrtf(graft_block_sum(squares, scratch) / (float)hidden + eps);
    for (unsigned int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float f[8];
        float g[8];
        GraftVec<T>::unpack(row[c], f);
        GraftVec<T>::unpack(__ldg(w + c), g);
        unsigned int packed[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            packed[e] = graft_pack2(graft_from_f32<T>(f[2 * e] * r * g[2 * e]),
                                    graft_from_f32<T>(f[2 * e + 1] * r * g[2 * e + 1]));
        }
        dst[c] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}

#define GRAFT_STEP_NORM(suffix, T)                                                           \
    extern "C" __global__ void graft_step_norm_##suffix(const T* x, const T* weight,         \
                                                        float eps, T* out,                   \
                                                        unsigned int hidden) {               \
        graft_step_norm<T>(x, weight, eps, out, hidden);                                     \
    }
GRAFT_STEP_NORM(bf16, GraftBf16)
GRAFT_STEP_NORM(f16, GraftF16)
