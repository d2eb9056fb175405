
// Each thread takes E = GraftVec<T>::E consecutive elements (16 bytes): one load of each
// input and one store where every pointer is 16-byte aligned and n a multiple of E, element
// by element otherwise; the same arithmetic per element either way.

// Whether 16-byte accesses reach every element of n-element tensors at these addresses.
template <typename T>
__device__ __forceinline__ bool graft_swiglu_wide(unsigned long long n, const void* a,
                                                  const void* b, const void* c,
                                                  const void* d) {
    return n % GraftVec<T>::E == 0u &&
           (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c |
             (unsigned long long)d) %
            16u) == 0u;
}

__device__ __forceinline__ float graft_silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

template <typename T>
__device__ void graft_swiglu(const T* gate, const T* up, T* out, unsigned long long n) {
    const int E = GraftVec<T>::E;
    const unsigned long long i0 = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * E;
    if (i0 >= n) {
        return;
    }
    if (graft_swiglu_wide<T>(n, gate, up, out, out)) {
        float g[E];
        float u[E];
        GraftVec<T>::unpack(*reinterpret_cast<const uint4*>(gate + i0), g);
        GraftVec<T>::unpack(*reinterpret_cast<const uint4*>(up + i0), u);
        uint4 packed;
        T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o[e] = graft_from_f32<T>(graft_silu_mul(g[e], u[e]));
        }
        *reinterpret_cast<uint4*>(out + i0) = packed;
        return;
    }
    for (unsigned long long i = i0; i < i0 + E && i < n; ++i) {
        out[i] = graft_from_f32<T>(graft_silu_mul(graft_to_f32(gate[i]), graft_to_f32(up[i])));
    }
}

#define GRAFT_SWIGLU(suffix, T)                                                              \
    extern "C" __global__ void graft_swiglu_##suffix(                                        \
        const T* gate, const T* up, T* out, unsigned long long n) {                          \
        graft_swiglu<T>(gate, up, out, n);                                                   \
    }
GRAFT_FOR_DTYPES(GRAFT_SWIGLU)

// The gate's and the up's gradients of one element.
__device__ __forceinline__ void graft_swiglu_grads(float g, float u, float d, float& dg,
                                                   float& du) {
    const float s = 1.0f / (1.0f + expf(-g));
    dg = d * u * s * (1.0f + g * (1.0f - s));
    du = d * g * s;
}

// out[0 .. n]: the gate's gradient, out[n .. 2n]: the up's.
template <typename T>
__device__ void graft_swiglu_backward(const T* gate, const T* up, const T* dy, T* out,
                                      unsigned long long n) {
    const int E = GraftVec<T>::E;
    const unsigned long long i0 = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * E;
    if (i0 >= n) {
        return;
    }
    if (graft_swiglu_wide<T>(n, gate, up, dy, out)) {
        float g[E];
        float u[E];
        float d[E];
        GraftVec<T>::unpack(*reinterpret_cast<const uint4*>(gate + i0), g);
        GraftVec<T>::unpack(*reinterpret_cast<const uint4*>(up + i0), u);
        GraftVec<T>::unpack(*reinterpret_cast<const uint4*>(dy + i0), d);
        uint4 packed_g;
        uint4 packed_u;
        T* og = reinterpret_cast<T*>(&packed_g);
        T* ou = reinterpret_cast<T*>(&packed_u);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            float dg;
            float du;
            graft_swiglu_grads(g[e], u[e], d[e], dg, du);
            og[e] = graft_from_f32<T>(dg);
            ou[e] = graft_from_f32<T>(du);
        }
        *reinterpret_cast<uint4*>(out + i0) = packed_g;
        *reinterpret_cast<uint4*>(out + n + i0) = packed_u;
        return;
    }
    for (unsigned long long i = i0; i < i0 + E && i < n; ++i) {
        float dg;
        float du;
        graft_swiglu_grads(graft_to_f32(gate[i]), graft_to_f32(up[i]), graft_to_f32(dy[i]), dg,
                           du);
        out[i] = graft_from_f32<T>(dg);
        out[n + i] = graft_from_f32<T>(du);
    }
}

#define GRAFT_SWIGLU_BACKWARD(suffix, T)                                                     \
    extern "C" __global__ void graft_swiglu_backward_##suffix(                               \
        const T* gate, const T* up, const T* dy, T* out, unsigned long long n) {             \
        graft_swiglu_backward<T>(gate, up, dy, out, n);                                      \
    }
GRAFT_FOR_DTYPES(GRAFT_SWIGLU_BACKWARD)
