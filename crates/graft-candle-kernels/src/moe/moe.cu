
// 16-byte chunks of a weight row each lane loads before using any.
#define GRAFT_MOE_U 4

// Lane `lane`'s shares of w . xs[g] for each of G vectors, into acc: each chunk of w is loaded
// once for all of them, GRAFT_MOE_U 16-byte chunks in flight per lane. VEC: n * sizeof(T) is a
// multiple of 16 and w and every xs[g] start 16-byte aligned. Each acc[g] sums in the same
// order whatever G.
template <typename T, bool VEC, int G>
__device__ __forceinline__ void graft_moe_dot_group(const T* w, const T* const* xs,
                                                    unsigned int n, unsigned int lane,
                                                    float* acc) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        acc[g] = 0.0f;
    }
    if (VEC) {
        const unsigned int E = GraftVec<T>::E;
        const unsigned int chunks = n / E;
        const uint4* w4 = reinterpret_cast<const uint4*>(w);
        for (unsigned int base = lane; base < chunks; base += 32u * GRAFT_MOE_U) {
            uint4 raw[GRAFT_MOE_U];
#pragma unroll
            for (int u = 0; u < GRAFT_MOE_U; ++u) {
                const unsigned int c = base + 32u * u;
                raw[u] = c < chunks ? __ldg(w4 + c) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < GRAFT_MOE_U; ++u) {
                const unsigned int c = base + 32u * u;
                if (c < chunks) {
                    float fw[GraftVec<T>::E];
                    GraftVec<T>::unpack(raw[u], fw);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        float fx[GraftVec<T>::E];
                        GraftVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(xs[g]) + c), fx);
#pragma unroll
                        for (unsigned int e = 0; e < E; ++e) {
                            acc[g] += fx[e] * fw[e];
                        }
                    }
                }
            }
        }
    } else {
        for (unsigned int i = lane; i < n; i += 32u) {
            const float fw = graft_to_f32(w[i]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                acc[g] += graft_to_f32(xs[g][i]) * fw;
            }
        }
    }
}

// Lane `lane`'s share of w . x over n elements (VEC: n * sizeof(T) is a multiple of 16 and
// both start 16-byte aligned).
template <typename T, bool VEC>
__device__ __forceinline__ float graft_moe_dot(const T* w, const T* x, unsigned int n,
                                               unsigned int lane) {
    const T* xs[1] = {x};
    float acc[1];
    graft_moe_dot_group<T, VEC, 1>(w, xs, n, lane, acc);
    return acc[0];
}

// Expert choice j of token t: its weight and its index (clamped to the table).
__device__ __forceinline__ float graft_moe_choice(const float* routing, unsigned int t,
                                                  unsigned int j, unsigned int k,
                                                  unsigned int experts, unsigned int* e) {
    const float* r = routing + (unsigned long long)t * 2u * k;
    *e = min((unsigned int)r[k + j], experts - 1u);
    return r[j];
}

// One warp per token: the softmax of its row, its k largest probabilities (the lower expert
// first among equals), renormalized when asked; written as k weights then k indices.
template <typename T>
__device__ void graft_moe_route(const T* logits, float* out, unsigned int tokens,
                                unsigned int experts, unsigned int k, unsigned int normalize) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= tokens) {
        return;
    }
    const T* row = logits + (unsigned long long)t * experts;
    // Lane l holds experts l, l + 32, ... (at most 8: experts <= 256).
    float p[8];
    float m = GRAFT_NEG_INF;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int e = lane + 32u * i;
        p[i] = e < experts ? graft_to_f32(row[e]) : GRAFT_NEG_INF;
        m = fmaxf(m, p[i]);
    }
    m = graft_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        p[i] = lane + 32u * i < experts ? expf(p[i] - m) : 0.0f;
        s += p[i];
    }
    s = graft_warp_sum(s);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        p[i] = p[i] / s;
    }
    float* w_out = out + (unsigned long long)t * 2u * k;
    unsigned int taken = 0u;
    float total = 0.0f;
    for (unsigned int j = 0; j < k; ++j) {
        // Probabilities are >= 0: -1 is "none yet". Each lane's first largest untaken.
        float bv = -1.0f;
        unsigned int bi = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int e = lane + 32u * i;
            if (e < experts && !(taken & (1u << i)) && p[i] > bv) {
                bv = p[i];
                bi = e;
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, offset);
            const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, offset);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi != 0xffffffffu && (bi & 31u) == lane) {
            taken |= 1u << (bi >> 5);
        }
        total += bv;
        if (lane == 0) {
            w_out[j] = bv;
            w_out[k + j] = (float)bi;
        }
    }
    if (normalize && lane == 0) {
        for (unsigned int j = 0; j < k; ++j) {
            w_out[j] = w_out[j] / total;
        }
    }
}

// h[t * k + j][i] = silu(gate_e[i] . x[t]) * (up_e[i] . x[t]), e token t's choice j: one warp
// per i, blockIdx.y = t * k + j.
template <typename T, bool VEC>
__device__ void graft_moe_gate_up(const T* x, const float* routing, const long long* table,
                                  T* h, unsigned int hidden, unsigned int inter, unsigned int k,
                                  unsigned int experts) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= inter) {
        return;
    }
    const unsigned int slot = blockIdx.y;
    const unsigned int t = slot / k;
    unsigned int e;
    graft_moe_choice(routing, t, slot % k, k, experts, &e);
    const unsigned long long at = (unsigned long long)i * hidden;
    const T* gate = reinterpret_cast<const T*>(table[e]) + at;
    const T* up = reinterpret_cast<const T*>(table[experts + e]) + at;
    const T* xt = x + (unsigned long long)t * hidden;
    const float g = graft_warp_sum(graft_moe_dot<T, VEC>(gate, xt, hidden, lane));
    const float u = graft_warp_sum(graft_moe_dot<T, VEC>(up, xt, hidden, lane));
    if (lane == 0) {
        h[(unsigned long long)slot * inter + i] = graft_from_f32<T>(g / (1.0f + expf(-g)) * u);
    }
}

// y[t][o] = sum over j of w_j * (down_e[o] . h[t * k + j]): one warp per o, blockIdx.y = t.
template <typename T, bool VEC>
__device__ void graft_moe_down(const T* h, const float* routing, const long long* table, T* y,
                               unsigned int hidden, unsigned int inter, unsigned int k,
                               unsigned int experts) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= hidden) {
        return;
    }
    const unsigned int t = blockIdx.y;
    float acc = 0.0f;
    for (unsigned int j = 0; j < k; ++j) {
        unsigned int e;
        const float w = graft_moe_choice(routing, t, j, k, experts, &e);
        const T* down = reinterpret_cast<const T*>(table[2u * experts + e]) +
                        (unsigned long long)o * inter;
        const T* ht = h + ((unsigned long long)t * k + j) * inter;
        acc += w * graft_warp_sum(graft_moe_dot<T, VEC>(down, ht, inter, lane));
    }
    if (lane == 0) {
        y[(unsigned long long)t * hidden + o] = graft_from_f32<T>(acc);
    }
}

// Expert-major variants, for more choices than experts (several tokens share an expert): one
// block column per expert, whose warps take the choices routed to the expert G at a time,
// reading each weight row once per G (G = 1: the row is re-read per choice, from L1 when the
// block's rows fit there). The choices routed to expert e,
// as slot numbers t * k + j in any order, gathered into the block's shared `list`; all of the
// block's threads take part.
__device__ unsigned int graft_moe_slots_of(const float* routing, unsigned int slots,
                                           unsigned int k, unsigned int experts,
                                           unsigned int e, unsigned int* list) {
    __shared__ unsigned int count;
    if (threadIdx.x == 0) {
        count = 0u;
    }
    __syncthreads();
    for (unsigned int slot = threadIdx.x; slot < slots; slot += blockDim.x) {
        unsigned int chosen;
        graft_moe_choice(routing, slot / k, slot % k, k, experts, &chosen);
        if (chosen == e) {
            list[atomicAdd(&count, 1u)] = slot;
        }
    }
    __syncthreads();
    return count;
}

// As graft_moe_gate_up, by expert: blockIdx.y = e, one warp per intermediate output i.
template <typename T, bool VEC, int G>
__device__ void graft_moe_gate_up_by_expert(const T* x, const float* routing,
                                            const long long* table, T* h, unsigned int hidden,
                                            unsigned int inter, unsigned int k,
                                            unsigned int experts, unsigned int slots) {
    extern __shared__ unsigned int graft_moe_list[];
    const unsigned int e = blockIdx.y;
    const unsigned int n = graft_moe_slots_of(routing, slots, k, experts, e, graft_moe_list);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= inter) {
        return;
    }
    const unsigned long long at = (unsigned long long)i * hidden;
    const T* gate = reinterpret_cast<const T*>(table[e]) + at;
    const T* up = reinterpret_cast<const T*>(table[experts + e]) + at;
    // G choices per read of the rows (the last one repeated to fill a group).
    for (unsigned int q0 = 0; q0 < n; q0 += G) {
        const T* xs[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const unsigned int slot = graft_moe_list[min(q0 + g, n - 1u)];
            xs[g] = x + (unsigned long long)(slot / k) * hidden;
        }
        float ga[G];
        float ua[G];
        graft_moe_dot_group<T, VEC, G>(gate, xs, hidden, lane, ga);
        graft_moe_dot_group<T, VEC, G>(up, xs, hidden, lane, ua);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float gs = graft_warp_sum(ga[g]);
            const float us = graft_warp_sum(ua[g]);
            if (lane == 0 && q0 + g < n) {
                const unsigned int slot = graft_moe_list[q0 + g];
                h[(unsigned long long)slot * inter + i] =
                    graft_from_f32<T>(gs / (1.0f + expf(-gs)) * us);
            }
        }
    }
}

// The down projection of every choice by expert, weighted: ys[slot][o] = w * (down_e[o] .
// h[slot]) in f32; blockIdx.y = e, one warp per hidden output o.
template <typename T, bool VEC, int G>
__device__ void graft_moe_down_by_expert(const T* h, const float* routing,
                                         const long long* table, float* ys, unsigned int hidden,
                                         unsigned int inter, unsigned int k,
                                         unsigned int experts, unsigned int slots) {
    extern __shared__ unsigned int graft_moe_list[];
    const unsigned int e = blockIdx.y;
    const unsigned int n = graft_moe_slots_of(routing, slots, k, experts, e, graft_moe_list);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= hidden) {
        return;
    }
    const T* down = reinterpret_cast<const T*>(table[2u * experts + e]) +
                    (unsigned long long)o * inter;
    for (unsigned int q0 = 0; q0 < n; q0 += G) {
        const T* hs[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            hs[g] = h + (unsigned long long)graft_moe_list[min(q0 + g, n - 1u)] * inter;
        }
        float da[G];
        graft_moe_dot_group<T, VEC, G>(down, hs, inter, lane, da);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float d = graft_warp_sum(da[g]);
            if (lane == 0 && q0 + g < n) {
                const unsigned int slot = graft_moe_list[q0 + g];
                unsigned int chosen;
                const float w = graft_moe_choice(routing, slot / k, slot % k, k, experts, &chosen);
                ys[(unsigned long long)slot * hidden + o] = w * d;
            }
        }
    }
}

// y[t][o] = the sum over j of ys[t * k + j][o], in order of j (as graft_moe_down adds them).
template <typename T>
__device__ void graft_moe_combine(const float* ys, T* y, unsigned int hidden, unsigned int k,
                                  unsigned int tokens) {
    const unsigned long long idx = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (unsigned long long)tokens * hidden) {
        return;
    }
    const unsigned long long t = idx / hidden;
    const unsigned long long o = idx % hidden;
    float acc = 0.0f;
    for (unsigned int j = 0; j < k; ++j) {
        acc += ys[(t * k + j) * hidden + o];
    }
    y[idx] = graft_from_f32<T>(acc);
}

#define GRAFT_MOE_BY_EXPERT_ONE(suffix, T, G, kind, VEC)                                 \
    extern "C" __global__ void graft_moe_gate_up_by_expert##G##_##kind##_##suffix(       \
        const T* x, const float* r, const long long* table, T* h, unsigned int hidden,   \
        unsigned int inter, unsigned int k, unsigned int experts, unsigned int slots) {  \
        graft_moe_gate_up_by_expert<T, VEC, G>(x, r, table, h, hidden, inter, k, experts,\
                                               slots);                                   \
    }                                                                                    \
    extern "C" __global__ void graft_moe_down_by_expert##G##_##kind##_##suffix(          \
        const T* h, const float* r, const long long* table, float* ys, unsigned int hidden,\
        unsigned int inter, unsigned int k, unsigned int experts, unsigned int slots) {  \
        graft_moe_down_by_expert<T, VEC, G>(h, r, table, ys, hidden, inter, k, experts,  \
                                            slots);                                      \
    }
#define GRAFT_MOE_BY_EXPERT(suffix, T, G)                                                \
    GRAFT_MOE_BY_EXPERT_ONE(suffix, T, G, vec, true)                                     \
    GRAFT_MOE_BY_EXPERT_ONE(suffix, T, G, scalar, false)

#define GRAFT_MOE(suffix, T)                                                                 \
    extern "C" __global__ void graft_moe_route_##suffix(const T* logits, float* out,         \
        unsigned int tokens, unsigned int experts, unsigned int k, unsigned int normalize) { \
        graft_moe_route<T>(logits, out, tokens, experts, k, normalize);                      \
    }                                                                                        \
    extern "C" __global__ void graft_moe_gate_up_vec_##suffix(const T* x, const float* r,    \
        const long long* table, T* h, unsigned int hidden, unsigned int inter,               \
        unsigned int k, unsigned int experts) {                                              \
        graft_moe_gate_up<T, true>(x, r, table, h, hidden, inter, k, experts);               \
    }                                                                                        \
    extern "C" __global__ void graft_moe_gate_up_scalar_##suffix(const T* x, const float* r, \
        const long long* table, T* h, unsigned int hidden, unsigned int inter,               \
        unsigned int k, unsigned int experts) {                                              \
        graft_moe_gate_up<T, false>(x, r, table, h, hidden, inter, k, experts);              \
    }                                                                                        \
    extern "C" __global__ void graft_moe_down_vec_##suffix(const T* h, const float* r,       \
        const long long* table, T* y, unsigned int hidden, unsigned int inter,               \
        unsigned int k, unsigned int experts) {                                              \
        graft_moe_down<T, true>(h, r, table, y, hidden, inter, k, experts);                  \
    }                                                                                        \
    extern "C" __global__ void graft_moe_down_scalar_##suffix(const T* h, const float* r,    \
        const long long* table, T* y, unsigned int hidden, unsigned int inter,               \
        unsigned int k, unsigned int experts) {                                              \
        graft_moe_down<T, false>(h, r, table, y, hidden, inter, k, experts);                 \
    }                                                                                    \
    GRAFT_MOE_BY_EXPERT(suffix, T, 1)                                                       \
    GRAFT_MOE_BY_EXPERT(suffix, T, 8)                                                       \
    extern "C" __global__ void graft_moe_combine_##suffix(const float* ys, T* y,         \
        unsigned int hidden, unsigned int k, unsigned int tokens) {                      \
        graft_moe_combine<T>(ys, y, hidden, k, tokens);                                  \
    }
GRAFT_FOR_DTYPES(GRAFT_MOE)
