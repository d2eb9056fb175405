
// Both row kernels read and write 16 bytes at a time (E = GraftVec<T>::E elements a thread a
// step) where the row length is a multiple of E and every pointer is 16-byte aligned, and an
// element at a time otherwise; the arithmetic per element is the same either way.
template <typename T>
__device__ __forceinline__ bool graft_norm_wide(unsigned int cols, const void* a, const void* b,
                                                const void* c, const void* d, const void* e,
                                                const void* f) {
    return cols % GraftVec<T>::E == 0u &&
           (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c |
             (unsigned long long)d | (unsigned long long)e | (unsigned long long)f) %
            16u) == 0u;
}

template <typename T>
__device__ void graft_rms_norm(const T* x, const T* w, T* y, unsigned int cols, float eps) {
    const int E = GraftVec<T>::E;
    __shared__ float scratch[32];
    const unsigned long long row = (unsigned long long)blockIdx.x * cols;
    const bool wide = graft_norm_wide<T>(cols, x, w, y, x + row, y + row, w);
    const uint4* xv = reinterpret_cast<const uint4*>(x + row);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    float squares = 0.0f;
    if (wide) {
        for (unsigned int i = threadIdx.x; i < cols / E; i += blockDim.x) {
            float v[E];
            GraftVec<T>::unpack(xv[i], v);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                squares += v[e] * v[e];
            }
        }
    } else {
        for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = graft_to_f32(x[row + i]);
            squares += v * v;
        }
    }
    const float r = 1.0f / sqrtf(graft_block_sum(squares, scratch) / (float)cols + eps);
    if (wide) {
        uint4* yv = reinterpret_cast<uint4*>(y + row);
        for (unsigned int i = threadIdx.x; i < cols / E; i += blockDim.x) {
            float v[E];
            float g[E];
            GraftVec<T>::unpack(xv[i], v);
            GraftVec<T>::unpack(wv[i], g);
            uint4 packed;
            T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                o[e] = graft_from_f32<T>(v[e] * r * g[e]);
            }
            yv[i] = packed;
        }
        return;
    }
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        y[row + i] = graft_from_f32<T>(graft_to_f32(x[row + i]) * r * graft_to_f32(w[i]));
    }
}

// dx into out (in T; plus res, the residual stream's gradient, unless it is null), each row's
// dy * x * r into shares (f32, [rows, cols]).
template <typename T>
__device__ void graft_rms_norm_backward(const T* x, const T* w, const T* dy, const T* res,
                                        T* out, float* shares, unsigned int cols, float eps) {
    const int E = GraftVec<T>::E;
    __shared__ float scratch[32];
    const unsigned long long row = (unsigned long long)blockIdx.x * cols;
    const bool wide = graft_norm_wide<T>(cols, x + row, w, dy + row, res ? res + row : nullptr,
                                         out + row, shares + row);
    const uint4* xv = reinterpret_cast<const uint4*>(x + row);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const uint4* gv = reinterpret_cast<const uint4*>(dy + row);
    float squares = 0.0f;
    float dot = 0.0f;
    if (wide) {
        for (unsigned int i = threadIdx.x; i < cols / E; i += blockDim.x) {
            float v[E];
            float ww[E];
            float g[E];
            GraftVec<T>::unpack(xv[i], v);
            GraftVec<T>::unpack(wv[i], ww);
            GraftVec<T>::unpack(gv[i], g);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                squares += v[e] * v[e];
                dot += g[e] * ww[e] * v[e];
            }
        }
    } else {
        for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = graft_to_f32(x[row + i]);
            squares += v * v;
            dot += graft_to_f32(dy[row + i]) * graft_to_f32(w[i]) * v;
        }
    }
    const float r = 1.0f / sqrtf(graft_block_sum(squares, scratch) / (float)cols + eps);
    const float c = r * r * r * graft_block_sum(dot, scratch) / (float)cols;
    if (wide) {
        const uint4* rv = reinterpret_cast<const uint4*>(res + row);
        uint4* ov = reinterpret_cast<uint4*>(out + row);
        float4* sv = reinterpret_cast<float4*>(shares + row);
        for (unsigned int i = threadIdx.x; i < cols / E; i += blockDim.x) {
            float v[E];
            float ww[E];
            float g[E];
            float rr[E];
            GraftVec<T>::unpack(xv[i], v);
            GraftVec<T>::unpack(wv[i], ww);
            GraftVec<T>::unpack(gv[i], g);
            if (res != nullptr) {
                GraftVec<T>::unpack(rv[i], rr);
            }
            uint4 packed;
            T* o = reinterpret_cast<T*>(&packed);
            float sh[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float d = r * g[e] * ww[e] - v[e] * c;
                o[e] = graft_from_f32<T>(res == nullptr ? d : d + rr[e]);
                sh[e] = g[e] * v[e] * r;
            }
            ov[i] = packed;
#pragma unroll
            for (int q = 0; q < E / 4; ++q) {
                sv[i * (E / 4) + q] = make_float4(sh[4 * q], sh[4 * q + 1], sh[4 * q + 2],
                                                  sh[4 * q + 3]);
            }
        }
        return;
    }
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
