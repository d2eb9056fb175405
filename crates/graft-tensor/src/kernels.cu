// graft-tensor's CUDA kernels: compiled once per device with NVRTC (see cuda.rs), launched
// through graft-cuda's checked launch API. Every kernel keeps its shapes in its arguments and
// reads device scalars (the position) when it runs, so a captured graph replays correctly.
// Reductions use a fixed tree over blockDim.x = 256 threads, so results are deterministic.
// Positions are clamped into [0, ctx) so no kernel can touch memory outside its operands.

#define GT_BLOCK 256
#define GT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int gt_clamp_pos(const int* pos, unsigned int len) {
    int p = *pos;
    if (p < 0) p = 0;
    if ((unsigned int)p >= len) p = (int)len - 1;
    return p;
}

// Sum of v over the block (every thread gets the result). `buf` holds GT_BLOCK floats.
__device__ float gt_block_sum(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = GT_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}

__device__ float gt_block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int s = GT_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    float r = buf[0];
    __syncthreads();
    return r;
}

// grid: rows; out[r, :] = table[ids[r], :] or zeros for an id outside [0, vocab).
extern "C" __global__ void gt_embedding(float* out, const int* ids, const float* table,
                                        unsigned int vocab, unsigned int dim) {
    unsigned int r = blockIdx.x;
    int id = ids[r];
    bool valid = id >= 0 && (unsigned int)id < vocab;
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        out[(unsigned long long)r * dim + c] = valid ? table[(unsigned long long)id * dim + c] : 0.0f;
    }
}

// grid: rows; out[r, :] = x[r, :] + table[pos, :].
extern "C" __global__ void gt_add_position(float* out, const float* x, const float* table,
                                           const int* pos, unsigned int ctx, unsigned int dim) {
    unsigned int r = blockIdx.x;
    int p = gt_clamp_pos(pos, ctx);
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        out[(unsigned long long)r * dim + c] = x[(unsigned long long)r * dim + c] + table[(unsigned long long)p * dim + c];
    }
}

// Grid-stride; out may alias a or b.
extern "C" __global__ void gt_add(float* out, const float* a, const float* b,
                                  unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        out[i] = a[i] + b[i];
    }
}

// Grid-stride over rows * cols; out[i, j] += bias[j] in place.
extern "C" __global__ void gt_add_bias(float* out, const float* bias, unsigned long long n,
                                       unsigned int cols) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        out[i] += bias[i % cols];
    }
}

// grid: rows, block: GT_BLOCK. Two-pass mean and variance.
extern "C" __global__ void gt_layer_norm(float* out, const float* x, const float* gamma,
                                         const float* beta, unsigned int dim, float eps) {
    __shared__ float buf[GT_BLOCK];
    const float* row = x + (unsigned long long)blockIdx.x * dim;
    float* orow = out + (unsigned long long)blockIdx.x * dim;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) s += row[c];
    float mean = gt_block_sum(s, buf) / (float)dim;
    float v = 0.0f;
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        float d = row[c] - mean;
        v += d * d;
    }
    float var = gt_block_sum(v, buf) / (float)dim;
    float inv = 1.0f / sqrtf(var + eps);
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        orow[c] = (row[c] - mean) * inv * gamma[c] + beta[c];
    }
}

// Grid-stride GELU, tanh approximation.
extern "C" __global__ void gt_gelu(float* out, const float* x, unsigned long long n) {
    const float k = 0.7978845608f;  // sqrt(2 / pi)
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float v = x[i];
        out[i] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    }
}

// grid: rows, block: GT_BLOCK. Softmax over columns 0..=pos, zeros after.
extern "C" __global__ void gt_masked_softmax(float* out, const float* x, const int* pos,
                                             unsigned int cols) {
    __shared__ float buf[GT_BLOCK];
    const float* row = x + (unsigned long long)blockIdx.x * cols;
    float* orow = out + (unsigned long long)blockIdx.x * cols;
    unsigned int valid = (unsigned int)gt_clamp_pos(pos, cols) + 1;
    float m = GT_NEG_INF;
    for (unsigned int c = threadIdx.x; c < valid; c += blockDim.x) m = fmaxf(m, row[c]);
    m = gt_block_max(m, buf);
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < valid; c += blockDim.x) s += expf(row[c] - m);
    s = gt_block_sum(s, buf);
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) {
        orow[c] = c < valid ? expf(row[c] - m) / s : 0.0f;
    }
}

// grid: batch * heads; threads over cache positions j. out[b, h, j] = scale * q . k[b, j].
extern "C" __global__ void gt_attention_scores(float* out, const float* q, const float* k,
                                               const int* pos, unsigned int heads,
                                               unsigned int head_dim, unsigned int ctx,
                                               float scale) {
    unsigned int bh = blockIdx.x;
    unsigned int b = bh / heads, h = bh % heads;
    unsigned int dm = heads * head_dim;
    unsigned int p = (unsigned int)gt_clamp_pos(pos, ctx);
    const float* qh = q + (unsigned long long)b * dm + (unsigned long long)h * head_dim;
    for (unsigned int j = threadIdx.x; j < ctx; j += blockDim.x) {
        float acc = 0.0f;
        if (j <= p) {
            const float* kh = k + ((unsigned long long)b * ctx + j) * dm + (unsigned long long)h * head_dim;
            for (unsigned int t = 0; t < head_dim; ++t) acc += qh[t] * kh[t];
            acc *= scale;
        }
        out[(unsigned long long)bh * ctx + j] = acc;
    }
}

// grid: batch * heads; threads over head columns t. out[b, h, t] = sum_j p[b, h, j] v[b, j, h, t].
extern "C" __global__ void gt_attention_values(float* out, const float* probs, const float* v,
                                               const int* pos, unsigned int heads,
                                               unsigned int head_dim, unsigned int ctx) {
    unsigned int bh = blockIdx.x;
    unsigned int b = bh / heads, h = bh % heads;
    unsigned int dm = heads * head_dim;
    unsigned int p = (unsigned int)gt_clamp_pos(pos, ctx);
    const float* ph = probs + (unsigned long long)bh * ctx;
    for (unsigned int t = threadIdx.x; t < head_dim; t += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int j = 0; j <= p; ++j) {
            acc += ph[j] * v[((unsigned long long)b * ctx + j) * dm + (unsigned long long)h * head_dim + t];
        }
        out[(unsigned long long)b * dm + (unsigned long long)h * head_dim + t] = acc;
    }
}

// grid: batch; cache[b, pos, :] = x[b, :].
extern "C" __global__ void gt_kv_write(float* cache, const float* x, const int* pos,
                                       unsigned int ctx, unsigned int dim) {
    unsigned int b = blockIdx.x;
    unsigned int p = (unsigned int)gt_clamp_pos(pos, ctx);
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        cache[((unsigned long long)b * ctx + p) * dim + c] = x[(unsigned long long)b * dim + c];
    }
}

// grid: rows, block: GT_BLOCK. First index of the maximum; NaNs never win; all-NaN gives 0.
extern "C" __global__ void gt_argmax(int* out, const float* x, unsigned int cols) {
    __shared__ float bv[GT_BLOCK];
    __shared__ unsigned int bi[GT_BLOCK];
    const float* row = x + (unsigned long long)blockIdx.x * cols;
    float best = GT_NEG_INF;
    unsigned int idx = 0xffffffffu;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c];
        if (v > best || (v == best && c < idx)) {
            best = v;
            idx = c;
        }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (unsigned int s = GT_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = bv[threadIdx.x + s];
            unsigned int i = bi[threadIdx.x + s];
            if (v > bv[threadIdx.x] || (v == bv[threadIdx.x] && i < bi[threadIdx.x])) {
                bv[threadIdx.x] = v;
                bi[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bi[0] == 0xffffffffu ? 0 : (int)bi[0];
}

// One thread: pos = min(pos + 1, limit).
extern "C" __global__ void gt_increment(int* pos, int limit) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        int p = *pos;
        *pos = p < limit ? p + 1 : limit;
    }
}
