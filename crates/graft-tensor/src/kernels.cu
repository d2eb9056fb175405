// graft-tensor's CUDA kernels: compiled once per device with NVRTC (see cuda.rs), launched
// through graft-cuda's checked launch API. Every kernel keeps its shapes in its arguments and
// reads device scalars (the position) when it runs, so a captured graph replays correctly.
// Reductions use fixed patterns (xor-shuffle butterflies within warps, then a fixed order or
// tree over warps in shared memory), never atomics, so results are deterministic.
// Positions are clamped into [0, ctx) so no kernel can touch memory outside its operands.

#define GT_BLOCK 256
#define GT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int gt_clamp_pos(const int* pos, unsigned int len) {
    int p = *pos;
    if (p < 0) p = 0;
    if ((unsigned int)p >= len) p = (int)len - 1;
    return p;
}

__device__ __forceinline__ float gt_warp_sum(float v) {
    // xor butterfly: every lane ends with the same value (each add is commutative).
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float gt_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of v over the block (every thread gets the result, in a fixed order). `buf` holds at
// least GT_BLOCK / 32 floats.
__device__ float gt_block_sum(float v, float* buf) {
    v = gt_warp_sum(v);
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = 0.0f;
#pragma unroll
    for (int i = 0; i < GT_BLOCK / 32; ++i) r += buf[i];
    __syncthreads();
    return r;
}

__device__ float gt_block_max(float v, float* buf) {
    v = gt_warp_max(v);
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = buf[0];
#pragma unroll
    for (int i = 1; i < GT_BLOCK / 32; ++i) r = fmaxf(r, buf[i]);
    __syncthreads();
    return r;
}

__device__ __forceinline__ float gt_gelu_f(float v) {
    const float k = 0.7978845608f;  // sqrt(2 / pi)
    return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
}

// Layer norm of one row by the whole block (two-pass). `row` may be memory this thread just
// wrote with the same column mapping (c = threadIdx.x + i * blockDim.x).
__device__ void gt_norm_row(float* orow, const float* row, const float* gamma, const float* beta,
                            unsigned int dim, float eps, float* buf) {
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

// Layer norm of one row whose values this thread holds in registers: v[u] is column
// threadIdx.x + u * GT_BLOCK (columns past dim hold 0 and are ignored). Needs dim <=
// GT_BLOCK * GT_NORM_PER and blockDim.x == GT_BLOCK. gamma and beta are loaded before the
// reductions so their latency overlaps them.
#define GT_NORM_PER 4
__device__ __forceinline__ void gt_norm_regs(float* orow, const float* v, const float* gamma,
                                             const float* beta, unsigned int dim, float eps,
                                             float* buf) {
    float g[GT_NORM_PER], bt[GT_NORM_PER];
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < GT_NORM_PER; ++u) {
        unsigned int c = threadIdx.x + u * GT_BLOCK;
        g[u] = c < dim ? gamma[c] : 0.0f;
        bt[u] = c < dim ? beta[c] : 0.0f;
        s += v[u];
    }
    const float mean = gt_block_sum(s, buf) / (float)dim;
    float q = 0.0f;
#pragma unroll
    for (int u = 0; u < GT_NORM_PER; ++u) {
        unsigned int c = threadIdx.x + u * GT_BLOCK;
        float d = c < dim ? v[u] - mean : 0.0f;
        q += d * d;
    }
    const float inv = 1.0f / sqrtf(gt_block_sum(q, buf) / (float)dim + eps);
#pragma unroll
    for (int u = 0; u < GT_NORM_PER; ++u) {
        unsigned int c = threadIdx.x + u * GT_BLOCK;
        if (c < dim) orow[c] = (v[u] - mean) * inv * g[u] + bt[u];
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

// One thread: pos = min(pos + 1, limit) (argmax_step over no rows).
extern "C" __global__ void gt_increment(int* pos, int limit) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        int p = *pos;
        *pos = p < limit ? p + 1 : limit;
    }
}

// ---- Fused kernels of the decode step ----

// grid: rows, block: GT_BLOCK. x[r, :] = table[ids[r], :] (zeros outside the vocabulary) +
// pos_table[pos, :]; h[r, :] = layer_norm(x[r, :]).
extern "C" __global__ void gt_embed_norm(float* x, float* h, const int* ids, const float* table,
                                         const float* pos_table, const int* pos,
                                         const float* gamma, const float* beta,
                                         unsigned int vocab, unsigned int ctx, unsigned int dim,
                                         float eps) {
    __shared__ float buf[GT_BLOCK / 32];
    unsigned int r = blockIdx.x;
    int id = ids[r];
    bool valid = id >= 0 && (unsigned int)id < vocab;
    int p = gt_clamp_pos(pos, ctx);
    float* xrow = x + (unsigned long long)r * dim;
    const float* trow = table + (unsigned long long)(valid ? id : 0) * dim;
    const float* prow = pos_table + (unsigned long long)p * dim;
    if (dim <= GT_BLOCK * GT_NORM_PER) {
        float v[GT_NORM_PER];
#pragma unroll
        for (int u = 0; u < GT_NORM_PER; ++u) {
            unsigned int c = threadIdx.x + u * GT_BLOCK;
            v[u] = c < dim ? (valid ? trow[c] : 0.0f) + prow[c] : 0.0f;
            if (c < dim) xrow[c] = v[u];
        }
        gt_norm_regs(h + (unsigned long long)r * dim, v, gamma, beta, dim, eps, buf);
        return;
    }
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        xrow[c] = (valid ? trow[c] : 0.0f) + prow[c];
    }
    gt_norm_row(h + (unsigned long long)r * dim, xrow, gamma, beta, dim, eps, buf);
}

// Grid-stride over rows * cols: out = act(out + bias[col]) + res (each part optional; out
// already holds the product).
extern "C" __global__ void gt_epilogue(float* out, const float* bias, const float* res,
                                       unsigned long long n, unsigned int cols, int gelu) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float v = out[i];
        if (bias) v += bias[i % cols];
        if (gelu) v = gt_gelu_f(v);
        if (res) v += res[i];
        out[i] = v;
    }
}

// grid: rows, block: GT_BLOCK. xo[r, :] = x[r, :] + (a[r, :] + bias) (bias optional) and
// h[r, :] = layer_norm(xo[r, :]): a residual add folded into the next norm.
extern "C" __global__ void gt_add_norm(float* xo, float* h, const float* x, const float* a,
                                       const float* bias, const float* gamma, const float* beta,
                                       unsigned int dim, float eps) {
    __shared__ float buf[GT_BLOCK / 32];
    const unsigned long long off = (unsigned long long)blockIdx.x * dim;
    if (dim <= GT_BLOCK * GT_NORM_PER) {
        float v[GT_NORM_PER];
#pragma unroll
        for (int u = 0; u < GT_NORM_PER; ++u) {
            unsigned int c = threadIdx.x + u * GT_BLOCK;
            v[u] = c < dim ? x[off + c] + (a[off + c] + (bias ? bias[c] : 0.0f)) : 0.0f;
            if (c < dim) xo[off + c] = v[u];
        }
        gt_norm_regs(h + off, v, gamma, beta, dim, eps, buf);
        return;
    }
    for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
        xo[off + c] = x[off + c] + (a[off + c] + (bias ? bias[c] : 0.0f));
    }
    gt_norm_row(h + off, xo + off, gamma, beta, dim, eps, buf);
}

// Single-token attention of one (batch, head) per block, block: GT_BLOCK. qkv is [batch, 3 * dm]
// (q, k, v of the new token, plus bias[3 * dm] when given); its k and v are written into the caches at row pos first, then
// out[b, h, :] = softmax(scale * q . k[0..=pos]) . v[0..=pos], online over chunks of
// GT_ATT_CHUNK positions (scores in shared memory). Value columns are split into float4 (or
// scalar) lanes and positions into groups, added in a fixed order at the end.
// Requires head_dim <= 1024, and head_dim <= 256 unless head_dim % 4 == 0.
#define GT_ATT_CHUNK 1024
#define GT_MAX_HD 1024
extern "C" __global__ void gt_attention_step(float* out, const float* qkv, const float* bias,
                                             float* kc, float* vc, const int* pos,
                                             unsigned int heads,
                                             unsigned int hd, unsigned int ctx, float scale) {
    __shared__ __align__(16) float qs[GT_MAX_HD];
    __shared__ float ps[GT_ATT_CHUNK];
    __shared__ __align__(16) float red[GT_BLOCK * 4];
    __shared__ float buf[GT_BLOCK / 32];
    const unsigned int b = blockIdx.x / heads, h = blockIdx.x % heads;
    const unsigned int dm = heads * hd;
    const unsigned int p = (unsigned int)gt_clamp_pos(pos, ctx);
    const float* row = qkv + (unsigned long long)b * 3 * dm + (unsigned long long)h * hd;
    const unsigned long long cbase = (unsigned long long)b * ctx * dm + (unsigned long long)h * hd;
    const float* hb = bias ? bias + h * hd : 0;
    for (unsigned int t = threadIdx.x; t < hd; t += GT_BLOCK) {
        qs[t] = row[t] + (hb ? hb[t] : 0.0f);
        kc[cbase + (unsigned long long)p * dm + t] = row[dm + t] + (hb ? hb[dm + t] : 0.0f);
        vc[cbase + (unsigned long long)p * dm + t] = row[2 * dm + t] + (hb ? hb[2 * dm + t] : 0.0f);
    }
    __syncthreads();  // the cache rows at p (global, this block's) and qs are visible now
    const bool vec = (hd & 3u) == 0;
    const unsigned int W = vec ? 4 : 1;
    const unsigned int L = hd / W;                     // lanes over the head's columns
    const unsigned int G = L >= GT_BLOCK ? 1 : GT_BLOCK / L;  // position groups
    const unsigned int lane = threadIdx.x % L, g = threadIdx.x / L;
    const bool active = g < G;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = GT_NEG_INF, ssum = 0.0f;
    for (unsigned int c0 = 0; c0 <= p; c0 += GT_ATT_CHUNK) {
        const unsigned int cend = min(p + 1, c0 + GT_ATT_CHUNK);
        float mloc = GT_NEG_INF;
        for (unsigned int j = c0 + threadIdx.x; j < cend; j += GT_BLOCK) {
            const float* kr = kc + cbase + (unsigned long long)j * dm;
            float dot = 0.0f;
            if (vec) {
                for (unsigned int t = 0; t < hd; t += 4) {
                    float4 kv = *reinterpret_cast<const float4*>(kr + t);
                    float4 qv = *reinterpret_cast<const float4*>(qs + t);
                    dot = fmaf(qv.x, kv.x, dot);
                    dot = fmaf(qv.y, kv.y, dot);
                    dot = fmaf(qv.z, kv.z, dot);
                    dot = fmaf(qv.w, kv.w, dot);
                }
            } else {
                for (unsigned int t = 0; t < hd; ++t) dot = fmaf(qs[t], kr[t], dot);
            }
            float s = dot * scale;
            ps[j - c0] = s;
            mloc = fmaxf(mloc, s);
        }
        const float mc = gt_block_max(mloc, buf);
        const float mn = fmaxf(m, mc);
        const float corr = m == GT_NEG_INF ? 0.0f : expf(m - mn);
        float sloc = 0.0f;
        for (unsigned int j = c0 + threadIdx.x; j < cend; j += GT_BLOCK) {
            float e = expf(ps[j - c0] - mn);
            ps[j - c0] = e;
            sloc += e;
        }
        const float sc = gt_block_sum(sloc, buf);  // also makes ps visible to the block
        ssum = ssum * corr + sc;
        m = mn;
        acc[0] *= corr;
        acc[1] *= corr;
        acc[2] *= corr;
        acc[3] *= corr;
        if (active) {
            if (vec) {
                const float* vp = vc + cbase + lane * 4;
#pragma unroll 4
                for (unsigned int j = c0 + g; j < cend; j += G) {
                    float pj = ps[j - c0];
                    float4 vv = *reinterpret_cast<const float4*>(vp + (unsigned long long)j * dm);
                    acc[0] = fmaf(pj, vv.x, acc[0]);
                    acc[1] = fmaf(pj, vv.y, acc[1]);
                    acc[2] = fmaf(pj, vv.z, acc[2]);
                    acc[3] = fmaf(pj, vv.w, acc[3]);
                }
            } else {
                const float* vp = vc + cbase + lane;
                for (unsigned int j = c0 + g; j < cend; j += G) {
                    acc[0] = fmaf(ps[j - c0], vp[(unsigned long long)j * dm], acc[0]);
                }
            }
        }
        __syncthreads();  // ps is rewritten by the next chunk
    }
    if (active) {
        for (unsigned int w = 0; w < W; ++w) red[g * hd + lane * W + w] = acc[w];
    }
    __syncthreads();
    const float inv = 1.0f / ssum;
    float* orow = out + (unsigned long long)b * dm + (unsigned long long)h * hd;
    for (unsigned int t = threadIdx.x; t < hd; t += GT_BLOCK) {
        float s = 0.0f;
        for (unsigned int gg = 0; gg < G; ++gg) s += red[gg * hd + t];
        orow[t] = s * inv;
    }
}

__device__ __forceinline__ bool gt_better(float v, unsigned int i, float bv, unsigned int bi) {
    return v > bv || (v == bv && i < bi);
}

// grid: rows, block: any multiple of 32 up to 1024. First index of the maximum of row r of
// x + bias (bias optional; NaNs never win, all-NaN gives 0); then block 0 advances the position:
// pos = min(pos + 1, limit) (nothing before it in this kernel reads pos). The winner is the
// same whatever order entries are visited in (a total order: value, then lower index).
#define GT_ARGMAX_UNROLL 8
extern "C" __global__ void gt_argmax_step(int* out, const float* x, const float* bias,
                                          unsigned int cols, int* pos, int limit) {
    __shared__ float bv[32];
    __shared__ unsigned int bi[32];
    const float* row = x + (unsigned long long)blockIdx.x * cols;
    float best = GT_NEG_INF;
    unsigned int idx = 0xffffffffu;
    for (unsigned int base = 0; base < cols; base += blockDim.x * GT_ARGMAX_UNROLL) {
        float v[GT_ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < GT_ARGMAX_UNROLL; ++u) {
            unsigned int c = base + u * blockDim.x + threadIdx.x;
            v[u] = c < cols ? row[c] + (bias ? bias[c] : 0.0f) : GT_NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < GT_ARGMAX_UNROLL; ++u) {
            unsigned int c = base + u * blockDim.x + threadIdx.x;
            if (c < cols && gt_better(v[u], c, best, idx)) {
                best = v[u];
                idx = c;
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        unsigned int i = __shfl_xor_sync(0xffffffffu, idx, o);
        if (gt_better(v, i, best, idx)) {
            best = v;
            idx = i;
        }
    }
    if ((threadIdx.x & 31) == 0) {
        bv[threadIdx.x >> 5] = best;
        bi[threadIdx.x >> 5] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        best = bv[0];
        idx = bi[0];
        for (unsigned int w = 1; w < blockDim.x / 32; ++w) {
            if (gt_better(bv[w], bi[w], best, idx)) {
                best = bv[w];
                idx = bi[w];
            }
        }
        out[blockIdx.x] = idx == 0xffffffffu ? 0 : (int)idx;
        if (blockIdx.x == 0 && pos) {
            int p = *pos;
            *pos = p < limit ? p + 1 : limit;
        }
    }
}
