
// rows_out[row] = lse - logits[row, target] (NaN for a target past the vocabulary),
// rows_out[rows + row] = lse.
template <typename T>
__device__ void graft_cross_entropy_rows(const T* logits, const unsigned int* targets,
                                         float* rows_out, unsigned int rows,
                                         unsigned int vocab) {
    __shared__ float scratch[32];
    const unsigned int r = blockIdx.x;
    const T* x = logits + (unsigned long long)r * vocab;
    float m = GRAFT_NEG_INF;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        m = fmaxf(m, graft_to_f32(x[i]));
    }
    m = graft_block_max(m, scratch);
    float s = 0.0f;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        s += expf(graft_to_f32(x[i]) - m);
    }
    s = graft_block_sum(s, scratch);
    if (threadIdx.x == 0) {
        const float lse = m + logf(s);
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

// dlogits[row, i] = (exp(logits[row, i] - lse) - (i == target)) * dloss / rows.
template <typename T>
__device__ void graft_cross_entropy_backward(const T* logits, const unsigned int* targets,
                                             const float* saved, const float* dloss, T* out,
                                             unsigned int rows, unsigned int vocab) {
    const unsigned int r = blockIdx.x;
    const unsigned long long base = (unsigned long long)r * vocab;
    const float lse = saved[rows + r];
    const unsigned int t = targets[r];
    const float scale = t < vocab ? dloss[0] / (float)rows : __uint_as_float(0x7fc00000u);
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
