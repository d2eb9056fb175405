
template <typename T>
__device__ void graft_rms_norm(const T* x, const T* w, T* y, unsigned int cols, float eps) {
    __shared__ float scratch[32];
    const unsigned long long row = (unsigned long long)blockIdx.x * cols;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = graft_to_f32(x[row + i]);
        squares += v * v;
    }
    const float r = 1.0f / sqrtf(graft_block_sum(squares, scratch) / (float)cols + eps);
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        y[row + i] = graft_from_f32<T>(graft_to_f32(x[row + i]) * r * graft_to_f32(w[i]));
    }
}

// dx into out (in T; plus res, the residual stream's gradient, unless it is null), each row's
// dy * x * r into shares (f32, [rows, cols]).
template <typename T>
__device__ void graft_rms_norm_backward(const T* x, const T* w, const T* dy, const T* res,
                                        T* out, float* shares, unsigned int cols, float eps) {
    __shared__ float scratch[32];
    const unsigned long long row = (unsigned long long)blockIdx.x * cols;
    float squares = 0.0f;
    float dot = 0.0f;
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = graft_to_f32(x[row + i]);
        squares += v * v;
        dot += graft_to_f32(dy[row + i]) * graft_to_f32(w[i]) * v;
    }
    const float r = 1.0f / sqrtf(graft_block_sum(squares, scratch) / (float)cols + eps);
    const float c = r * r * r * graft_block_sum(dot, scratch) / (float)cols;
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = graft_to_f32(x[row + i]);
        const float g = graft_to_f32(dy[row + i]);
        const float d = r * g * graft_to_f32(w[i]) - v * c;
        out[row + i] = graft_from_f32<T>(res == nullptr ? d : d + graft_to_f32(res[row + i]));
        shares[row + i] = g * v * r;
    }
}

// The sums over rows of shares[row, c] in two passes, each in a fixed order. First
// partials[s, c] = the sum over rows s * chunk .. (s + 1) * chunk: a block of 8 warps per 32
// columns and chunk, warp k taking its chunk's rows k, k + 8, ..., then the 8 warp sums added
// in order. Then out[c] = the sum over s of partials[s, c], in order, a thread per column.
extern "C" __global__ void graft_column_partials(const float* shares, float* partials,
                                                 unsigned int rows, unsigned int cols,
                                                 unsigned int chunk) {
    __shared__ float sums[8][32];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int col = blockIdx.x * 32u + lane;
    const unsigned int first = blockIdx.y * chunk;
    const unsigned int end = min(first + chunk, rows);
    float s = 0.0f;
    if (col < cols) {
        for (unsigned int r = first + warp; r < end; r += 8u) {
            s += shares[(unsigned long long)r * cols + col];
        }
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && col < cols) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            t += sums[k][lane];
        }
        partials[(unsigned long long)blockIdx.y * cols + col] = t;
    }
}

template <typename T>
__device__ void graft_column_sum(const float* partials, T* out, unsigned int parts,
                                 unsigned int cols) {
    const unsigned int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col < cols) {
        float t = 0.0f;
        for (unsigned int s = 0; s < parts; ++s) {
            t += partials[(unsigned long long)s * cols + col];
        }
        out[col] = graft_from_f32<T>(t);
    }
}

#define GRAFT_RMS_NORM(suffix, T)                                                            \
    extern "C" __global__ void graft_rms_norm_##suffix(                                      \
        const T* x, const T* w, T* y, unsigned int cols, float eps) {                        \
        graft_rms_norm<T>(x, w, y, cols, eps);                                               \
    }                                                                                        \
    extern "C" __global__ void graft_rms_norm_backward_##suffix(                             \
        const T* x, const T* w, const T* dy, const T* res, T* out, float* shares,            \
        unsigned int cols, float eps) {                                                      \
        graft_rms_norm_backward<T>(x, w, dy, res, out, shares, cols, eps);                   \
    }                                                                                        \
    extern "C" __global__ void graft_column_sum_##suffix(                                    \
        const float* partials, T* out, unsigned int parts, unsigned int cols) {              \
        graft_column_sum<T>(partials, out, parts, cols);                                     \
    }
GRAFT_FOR_DTYPES(GRAFT_RMS_NORM)
