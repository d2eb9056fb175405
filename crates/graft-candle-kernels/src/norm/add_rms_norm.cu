
// out[0 .. rows * cols] = x + residual (rounded to T), out[rows * cols ..] = its RMS norm.
// A row of at most 8 elements per thread is held in registers (the weight loaded with x and
// the residual), so the row crosses global memory once; longer rows stride and read back.
template <typename T>
__device__ void graft_add_rms_norm(const T* x, const T* residual, const T* weight, T* out,
                                   unsigned int cols, unsigned long long total, float eps) {
    __shared__ float warp_sums[32];
    const unsigned long long row = (unsigned long long)blockIdx.x * cols;
    T* sum = out + row;
    T* normed = out + total + row;
    const bool held = cols <= blockDim.x * 8u;
    float v[8];
    float w[8];
    float squares = 0.0f;
    if (held) {
        // Every load issued before any store (the stores could alias them for the compiler).
        float a[8];
        float b[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int i = threadIdx.x + u * blockDim.x;
            a[u] = i < cols ? graft_to_f32(x[row + i]) : 0.0f;
            b[u] = i < cols ? graft_to_f32(residual[row + i]) : 0.0f;
            w[u] = i < cols ? graft_to_f32(weight[i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int i = threadIdx.x + u * blockDim.x;
            const T s = graft_from_f32<T>(a[u] + b[u]);
            v[u] = graft_to_f32(s);
            if (i < cols) {
                sum[i] = s;
                squares += v[u] * v[u];
            }
        }
    } else {
        for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
            T s = graft_from_f32<T>(graft_to_f32(x[row + i]) + graft_to_f32(residual[row + i]));
            sum[i] = s;
            float f = graft_to_f32(s);
            squares += f * f;
        }
    }
    squares = graft_warp_sum(squares);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = squares;
    }
    __syncthreads();
    if (warp == 0) {
        float s = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
        s = graft_warp_sum(s);
        if (lane == 0) {
            warp_sums[0] = s;
        }
    }
    __syncthreads();
    const float m = sqrtf(warp_sums[0] / (float)cols + eps);
    if (held) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const unsigned int i = threadIdx.x + u * blockDim.x;
            if (i < cols) {
                normed[i] = graft_from_f32<T>(v[u] / m * w[u]);
            }
        }
    } else {
        // Each thread reads back only the sums it wrote itself.
        for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
            normed[i] = graft_from_f32<T>(graft_to_f32(sum[i]) / m * graft_to_f32(weight[i]));
        }
    }
}

#define GRAFT_ADD_RMS_NORM(suffix, T)                                                        \
    extern "C" __global__ void graft_add_rms_norm_##suffix(                                  \
        const T* x, const T* residual, const T* weight, T* out, unsigned int cols,           \
        unsigned long long total, float eps) {                                               \
        graft_add_rms_norm<T>(x, residual, weight, out, cols, total, eps);                   \
    }
GRAFT_FOR_DTYPES(GRAFT_ADD_RMS_NORM)
