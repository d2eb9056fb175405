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

// Programmatic dependent launch (compute capability 9.0+; elsewhere these compile to plain
// kernels). A slow kernel that lets its dependents start at once: it triggers them, spins for
// `spins` clock cycles, then fills.
extern "C" __global__ void graft_slow_fill_f32(float* dst, unsigned long long n, float value,
                                               unsigned long long spins) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const long long start = clock64();
    while ((unsigned long long)(clock64() - start) < spins) {
    }
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        dst[i] = value;
    }
}

// dst[i] = src[i], launched as a dependent of the kernel before it. With `early` each thread
// reads its first element *before* the wait: deliberately wrong (the read races with a
// predecessor still writing src), so that a test can see the race PDL allows.
extern "C" __global__ void graft_dependent_copy_f32(float* dst, const float* src,
                                                    unsigned long long n, unsigned int early) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    float seen = 0.0f;
    if (early && first < n) {
        seen = *(volatile const float*)(src + first);
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    for (unsigned long long i = first; i < n; i += stride) {
        dst[i] = (early && i == first) ? seen : src[i];
    }
}
