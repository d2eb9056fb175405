
// Every kernel: 4 warps a block; keys (or query rows) in tiles of 32, one a lane.
#define GRAFT_CA_WARPS 4

// Per head dim HD: E dims a lane when a lane owns output dims (lanes * E = HD, E consecutive);
// KS, the f32 row stride in shared memory of a tile whose rows are read one a lane (HD + 4
// keeps a lane's 16-byte loads on distinct banks within each quarter warp).
template <int HD> struct GraftCa {
    static const int E = HD / 32;
    static const int KS = HD + 4;
};

// E consecutive f32 from shared memory (8- or 16-byte aligned).
template <int E> __device__ __forceinline__ void graft_ca_load(const float* p, float* x);
template <> __device__ __forceinline__ void graft_ca_load<2>(const float* p, float* x) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x;
    x[1] = v.y;
}
template <> __device__ __forceinline__ void graft_ca_load<4>(const float* p, float* x) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
}

__device__ __forceinline__ float graft_ca_dot4(float acc, float4 a, float4 b) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

__device__ __forceinline__ float graft_ca_at(float4 v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Four consecutive elements from global memory as f32, in one load (16 bytes of f32, 8 of a
// 16-bit type); `p` aligned to four elements.
__device__ __forceinline__ float4 graft_ca_load4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
template <typename H>
__device__ __forceinline__ float4 graft_ca_load4(const H* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    H a, b, c, d;
    a.bits = (unsigned short)(u.x & 0xffffu);
    b.bits = (unsigned short)(u.x >> 16);
    c.bits = (unsigned short)(u.y & 0xffffu);
    d.bits = (unsigned short)(u.y >> 16);
    return make_float4(graft_to_f32(a), graft_to_f32(b), graft_to_f32(c), graft_to_f32(d));
}

// Rows first .. first + count of one head of a token-major tensor (`src` at the head's row 0,
// `stride` elements between rows) into dst as f32, `ld` floats between rows; zero for rows at
// or past seq (so a masked weight of 0 never meets a stale value). Four elements a load when
// `src` and the row stride allow it (they do unless the tensor starts at an odd offset), one
// otherwise; `dst` and `ld` are 16-byte aligned either way.
template <typename T, int HD>
__device__ __forceinline__ void graft_ca_stage(float* dst, int ld, const T* src,
                                               unsigned long long stride, unsigned int first,
                                               unsigned int count, unsigned int seq) {
    const bool wide = ((unsigned long long)src % (4 * sizeof(T))) == 0 && stride % 4 == 0;
    if (wide) {
        for (unsigned int i = threadIdx.x; i < count * (HD / 4); i += blockDim.x) {
            const unsigned int r = i / (HD / 4);
            const unsigned int d = (i % (HD / 4)) * 4;
            const unsigned int row = first + r;
            const float4 x = row < seq ? graft_ca_load4(src + row * stride + d)
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *reinterpret_cast<float4*>(&dst[r * ld + d]) = x;
        }
        return;
    }
    for (unsigned int i = threadIdx.x; i < count * HD; i += blockDim.x) {
        const unsigned int r = i / HD;
        const unsigned int d = i % HD;
        const unsigned int row = first + r;
        dst[r * ld + d] = row < seq ? graft_to_f32(src[row * stride + d]) : 0.0f;
    }
}

// The output rows of one (query tile, head, sequence): 4 warps of R rows; per key tile, lane j
// scores key j for the warp's rows, the online softmax updates each row's max and sum, and the
// lanes then add p * v over the tile, each lane E output dims. lse[(b * heads + h) * seq + i]
// = max + log(sum) of row i, for the backward pass.
template <typename T, int HD, int R>
__device__ void graft_ca_forward(const T* q, const T* k, const T* v, T* out, float* lse,
                                 unsigned int seq, unsigned int heads, unsigned int kv_heads,
                                 float scale) {
    const int BM = GRAFT_CA_WARPS * R;
    const int E = GraftCa<HD>::E;
    const int KS = GraftCa<HD>::KS;
    __shared__ __align__(16) float qs[BM * HD];
    __shared__ __align__(16) float ks[32 * KS];
    __shared__ __align__(16) float vs[32 * KS];
    __shared__ __align__(16) float ps[GRAFT_CA_WARPS * R * 32];

    const unsigned int tile = gridDim.x - 1u - blockIdx.x;  // the longest rows first
    const unsigned int h = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int kvh = h / (heads / kv_heads);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int row0 = tile * BM;
    const unsigned int wrow0 = row0 + warp * R;
    const unsigned long long qstride = (unsigned long long)heads * HD;
    const unsigned long long kstride = (unsigned long long)kv_heads * HD;
    const unsigned long long bs = (unsigned long long)b * seq;
    const T* qh = q + (bs * heads + h) * HD;
    const T* kh = k + (bs * kv_heads + kvh) * HD;
    const T* vh = v + (bs * kv_heads + kvh) * HD;

    graft_ca_stage<T, HD>(qs, HD, qh, qstride, row0, BM, seq);
    float m[R];
    float l[R];
    float acc[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = GRAFT_NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[r][e] = 0.0f;
        }
    }
    const unsigned int last = min(row0 + BM, seq) - 1u;
    const unsigned int tiles = last / 32u + 1u;
    for (unsigned int t = 0; t < tiles; ++t) {
        const unsigned int key0 = t * 32u;
        __syncthreads();  // the previous tile's readers are done
        graft_ca_stage<T, HD>(ks, KS, kh, kstride, key0, 32u, seq);
        graft_ca_stage<T, HD>(vs, KS, vh, kstride, key0, 32u, seq);
        __syncthreads();
        if (wrow0 >= seq || wrow0 + R - 1u < key0) {
            continue;  // no row of this warp sees a key of the tile
        }
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = 0.0f;
        }
#pragma unroll 8
        for (int d = 0; d < HD; d += 4) {
            const float4 kk = *reinterpret_cast<const float4*>(&ks[lane * KS + d]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4 qq =
                    *reinterpret_cast<const float4*>(&qs[(warp * R + r) * HD + d]);
                s[r] = graft_ca_dot4(s[r], qq, kk);
            }
        }
        const unsigned int key = key0 + lane;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned int row = wrow0 + r;
            float p = 0.0f;
            if (row < seq && row >= key0) {  // the same for the whole warp
                const float x = key <= row ? s[r] * scale : GRAFT_NEG_INF;
                const float m_new = fmaxf(m[r], graft_warp_max(x));
                p = key <= row ? expf(x - m_new) : 0.0f;
                const float c = expf(m[r] - m_new);  // 0 on the first tile (m = -inf)
                l[r] = l[r] * c + graft_warp_sum(p);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    acc[r][e] *= c;
                }
                m[r] = m_new;
            }
            ps[(warp * R + r) * 32 + lane] = p;
        }
        __syncwarp();
        // Keys past the warp's last row weigh 0 for all its rows: stop at a multiple of 4
        // past it.
        const unsigned int span = min(32u, (wrow0 + R - key0 + 3u) & ~3u);
        for (unsigned int j = 0; j < span; j += 4u) {
            float4 pr[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                pr[r] = *reinterpret_cast<const float4*>(&ps[(warp * R + r) * 32 + j]);
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                float x[E];
                graft_ca_load<E>(&vs[(j + jj) * KS + lane * E], x);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float w = graft_ca_at(pr[r], jj);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        acc[r][e] = fmaf(w, x[e], acc[r][e]);
                    }
                }
            }
        }
        __syncwarp();  // ps read before the next tile writes it
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int row = wrow0 + r;
        if (row < seq) {
            T* o = out + ((bs + row) * heads + h) * HD + lane * E;
            const float inv = 1.0f / l[r];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                o[e] = graft_from_f32<T>(acc[r][e] * inv);
            }
            if (lane == 0) {
                lse[((unsigned long long)b * heads + h) * seq + row] = m[r] + logf(l[r]);
            }
        }
    }
}

// The query gradient of one (query tile, head, sequence): 4 warps of R rows. First each
// row's delta = rowsum(dO * O) (kept in `delta` for the key and value kernel); then per key
// tile, lane j recomputes p = exp(q.k_j * scale - lse) and dp = dO.v_j for the warp's rows,
// ds = p * (dp - delta), and the lanes add ds * k_j over the tile, each lane E dims of dq.
template <typename T, int HD, int R>
__device__ void graft_ca_dq(const T* q, const T* k, const T* v, const T* o, const T* dout,
                            const float* lse, float* delta, T* dq, unsigned int seq,
                            unsigned int heads, unsigned int kv_heads, float scale) {
    const int BM = GRAFT_CA_WARPS * R;
    const int E = GraftCa<HD>::E;
    const int KS = GraftCa<HD>::KS;
    __shared__ __align__(16) float qs[BM * HD];
    __shared__ __align__(16) float gs[BM * HD];
    __shared__ __align__(16) float ks[32 * KS];
    __shared__ __align__(16) float vs[32 * KS];
    __shared__ __align__(16) float ps[GRAFT_CA_WARPS * R * 32];

    const unsigned int tile = gridDim.x - 1u - blockIdx.x;  // the longest rows first
    const unsigned int h = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int kvh = h / (heads / kv_heads);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int row0 = tile * BM;
    const unsigned int wrow0 = row0 + warp * R;
    const unsigned long long qstride = (unsigned long long)heads * HD;
    const unsigned long long kstride = (unsigned long long)kv_heads * HD;
    const unsigned long long bs = (unsigned long long)b * seq;
    const unsigned long long bh = (unsigned long long)b * heads + h;
    const T* qh = q + (bs * heads + h) * HD;
    const T* oh = o + (bs * heads + h) * HD;
    const T* gh = dout + (bs * heads + h) * HD;
    const T* kh = k + (bs * kv_heads + kvh) * HD;
    const T* vh = v + (bs * kv_heads + kvh) * HD;

    graft_ca_stage<T, HD>(qs, HD, qh, qstride, row0, BM, seq);
    graft_ca_stage<T, HD>(gs, HD, gh, qstride, row0, BM, seq);
    __syncthreads();
    float dl[R];
    float lr[R];
    float acc[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int row = wrow0 + r;
        float part = 0.0f;
        if (row < seq) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const unsigned int d = lane + 32u * e;
                part = fmaf(gs[(warp * R + r) * HD + d], graft_to_f32(oh[row * qstride + d]),
                            part);
            }
        }
        dl[r] = graft_warp_sum(part);
        lr[r] = row < seq ? lse[bh * seq + row] : 0.0f;
        if (row < seq && lane == 0) {
            delta[bh * seq + row] = dl[r];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[r][e] = 0.0f;
        }
    }
    const unsigned int last = min(row0 + BM, seq) - 1u;
    const unsigned int tiles = last / 32u + 1u;
    for (unsigned int t = 0; t < tiles; ++t) {
        const unsigned int key0 = t * 32u;
        __syncthreads();  // the previous tile's readers are done
        graft_ca_stage<T, HD>(ks, KS, kh, kstride, key0, 32u, seq);
        graft_ca_stage<T, HD>(vs, KS, vh, kstride, key0, 32u, seq);
        __syncthreads();
        if (wrow0 >= seq || wrow0 + R - 1u < key0) {
            continue;  // no row of this warp sees a key of the tile
        }
        float s[R];
        float dp[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = 0.0f;
            dp[r] = 0.0f;
        }
#pragma unroll 8
        for (int d = 0; d < HD; d += 4) {
            const float4 kk = *reinterpret_cast<const float4*>(&ks[lane * KS + d]);
            const float4 vv = *reinterpret_cast<const float4*>(&vs[lane * KS + d]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4 qq =
                    *reinterpret_cast<const float4*>(&qs[(warp * R + r) * HD + d]);
                const float4 gg =
                    *reinterpret_cast<const float4*>(&gs[(warp * R + r) * HD + d]);
                s[r] = graft_ca_dot4(s[r], qq, kk);
                dp[r] = graft_ca_dot4(dp[r], gg, vv);
            }
        }
        const unsigned int key = key0 + lane;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned int row = wrow0 + r;
            float ds = 0.0f;
            if (row < seq && key <= row) {
                const float p = expf(s[r] * scale - lr[r]);
                ds = p * (dp[r] - dl[r]);
            }
            ps[(warp * R + r) * 32 + lane] = ds;
        }
        __syncwarp();
        const unsigned int span = min(32u, (wrow0 + R - key0 + 3u) & ~3u);
        for (unsigned int j = 0; j < span; j += 4u) {
            float4 pr[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                pr[r] = *reinterpret_cast<const float4*>(&ps[(warp * R + r) * 32 + j]);
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                float x[E];
                graft_ca_load<E>(&ks[(j + jj) * KS + lane * E], x);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float w = graft_ca_at(pr[r], jj);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        acc[r][e] = fmaf(w, x[e], acc[r][e]);
                    }
                }
            }
        }
        __syncwarp();  // ps read before the next tile writes it
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int row = wrow0 + r;
        if (row < seq) {
            T* g = dq + ((bs + row) * heads + h) * HD + lane * E;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                g[e] = graft_from_f32<T>(acc[r][e] * scale);
            }
        }
    }
}

// The key and value gradients of one (key tile, KV head, sequence): 4 warps of R keys. For
// each query head of the group and each tile of 32 query rows at or after the key tile, lane
// i recomputes p = exp(q_i.k * scale - lse_i) and dp = dO_i.v for the warp's keys,
// ds = p * (dp - delta_i), and the lanes add p * dO_i to dv and ds * q_i to dk, each lane E
// dims. dkv holds dk ([batch, seq, kv_heads * HD]) and then dv.
template <typename T, int HD, int R>
__device__ void graft_ca_dkv(const T* q, const T* k, const T* v, const T* dout,
                             const float* lse, const float* delta, T* dkv, unsigned int batch,
                             unsigned int seq, unsigned int heads, unsigned int kv_heads,
                             float scale) {
    const int BN = GRAFT_CA_WARPS * R;
    const int E = GraftCa<HD>::E;
    const int KS = GraftCa<HD>::KS;
    __shared__ __align__(16) float ks[BN * HD];
    __shared__ __align__(16) float vs[BN * HD];
    __shared__ __align__(16) float qs[32 * KS];
    __shared__ __align__(16) float gs[32 * KS];
    __shared__ __align__(16) float ps[GRAFT_CA_WARPS * R * 32];
    __shared__ __align__(16) float dss[GRAFT_CA_WARPS * R * 32];

    const unsigned int kvh = blockIdx.y;  // blockIdx.x 0, the longest columns, first
    const unsigned int b = blockIdx.z;
    const unsigned int group = heads / kv_heads;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int key0 = blockIdx.x * BN;
    const unsigned int wkey0 = key0 + warp * R;
    const unsigned long long qstride = (unsigned long long)heads * HD;
    const unsigned long long kstride = (unsigned long long)kv_heads * HD;
    const unsigned long long bs = (unsigned long long)b * seq;

    graft_ca_stage<T, HD>(ks, HD, k + (bs * kv_heads + kvh) * HD, kstride, key0, BN, seq);
    graft_ca_stage<T, HD>(vs, HD, v + (bs * kv_heads + kvh) * HD, kstride, key0, BN, seq);
    float dk[R][E];
    float dv[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            dk[r][e] = 0.0f;
            dv[r][e] = 0.0f;
        }
    }
    for (unsigned int g = 0; g < group; ++g) {
        const unsigned int h = kvh * group + g;
        const unsigned long long bh = (unsigned long long)b * heads + h;
        const T* qh = q + (bs * heads + h) * HD;
        const T* gh = dout + (bs * heads + h) * HD;
        for (unsigned int i0 = key0; i0 < seq; i0 += 32u) {
            __syncthreads();  // the previous tile's readers are done (or ks, vs staged)
            graft_ca_stage<T, HD>(qs, KS, qh, qstride, i0, 32u, seq);
            graft_ca_stage<T, HD>(gs, KS, gh, qstride, i0, 32u, seq);
            __syncthreads();
            if (wkey0 >= seq || wkey0 > i0 + 31u) {
                continue;  // no row of the tile sees a key of this warp
            }
            const unsigned int row = i0 + lane;
            const float lr = row < seq ? lse[bh * seq + row] : 0.0f;
            const float dl = row < seq ? delta[bh * seq + row] : 0.0f;
            float s[R];
            float dp[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                s[r] = 0.0f;
                dp[r] = 0.0f;
            }
#pragma unroll 8
            for (int d = 0; d < HD; d += 4) {
                const float4 qq = *reinterpret_cast<const float4*>(&qs[lane * KS + d]);
                const float4 gg = *reinterpret_cast<const float4*>(&gs[lane * KS + d]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float4 kk =
                        *reinterpret_cast<const float4*>(&ks[(warp * R + r) * HD + d]);
                    const float4 vv =
                        *reinterpret_cast<const float4*>(&vs[(warp * R + r) * HD + d]);
                    s[r] = graft_ca_dot4(s[r], qq, kk);
                    dp[r] = graft_ca_dot4(dp[r], gg, vv);
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned int key = wkey0 + r;
                float p = 0.0f;
                float ds = 0.0f;
                if (row < seq && key <= row) {
                    p = expf(s[r] * scale - lr);
                    ds = p * (dp[r] - dl);
                }
                ps[(warp * R + r) * 32 + lane] = p;
                dss[(warp * R + r) * 32 + lane] = ds;
            }
            __syncwarp();
            // Rows past seq weigh 0: stop at a multiple of 4 past the last.
            const unsigned int span = min(32u, (seq - i0 + 3u) & ~3u);
            for (unsigned int j = 0; j < span; j += 4u) {
                float4 pr[R];
                float4 dr[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    pr[r] = *reinterpret_cast<const float4*>(&ps[(warp * R + r) * 32 + j]);
                    dr[r] = *reinterpret_cast<const float4*>(&dss[(warp * R + r) * 32 + j]);
                }
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    float xg[E];
                    float xq[E];
                    graft_ca_load<E>(&gs[(j + jj) * KS + lane * E], xg);
                    graft_ca_load<E>(&qs[(j + jj) * KS + lane * E], xq);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const float wp = graft_ca_at(pr[r], jj);
                        const float wd = graft_ca_at(dr[r], jj);
#pragma unroll
                        for (int e = 0; e < E; ++e) {
                            dv[r][e] = fmaf(wp, xg[e], dv[r][e]);
                            dk[r][e] = fmaf(wd, xq[e], dk[r][e]);
                        }
                    }
                }
            }
            __syncwarp();  // ps, dss read before the next tile writes them
        }
    }
    const unsigned long long half = (unsigned long long)batch * seq * kstride;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned int key = wkey0 + r;
        if (key < seq) {
            T* gk = dkv + ((bs + key) * kv_heads + kvh) * HD + lane * E;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                gk[e] = graft_from_f32<T>(dk[r][e] * scale);
                gk[half + e] = graft_from_f32<T>(dv[r][e]);
            }
        }
    }
}

// Each kernel in configurations `_r<R>` for R rows (or keys) a warp. The many-rows ones
// (R = 8 and 4 at head dim 64; 4 for the forward pass and 2 for the backward kernels at 128,
// to stay under 48 KiB of static shared memory) share each staged tile among more rows; the
// one-row one has more blocks, for grids too small to fill the GPU (the launches pick by
// shape, `cuda.rs`).
#define GRAFT_CA_FORWARD(suffix, T, HD, R)                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                        \
        graft_causal_attention_forward_##suffix##_##HD##_r##R(                               \
            const T* q, const T* k, const T* v, T* out, float* lse, unsigned int seq,        \
            unsigned int heads, unsigned int kv_heads, float scale) {                        \
        graft_ca_forward<T, HD, R>(q, k, v, out, lse, seq, heads, kv_heads, scale);          \
    }
#define GRAFT_CA_BACKWARD(suffix, T, HD, R)                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                        \
        graft_causal_attention_dq_##suffix##_##HD##_r##R(                                    \
            const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse, \
            float* delta, T* dq, unsigned int seq, unsigned int heads,                       \
            unsigned int kv_heads, float scale) {                                            \
        graft_ca_dq<T, HD, R>(q, k, v, o, dout, lse, delta, dq, seq, heads, kv_heads,        \
                              scale);                                                        \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                        \
        graft_causal_attention_dkv_##suffix##_##HD##_r##R(                                   \
            const T* q, const T* k, const T* v, const T* dout, const float* lse,             \
            const float* delta, T* dkv, unsigned int batch, unsigned int seq,                \
            unsigned int heads, unsigned int kv_heads, float scale) {                        \
        graft_ca_dkv<T, HD, R>(q, k, v, dout, lse, delta, dkv, batch, seq, heads, kv_heads,  \
                               scale);                                                       \
    }
#define GRAFT_CA(suffix, T)                                                                  \
    GRAFT_CA_FORWARD(suffix, T, 64, 8)                                                       \
    GRAFT_CA_FORWARD(suffix, T, 64, 4)                                                       \
    GRAFT_CA_FORWARD(suffix, T, 64, 1)                                                       \
    GRAFT_CA_FORWARD(suffix, T, 128, 4)                                                      \
    GRAFT_CA_FORWARD(suffix, T, 128, 1)                                                      \
    GRAFT_CA_BACKWARD(suffix, T, 64, 8)                                                      \
    GRAFT_CA_BACKWARD(suffix, T, 64, 4)                                                      \
    GRAFT_CA_BACKWARD(suffix, T, 64, 1)                                                      \
    GRAFT_CA_BACKWARD(suffix, T, 128, 2)                                                     \
    GRAFT_CA_BACKWARD(suffix, T, 128, 1)
GRAFT_FOR_DTYPES(GRAFT_CA)
