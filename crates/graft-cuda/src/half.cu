// 16-bit floats as structs of their bits (a kernel argument is a plain pointer) and their
// conversions to and from f32: bf16 by shifting and round-to-nearest-even, f16 by the PTX
// `cvt` instructions (what cuda_fp16.h does). No headers: NVRTC sources start with it.
struct GraftBf16 { unsigned short bits; };
struct GraftF16 { unsigned short bits; };

__device__ __forceinline__ float graft_to_f32(float x) { return x; }
__device__ __forceinline__ float graft_to_f32(GraftBf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}
__device__ __forceinline__ float graft_to_f32(GraftF16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T graft_from_f32(float x);
template <> __device__ __forceinline__ float graft_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ GraftBf16 graft_from_f32<GraftBf16>(float x) {
    unsigned int u = __float_as_uint(x);
    GraftBf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ GraftF16 graft_from_f32<GraftF16>(float x) {
    GraftF16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
