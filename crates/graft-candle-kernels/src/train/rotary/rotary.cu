
// Pair p of row r (position r % seq): dims (i, i + half) of head h for the half style, (2i,
// 2i + 1) for the interleaved one; sign -1 rotates backwards (the backward pass).
template <typename T>
__device__ void graft_rotary(const T* x, const T* cos, const T* sin, T* y,
                             unsigned long long pairs, unsigned int seq, unsigned int heads,
                             unsigned int half, unsigned int interleaved, float sign) {
    const unsigned long long p = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= pairs) {
        return;
    }
    const unsigned long long per_row = (unsigned long long)heads * half;
    const unsigned long long row = p / per_row;
    const unsigned int within = (unsigned int)(p % per_row);
    const unsigned int h = within / half;
    const unsigned int i = within % half;
    const unsigned int pos = (unsigned int)(row % seq);
    const unsigned long long base = row * per_row * 2 + (unsigned long long)h * half * 2;
    const unsigned long long a = base + (interleaved ? 2 * i : i);
    const unsigned long long b = base + (interleaved ? 2 * i + 1 : i + half);
    const float c = graft_to_f32(cos[(unsigned long long)pos * half + i]);
    const float s = sign * graft_to_f32(sin[(unsigned long long)pos * half + i]);
    const float u = graft_to_f32(x[a]);
    const float v = graft_to_f32(x[b]);
    y[a] = graft_from_f32<T>(u * c - v * s);
    y[b] = graft_from_f32<T>(v * c + u * s);
}

#define GRAFT_ROTARY(suffix, T)                                                              \
    extern "C" __global__ void graft_rotary_##suffix(                                        \
        const T* x, const T* cos, const T* sin, T* y, unsigned long long pairs,              \
        unsigned int seq, unsigned int heads, unsigned int half, unsigned int interleaved,   \
        float sign) {                                                                        \
        graft_rotary<T>(x, cos, sin, y, pairs, seq, heads, half, interleaved, sign);         \
    }
GRAFT_FOR_DTYPES(GRAFT_ROTARY)
