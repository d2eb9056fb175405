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

// Block-wide first index of the maximum of row + bias (bias optional; NaNs never win): every
// thread gets it (0xffffffff when every entry is NaN) and its value in *best. The winner is the
// same whatever order entries are visited in (a total order: value, then lower index). Block:
// any multiple of 32 up to 1024.
#define GT_ARGMAX_UNROLL 8
__device__ unsigned int gt_row_argmax(const float* row, const float* bias, unsigned int cols,
                                      float* best_value) {
    __shared__ float bv[32];
    __shared__ unsigned int bi[32];
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
        for (unsigned int w = 1; w < blockDim.x / 32; ++w) {
            if (gt_better(bv[w], bi[w], bv[0], bi[0])) {
                bv[0] = bv[w];
                bi[0] = bi[w];
            }
        }
    }
    __syncthreads();
    *best_value = bv[0];
    idx = bi[0];
    __syncthreads();
    return idx;
}

// grid: rows, block: any multiple of 32 up to 1024. First index of the maximum of row r of
// x + bias (gt_row_argmax; all-NaN gives 0); then block 0 advances the position:
// pos = min(pos + 1, limit) (nothing before it in this kernel reads pos).
extern "C" __global__ void gt_argmax_step(int* out, const float* x, const float* bias,
                                          unsigned int cols, int* pos, int limit) {
    float best;
    unsigned int idx = gt_row_argmax(x + (unsigned long long)blockIdx.x * cols, bias, cols, &best);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = idx == 0xffffffffu ? 0 : (int)idx;
        if (blockIdx.x == 0 && pos) {
            int p = *pos;
            *pos = p < limit ? p + 1 : limit;
        }
    }
}

// ---- Sampling (the rule of sampling.rs; the generator, graft_philox4x32_10, comes first in
// KERNELS_CU, from graft-philox) ----

// A total order on f32 bits (sampling.rs's order_key): NaN is 0, below everything.
__device__ __forceinline__ unsigned int gt_order_key(float v) {
    if (v != v) return 0u;
    unsigned int b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Adds 1 to hist[digit] for every lane of the warp that is `active`, with one shared atomic
// per distinct digit (lanes of a digit found by ballots over its 8 bits). Every lane of the
// warp must call it.
__device__ __forceinline__ void gt_warp_count(unsigned int* hist, unsigned int digit,
                                              bool active) {
    unsigned int peers = __ballot_sync(0xffffffffu, active);
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        unsigned int one = (digit >> b) & 1u;
        unsigned int bit = __ballot_sync(0xffffffffu, one);
        peers &= one ? bit : ~bit;
    }
    if (active && (threadIdx.x & 31u) == (unsigned int)(__ffs(peers) - 1)) {
        atomicAdd(&hist[digit], (unsigned int)__popc(peers));
    }
}

// The order key of the k-th largest entry of row + bias (1 <= k <= cols), by a radix select
// over the keys' bytes, most significant first. Integer counts only, so exact. Block: a
// multiple of 32, at least 256.
__device__ unsigned int gt_kth_key(const float* row, const float* bias, unsigned int cols,
                                   unsigned int k, unsigned int* hist, unsigned int* sel) {
    unsigned int prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (unsigned int i = threadIdx.x; i < 256u; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        for (unsigned int base = 0; base < cols; base += blockDim.x) {
            unsigned int c = base + threadIdx.x;
            unsigned int key = c < cols ? gt_order_key(row[c] + (bias ? bias[c] : 0.0f)) : 0u;
            gt_warp_count(hist, (key >> shift) & 255u, c < cols && (key & mask) == prefix);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l counts digits 255 - 8l down to 248 - 8l; exactly one lane holds the k-th.
            unsigned int lane = threadIdx.x, top = 255u - 8u * lane, s = 0u;
            for (unsigned int d = 0; d < 8u; ++d) s += hist[top - d];
            unsigned int incl = s;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned int n = __shfl_up_sync(0xffffffffu, incl, o);
                if ((int)lane >= o) incl += n;
            }
            unsigned int run = incl - s;
            if (run < k && k <= incl) {
                for (unsigned int d = 0; d < 8u; ++d) {
                    unsigned int h = hist[top - d];
                    if (run + h >= k) {
                        sel[0] = top - d;
                        sel[1] = k - run;
                        break;
                    }
                    run += h;
                }
            }
        }
        __syncthreads();
        prefix |= sel[0] << shift;
        mask |= 255u << shift;
        k = sel[1];
        __syncthreads();
    }
    return prefix;
}

// Inclusive block scan of v in thread order (a fixed pattern: Hillis-Steele within warps,
// then over the warps' totals); *total gets the last thread's result. wsum: 33 floats.
__device__ float gt_block_scan(float v, float* wsum, float* total) {
    unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, v, o);
        if ((int)lane >= o) v += n;
    }
    if (lane == 31u) wsum[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < blockDim.x / 32 ? wsum[lane] : 0.0f;
        for (int o = 1; o < 32; o <<= 1) {
            float n = __shfl_up_sync(0xffffffffu, t, o);
            if ((int)lane >= o) t += n;
        }
        wsum[lane] = t;
    }
    __syncthreads();
    float r = (warp > 0 ? wsum[warp - 1] : 0.0f) + v;
    if (threadIdx.x == blockDim.x - 1) wsum[32] = r;
    __syncthreads();
    *total = wsum[32];
    __syncthreads();
    return r;
}

// The running sums of the kept entries' weights exp((v - m) / temp) (kept: order key at
// least thr, not NaN) in index order, a block-wide chunk at a time. Returns the total; with
// target >= 0, stops at the first chunk where a running sum exceeds target and puts the
// lowest such index in *pick (shared, preset to 0xffffffff by the caller).
__device__ float gt_weight_scan(const float* row, const float* bias, unsigned int cols, float m,
                                float temp, unsigned int thr, float target, float* wsum,
                                unsigned int* pick) {
    float running = 0.0f;
    for (unsigned int base = 0; base < cols; base += blockDim.x) {
        unsigned int c = base + threadIdx.x;
        float w = 0.0f;
        if (c < cols) {
            float v = row[c] + (bias ? bias[c] : 0.0f);
            unsigned int key = gt_order_key(v);
            if (key != 0u && key >= thr) w = expf((v - m) / temp);
        }
        float chunk;
        float cum = running + gt_block_scan(w, wsum, &chunk);
        if (target >= 0.0f) {
            bool hit = c < cols && cum > target;
            if (__syncthreads_or(hit)) {
                if (hit) atomicMin(pick, c);
                __syncthreads();
                return running;
            }
        }
        running = running + chunk;
    }
    return running;
}

// grid: rows, block: 1024 (a multiple of 32, at least 256). Row r's token from x + bias as
// sampling.rs's sample_row picks it, with the uniform of Philox counter (offset, r) under the
// key of rng = (key lo, key hi, offset lo, offset hi). Reads rng only: gt_sample_advance moves
// it on after every row has drawn.
extern "C" __global__ void gt_sample_step(int* out, const float* x, const float* bias,
                                          unsigned int cols, const unsigned int* rng, float temp,
                                          unsigned int top_k) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int sel[2];
    __shared__ float wsum[33];
    __shared__ unsigned int pick;
    const float* row = x + (unsigned long long)blockIdx.x * cols;
    float m;
    unsigned int best = gt_row_argmax(row, bias, cols, &m);
    bool infinite = (__float_as_uint(m) & 0x7fffffffu) == 0x7f800000u;
    if (best == 0xffffffffu || temp == 0.0f || infinite) {
        if (threadIdx.x == 0) out[blockIdx.x] = best == 0xffffffffu ? 0 : (int)best;
        return;
    }
    unsigned int thr = 1u;
    if (top_k > 0u && top_k < cols) thr = gt_kth_key(row, bias, cols, top_k, hist, sel);
    unsigned int c[4] = {rng[2], rng[3], blockIdx.x, 0u};
    graft_philox4x32_10(c, rng[0], rng[1]);
    float u = graft_philox_unit(c[0]);
    if (threadIdx.x == 0) pick = 0xffffffffu;
    float total = gt_weight_scan(row, bias, cols, m, temp, thr, -1.0f, wsum, &pick);
    gt_weight_scan(row, bias, cols, m, temp, thr, u * total, wsum, &pick);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = pick == 0xffffffffu ? (int)best : (int)pick;
}

// One thread: the generator's offset += 1 (64-bit) and pos = min(pos + 1, limit): the end of a
// sampling step, after gt_sample_step.
extern "C" __global__ void gt_sample_advance(unsigned int* rng, int* pos, int limit) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned int lo = rng[2] + 1u;
        rng[2] = lo;
        if (lo == 0u) rng[3] += 1u;
        int p = *pos;
        *pos = p < limit ? p + 1 : limit;
    }
}

// ---- Token loops (generate.rs): one block ----

// out[0 .. steps * rows) = -1 (PAD), cur = tokens, left = limits, ctl = (flag, iteration 0):
// the flag is set if steps > 0, *pos < ctx and some row has a limit above 0.
extern "C" __global__ void gt_loop_begin(int* out, int* cur, int* left, unsigned int* ctl,
                                         const int* pos, const int* tokens, const int* limits,
                                         unsigned int rows, unsigned int steps, int ctx) {
    int active = 0;
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) {
        cur[r] = tokens[r];
        int l = limits[r];
        left[r] = l;
        active |= l > 0;
    }
    unsigned long long n = (unsigned long long)steps * rows;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = -1;
    int any = __syncthreads_or(active);
    if (threadIdx.x == 0) {
        ctl[0] = (any && steps > 0u && *pos < ctx) ? 1u : 0u;
        ctl[1] = 0u;
    }
}

// The end of iteration i = ctl[1]: each row with tokens left writes next into out[i] and has
// one fewer left (none after eos); cur = next; ctl = (flag, i + 1), the flag set while
// i + 1 < steps, *pos < ctx and some row has tokens left.
extern "C" __global__ void gt_loop_record(int* out, int* cur, int* left, unsigned int* ctl,
                                          const int* pos, const int* next, unsigned int rows,
                                          unsigned int steps, int ctx, int eos) {
    unsigned int i = ctl[1];
    int active = 0;
    for (unsigned int r = threadIdx.x; r < rows; r += blockDim.x) {
        int t = next[r];
        int l = left[r];
        if (l > 0 && i < steps) {
            out[(unsigned long long)i * rows + r] = t;
            l = t == eos ? 0 : l - 1;
            left[r] = l;
        }
        cur[r] = t;
        active |= l > 0;
    }
    // Also orders every thread's read of ctl[1] before thread 0 writes it.
    int any = __syncthreads_or(active);
    if (threadIdx.x == 0) {
        ctl[0] = (any && i + 1u < steps && *pos < ctx) ? 1u : 0u;
        ctl[1] = i + 1u;
    }
}
