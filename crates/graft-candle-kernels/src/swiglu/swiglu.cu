
template <typename T>
__device__ void graft_swiglu(const T* gate, const T* up, T* out, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float g = graft_to_f32(gate[i]);
    float u = graft_to_f32(up[i]);
    out[i] = graft_from_f32<T>(g / (1.0f + expf(-g)) * u);
}

#define GRAFT_SWIGLU(suffix, T)                                                              \
    extern "C" __global__ void graft_swiglu_##suffix(                                        \
        const T* gate, const T* up, T* out, unsigned long long n) {                          \
        graft_swiglu<T>(gate, up, out, n);                                                   \
    }
GRAFT_FOR_DTYPES(GRAFT_SWIGLU)

// out[0 .. n]: the gate's gradient, out[n .. 2n]: the up's.
template <typename T>
__device__ void graft_swiglu_backward(const T* gate, const T* up, const T* dy, T* out,
                                      unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float g = graft_to_f32(gate[i]);
    const float u = graft_to_f32(up[i]);
    const float d = graft_to_f32(dy[i]);
    const float s = 1.0f / (1.0f + expf(-g));
    out[i] = graft_from_f32<T>(d * u * s * (1.0f + g * (1.0f - s)));
    out[n + i] = graft_from_f32<T>(d * g * s);
}

#define GRAFT_SWIGLU_BACKWARD(suffix, T)                                                     \
    extern "C" __global__ void graft_swiglu_backward_##suffix(                               \
        const T* gate, const T* up, const T* dy, T* out, unsigned long long n) {             \
        graft_swiglu_backward<T>(gate, up, dy, out, n);                                      \
    }
GRAFT_FOR_DTYPES(GRAFT_SWIGLU_BACKWARD)
