// The shared test bodies' elementwise f32 kernels, compiled once per device with NVRTC by
// `CudaTestKernels::load`. Every kernel is a grid-stride loop over `n` elements, so any launch
// grid covers any `n`. `dst` may alias an input (in-place updates), so no pointer is __restrict__.

extern "C" __global__ void graft_fill_f32(float* dst, unsigned long long n, float value) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dst[i] = value;
    }
}

extern "C" __global__ void graft_add_f32(float* dst, const float* a, const float* b,
                                         unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dst[i] = a[i] + b[i];
    }
}

extern "C" __global__ void graft_mul_f32(float* dst, const float* a, const float* b,
                                         unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dst[i] = a[i] * b[i];
    }
}

extern "C" __global__ void graft_axpb_f32(float* dst, const float* x, float a, float b,
                                          unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dst[i] = a * x[i] + b;
    }
}
