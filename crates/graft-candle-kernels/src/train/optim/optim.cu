
#define GRAFT_OPTIM_THREADS 256
#define GRAFT_OPTIM_ILP 4
// The scalars' slots (OptimSlot).
#define GRAFT_OPTIM_LR 0
#define GRAFT_OPTIM_APPLIED 1
#define GRAFT_OPTIM_SKIPPED 2
#define GRAFT_OPTIM_NOT_FINITE 3

// One launch's tensors, by value (Table<D, N> in cuda.rs): tensor k has the D addresses
// addr[k], len[k] elements of dtype[k] (0 f32, 1 bf16, 2 f16) and the blocks from start[k] to
// the next tensor's first block (the grid's end for the last).
template <int D, int N> struct GraftOptimTable {
    unsigned long long addr[N][D];
    unsigned long long len[N];
    unsigned int start[N];
    unsigned int dtype[N];
    unsigned int count;
    unsigned int pad;
};

// AdamW's constants (AdamWConsts).
struct GraftAdamW {
    float beta1, rest1, beta2, rest2, eps, weight_decay, ln_beta1, ln_beta2;
};

// SGD's constants (SgdConsts).
struct GraftSgd {
    float momentum, weight_decay;
    unsigned int buffers, decays;
};

// This block's tensor (the last whose first block is at or before it) and its elements.
struct GraftOptimChunk {
    unsigned int k;
    unsigned long long first, end;
};

template <int D, int N>
__device__ __forceinline__ GraftOptimChunk graft_optim_chunk(const GraftOptimTable<D, N>& t) {
    unsigned int lo = 0, hi = t.count - 1;
    while (lo < hi) {
        unsigned int mid = (lo + hi + 1) / 2;
        if (t.start[mid] <= blockIdx.x) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    GraftOptimChunk c;
    c.k = lo;
    c.first = (unsigned long long)(blockIdx.x - t.start[lo]) * GRAFT_OPTIM_CHUNK;
    unsigned long long end = c.first + GRAFT_OPTIM_CHUNK;
    c.end = end < t.len[lo] ? end : t.len[lo];
    return c;
}

// The chunk's elements a thread handles: base + u * THREADS for u < ILP, over passes of
// THREADS * ILP elements.
#define GRAFT_OPTIM_PASSES(c)                                                                \
    for (unsigned long long base = (c).first + threadIdx.x; base < (c).end;                  \
         base += GRAFT_OPTIM_THREADS * GRAFT_OPTIM_ILP)
#define GRAFT_OPTIM_LANES(i, c)                                                              \
    _Pragma("unroll") for (int u = 0; u < GRAFT_OPTIM_ILP; ++u)                              \
        if (unsigned long long i = base + u * GRAFT_OPTIM_THREADS; i < (c).end)

template <typename T>
__device__ __forceinline__ bool graft_optim_finite(const T* __restrict__ g, GraftOptimChunk c) {
    bool finite = true;
    GRAFT_OPTIM_PASSES(c) {
        float x[GRAFT_OPTIM_ILP];
        _Pragma("unroll") for (int u = 0; u < GRAFT_OPTIM_ILP; ++u) { x[u] = 0.0f; }
        GRAFT_OPTIM_LANES(i, c) { x[u] = graft_to_f32(g[i]); }
        _Pragma("unroll") for (int u = 0; u < GRAFT_OPTIM_ILP; ++u) {
            finite &= (__float_as_uint(x[u]) & 0x7f800000u) != 0x7f800000u;
        }
    }
    return finite;
}

// Stores 1 in the flag when a gradient element of this block's chunk is not finite.
extern "C" __global__ void graft_optim_check(
    GraftOptimTable<1, GRAFT_OPTIM_CHECK_TENSORS> t, float* scalars) {
    GraftOptimChunk c = graft_optim_chunk(t);
    unsigned long long g = t.addr[c.k][0];
    bool finite;
    switch (t.dtype[c.k]) {
    case 0: finite = graft_optim_finite((const float*)g, c); break;
    case 1: finite = graft_optim_finite((const GraftBf16*)g, c); break;
    default: finite = graft_optim_finite((const GraftF16*)g, c); break;
    }
    if (!finite) {
        scalars[GRAFT_OPTIM_NOT_FINITE] = 1.0f;
    }
}

// AdamW over a chunk: parameter, m and v in T; the gradient in G; with a copy (not null),
// the new parameter also rounded once into it (mixed precision: T f32, G and C 16-bit).
template <typename T, typename G, typename C>
__device__ __forceinline__ void graft_adamw_chunk(
    T* __restrict__ p, const G* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
    C* __restrict__ copy, GraftOptimChunk c, const GraftAdamW& h, float lr, float c1, float c2,
    float decay) {
    GRAFT_OPTIM_PASSES(c) {
        float pf[GRAFT_OPTIM_ILP], gf[GRAFT_OPTIM_ILP], mf[GRAFT_OPTIM_ILP], vf[GRAFT_OPTIM_ILP];
        GRAFT_OPTIM_LANES(i, c) {
            pf[u] = graft_to_f32(p[i]);
            gf[u] = graft_to_f32(g[i]);
            mf[u] = graft_to_f32(m[i]);
            vf[u] = graft_to_f32(v[i]);
        }
        GRAFT_OPTIM_LANES(i, c) {
            float nm = mf[u] * h.beta1 + gf[u] * h.rest1;
            float nv = vf[u] * h.beta2 + gf[u] * gf[u] * h.rest2;
            float adjusted = (nm / c1) / (sqrtf(nv / c2) + h.eps);
            float np = pf[u] * decay - adjusted * lr;
            p[i] = graft_from_f32<T>(np);
            m[i] = graft_from_f32<T>(nm);
            v[i] = graft_from_f32<T>(nv);
            if (copy != nullptr) {
                copy[i] = graft_from_f32<C>(np);
            }
        }
    }
}

// AdamW on this block's chunk (addresses: parameter, gradient, m, v, copy or 0), unless the
// flag is set. The dtype code: the parameter's (0 f32, 1 bf16, 2 f16) plus 16 times the
// gradient's and copy's (mixed precision: 16 or 32, with an f32 parameter).
extern "C" __global__ void graft_optim_adamw(
    GraftOptimTable<5, GRAFT_OPTIM_UPDATE_TENSORS> t, const float* scalars, GraftAdamW h) {
    if (scalars[GRAFT_OPTIM_NOT_FINITE] != 0.0f) {
        return;
    }
    float lr = scalars[GRAFT_OPTIM_LR];
    float step = scalars[GRAFT_OPTIM_APPLIED] + 1.0f;
    float c1 = 1.0f - expf(step * h.ln_beta1);
    float c2 = 1.0f - expf(step * h.ln_beta2);
    float decay = 1.0f - lr * h.weight_decay;
    GraftOptimChunk c = graft_optim_chunk(t);
    unsigned long long a0 = t.addr[c.k][0], a1 = t.addr[c.k][1];
    unsigned long long a2 = t.addr[c.k][2], a3 = t.addr[c.k][3], a4 = t.addr[c.k][4];
    switch (t.dtype[c.k]) {
    case 0:
        graft_adamw_chunk((float*)a0, (const float*)a1, (float*)a2, (float*)a3, (float*)0, c,
                          h, lr, c1, c2, decay);
        break;
    case 1:
        graft_adamw_chunk((GraftBf16*)a0, (const GraftBf16*)a1, (GraftBf16*)a2,
                          (GraftBf16*)a3, (GraftBf16*)0, c, h, lr, c1, c2, decay);
        break;
    case 2:
        graft_adamw_chunk((GraftF16*)a0, (const GraftF16*)a1, (GraftF16*)a2, (GraftF16*)a3,
                          (GraftF16*)0, c, h, lr, c1, c2, decay);
        break;
    case 16:
        graft_adamw_chunk((float*)a0, (const GraftBf16*)a1, (float*)a2, (float*)a3,
                          (GraftBf16*)a4, c, h, lr, c1, c2, decay);
        break;
    default:
        graft_adamw_chunk((float*)a0, (const GraftF16*)a1, (float*)a2, (float*)a3,
                          (GraftF16*)a4, c, h, lr, c1, c2, decay);
        break;
    }
}

template <typename T>
__device__ __forceinline__ void graft_sgd_chunk(
    T* __restrict__ p, const T* __restrict__ g, T* __restrict__ b, GraftOptimChunk c,
    const GraftSgd& h, float lr) {
    GRAFT_OPTIM_PASSES(c) {
        float pf[GRAFT_OPTIM_ILP], gf[GRAFT_OPTIM_ILP], bf[GRAFT_OPTIM_ILP];
        GRAFT_OPTIM_LANES(i, c) {
            pf[u] = graft_to_f32(p[i]);
            gf[u] = graft_to_f32(g[i]);
            bf[u] = h.buffers ? graft_to_f32(b[i]) : 0.0f;
        }
        GRAFT_OPTIM_LANES(i, c) {
            float d = h.decays ? gf[u] + pf[u] * h.weight_decay : gf[u];
            if (h.buffers) {
                d = bf[u] * h.momentum + d;
                b[i] = graft_from_f32<T>(d);
            }
            p[i] = graft_from_f32<T>(pf[u] - d * lr);
        }
    }
}

// SGD on this block's chunk (addresses: parameter, gradient, buffer or 0), unless the flag
// is set.
extern "C" __global__ void graft_optim_sgd(
    GraftOptimTable<3, GRAFT_OPTIM_UPDATE_TENSORS> t, const float* scalars, GraftSgd h) {
    if (scalars[GRAFT_OPTIM_NOT_FINITE] != 0.0f) {
        return;
    }
    float lr = scalars[GRAFT_OPTIM_LR];
    GraftOptimChunk c = graft_optim_chunk(t);
    unsigned long long a0 = t.addr[c.k][0], a1 = t.addr[c.k][1], a2 = t.addr[c.k][2];
    switch (t.dtype[c.k]) {
    case 0:
        graft_sgd_chunk((float*)a0, (const float*)a1, (float*)a2, c, h, lr);
        break;
    case 1:
        graft_sgd_chunk((GraftBf16*)a0, (const GraftBf16*)a1, (GraftBf16*)a2, c, h, lr);
        break;
    default:
        graft_sgd_chunk((GraftF16*)a0, (const GraftF16*)a1, (GraftF16*)a2, c, h, lr);
        break;
    }
}

// One thread: counts the step as applied or skipped and clears the flag.
extern "C" __global__ void graft_optim_count(float* scalars) {
    if (scalars[GRAFT_OPTIM_NOT_FINITE] != 0.0f) {
        scalars[GRAFT_OPTIM_SKIPPED] += 1.0f;
    } else {
        scalars[GRAFT_OPTIM_APPLIED] += 1.0f;
    }
    scalars[GRAFT_OPTIM_NOT_FINITE] = 0.0f;
}
