
// The causal attention's three kernels on tensor cores (compute capability 8.0 or later):
// bf16 and f16 at head dim 64 or 128, f32 at 64. The same arguments, outputs and grids'
// meaning as causal_attention.cu's, with 64 rows (or keys) a block, 16 a warp (one m16
// tile). A block stages its own rows' tiles and each tile of the other side into shared
// memory ([rows][HD + PAD] elements: the padding spreads a fragment's rows over the banks) and
// each warp's products run on tensor cores with f32 sums (`GraftCatMma`): bf16 and f16 as
// m16n8k16 steps, with the weights P and their gradients dS rounded to the input's type
// before they multiply (as flash attention does); f32 as m16n8k8 steps of three TF32
// products each, which keep about f32's precision (TF32 alone keeps 10 bits). Every sum is in
// one fixed order per element (no atomics: the same inputs give the same bits on one device).
//
// Fragments (lane = 4 g + t), m16n8k16: A (16 x 16, row-major): a0 = (g, 2t..2t+1),
// a1 = (g + 8, ..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); B (16 x 8, column-major):
// b0 = (2t..2t+1, g), b1 = (2t + 8.., g); C (16 x 8): c0, c1 = (g, 2t..2t+1), c2, c3 = the
// same at g + 8.

#define GRAFT_CAT_ROWS 64  // rows (or keys) a block: 16 a warp

// Two adjacent 16-bit elements as one word (4-byte aligned).
template <typename T>
__device__ __forceinline__ unsigned int graft_cat_word(const T* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

// A B fragment whose k runs down 16 rows of shared memory at `p` (8 columns along the row,
// 16-byte aligned rows): ldmatrix, transposed.
__device__ __forceinline__ void graft_cat_b_trans(unsigned int* b, const void* p, int row_bytes) {
    const unsigned int lane = threadIdx.x & 31u;
    // lanes 0-7: rows 0-7, lanes 8-15: rows 8-15
    const char* row = reinterpret_cast<const char*>(p) + (lane & 15u) * row_bytes;
    asm volatile(
        "{ .reg .u64 a; .reg .u32 s; cvta.to.shared.u64 a, %2; cvt.u32.u64 s, a;\n"
        "  ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [s]; }"
        : "=r"(b[0]), "=r"(b[1])
        : "l"(row)
        : "memory");
}

// f32 as TF32's high part and the TF32 rounding of what is left (x = hi + lo to about 22
// bits).
__device__ __forceinline__ void graft_tf32_split(float x, unsigned int& hi, unsigned int& lo) {
#if __CUDA_ARCH__ >= 800
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
#endif
}

// c += a b, one m16n8k8 TF32 step with f32 sums: a as A (16 x 8: a0 = (g, t), a1 = (g + 8, t),
// a2 = (g, t + 4), a3 = (g + 8, t + 4)), b as B (8 x 8: b0 = (t, g), b1 = (t + 4, g)).
__device__ __forceinline__ void graft_mma_1688_tf32(float* c, const unsigned int* a,
                                                    const unsigned int* b) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// c += a b to about f32's precision from a split A (its TF32 parts) and an f32 B: three TF32
// products, the small ones first (a_lo b_hi + a_hi b_lo + a_hi b_hi; a_lo b_lo is below f32's
// last bit).
__device__ __forceinline__ void graft_mma_3xtf32(float* c, const unsigned int* ah,
                                                 const unsigned int* al, const float* b) {
    unsigned int bh[2];
    unsigned int bl[2];
    graft_tf32_split(b[0], bh[0], bl[0]);
    graft_tf32_split(b[1], bh[1], bl[1]);
    graft_mma_1688_tf32(c, al, bh);
    graft_mma_1688_tf32(c, ah, bl);
    graft_mma_1688_tf32(c, ah, bh);
}

// The two products of the kernels, per element type, on one warp, with operands in shared
// memory ([rows][HD + PAD] elements, rows 16-byte aligned):
// - abt: c = A B^T, A the warp's 16 rows at `a`, B the N * 8 rows at `b`, over HD columns, c
//   as N C fragments;
// - cb: acc += C B, C the K * 8 columns of C fragments `c`, B the K * 8 rows at `b` over HD
//   columns, acc as HD / 8 C fragments.
// bf16 and f16 take m16n8k16 steps (C rounded to T first; PAD 8, so a fragment's eight rows
// fall on distinct banks); an operand whose k runs along its rows is read two elements a
// load, one whose k runs down them through ldmatrix.trans.
template <typename T>
struct GraftCatMma {
    static const int PAD = 8;

    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        return graft_pack2(graft_from_f32<T>(lo), graft_from_f32<T>(hi));
    }

    // The A fragment at `p` (its row 0, column 0).
    static __device__ __forceinline__ void a_frag(unsigned int* a, const T* p, int ld) {
        const unsigned int lane = threadIdx.x & 31u;
        const T* at = p + (lane >> 2) * ld + 2u * (lane & 3u);
        a[0] = graft_cat_word(at);
        a[1] = graft_cat_word(at + 8 * ld);
        a[2] = graft_cat_word(at + 8);
        a[3] = graft_cat_word(at + 8 * ld + 8);
    }

    // A warp's 16 rows of an A operand over HD columns: up to head dim 64 as fragments in
    // registers, loaded once for every tile of the other side; above it (where they would cost
    // occupancy) left in shared memory and read at each use.
    template <int HD, bool REGS = (HD <= 64)>
    struct Rows {
        unsigned int x[HD / 16][4];
        __device__ __forceinline__ void load(const T* a, int ld) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                a_frag(x[kk], a + kk * 16, ld);
            }
        }
    };
    template <int HD>
    struct Rows<HD, false> {
        const T* a;
        __device__ __forceinline__ void load(const T* at, int) { a = at; }
    };

    template <int HD, int N>
    static __device__ __forceinline__ void abt(float (*c)[4], const Rows<HD, false>& a,
                                               const T* b, int ld) {
        abt<HD, N>(c, a.a, b, ld);
    }

    template <int HD, int N>
    static __device__ __forceinline__ void abt(float (*c)[4], const Rows<HD, true>& a,
                                               const T* b, int ld) {
        const unsigned int lane = threadIdx.x & 31u;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const unsigned int* x = a.x[kk];
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const T* at = b + (n * 8 + (lane >> 2)) * ld + kk * 16 + 2u * (lane & 3u);
                graft_mma_16816<T>(c[n], x[0], x[1], x[2], x[3], graft_cat_word(at),
                                   graft_cat_word(at + 8));
            }
        }
    }

    template <int HD, int N>
    static __device__ __forceinline__ void abt(float (*c)[4], const T* a, const T* b, int ld) {
        Rows<HD, true> rows;
        rows.load(a, ld);
        abt<HD, N>(c, rows, b, ld);
    }

    template <int HD, int K>
    static __device__ __forceinline__ void cb(float (*acc)[4], const float (*c)[4], const T* b,
                                              int ld) {
#pragma unroll
        for (int kk = 0; kk < K / 2; ++kk) {
            const float* c0 = c[2 * kk];
            const float* c1 = c[2 * kk + 1];
            const unsigned int x0 = pack(c0[0], c0[1]);
            const unsigned int x1 = pack(c0[2], c0[3]);
            const unsigned int x2 = pack(c1[0], c1[1]);
            const unsigned int x3 = pack(c1[2], c1[3]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                unsigned int y[2];
                graft_cat_b_trans(y, b + kk * 16 * ld + n * 8, ld * (int)sizeof(T));
                graft_mma_16816<T>(acc[n], x0, x1, x2, x3, y[0], y[1]);
            }
        }
    }
};

// f32 takes m16n8k8 steps of three TF32 products each (`graft_mma_3xtf32`: about f32's
// precision, C kept in f32), with PAD 4; C's columns reach the A fragment's lanes by shuffles
// within each quad.
template <>
struct GraftCatMma<float> {
    static const int PAD = 4;

    // The A operand's rows stay in shared memory (their TF32 parts would take 4 HD / 8
    // registers a lane).
    template <int HD>
    struct Rows {
        const float* a;
        __device__ __forceinline__ void load(const float* at, int) { a = at; }
    };

    template <int HD, int N>
    static __device__ __forceinline__ void abt(float (*c)[4], const Rows<HD>& a, const float* b,
                                               int ld) {
        abt<HD, N>(c, a.a, b, ld);
    }

    template <int HD, int N>
    static __device__ __forceinline__ void abt(float (*c)[4], const float* a, const float* b,
                                               int ld) {
        const unsigned int g = (threadIdx.x & 31u) >> 2;
        const unsigned int t = threadIdx.x & 3u;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < HD; kk += 8) {
            const float* at = a + g * ld + kk + t;
            unsigned int ah[4];
            unsigned int al[4];
            graft_tf32_split(at[0], ah[0], al[0]);
            graft_tf32_split(at[8 * ld], ah[1], al[1]);
            graft_tf32_split(at[4], ah[2], al[2]);
            graft_tf32_split(at[8 * ld + 4], ah[3], al[3]);
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const float* bt = b + (n * 8 + g) * ld + kk + t;
                const float y[2] = {bt[0], bt[4]};
                graft_mma_3xtf32(c[n], ah, al, y);
            }
        }
    }

    template <int HD, int K>
    static __device__ __forceinline__ void cb(float (*acc)[4], const float (*c)[4],
                                              const float* b, int ld) {
        const unsigned int lane = threadIdx.x & 31u;
        const unsigned int g = lane >> 2;
        const unsigned int t = lane & 3u;
        // Column t of a C fragment is element t & 1 of lane (g, t / 2); column t + 4 of lane
        // (g, t / 2 + 2).
        const unsigned int src = (lane & ~3u) | (t >> 1);
        const bool odd = t & 1u;
#pragma unroll
        for (int kk = 0; kk < K; ++kk) {
            float x[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float e0 = __shfl_sync(0xffffffffu, c[kk][2 * h], src);
                const float e1 = __shfl_sync(0xffffffffu, c[kk][2 * h + 1], src);
                const float f0 = __shfl_sync(0xffffffffu, c[kk][2 * h], src + 2u);
                const float f1 = __shfl_sync(0xffffffffu, c[kk][2 * h + 1], src + 2u);
                x[h] = odd ? e1 : e0;      // (g + 8h, t)
                x[2 + h] = odd ? f1 : f0;  // (g + 8h, t + 4)
            }
            unsigned int ah[4];
            unsigned int al[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                graft_tf32_split(x[e], ah[e], al[e]);
            }
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const float* bt = b + (kk * 8 + t) * ld + n * 8 + g;
                const float y[2] = {bt[0], bt[4 * ld]};
                graft_mma_3xtf32(acc[n], ah, al, y);
            }
        }
    }
};

// Two adjacent outputs (8-byte aligned for f32, 4 for 16-bit types).
template <typename T>
__device__ __forceinline__ void graft_cat_store2(T* p, float a, float b) {
    *reinterpret_cast<unsigned int*>(p) = GraftCatMma<T>::pack(a, b);
}
template <>
__device__ __forceinline__ void graft_cat_store2<float>(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

// A tile of ROWS rows of one head of a token-major tensor on its way to shared memory
// ([ROWS][HD + PAD] elements, 16-byte aligned rows), in 16-byte pieces, N a thread: `load`
// issues every load of the tile into registers at once (rows at or past seq as zeros), so the
// block can compute on the tile before while they arrive, and `store` writes them to shared
// memory. Where `src` or the row stride is not 16-byte aligned (a view at an odd offset) each
// piece is gathered an element at a time.
template <typename T, int HD, int ROWS>
struct GraftCatTile {
    static const int V = 16 / sizeof(T);  // elements a piece
    static const int N = ROWS * HD / V / 128;
    uint4 x[N];

    __device__ __forceinline__ void load(const T* src, unsigned long long stride,
                                         unsigned int first, unsigned int seq) {
        const bool wide = ((unsigned long long)src % 16u) == 0u && stride % V == 0u;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const unsigned int i = threadIdx.x + n * 128u;
            const unsigned int row = first + i / (HD / V);
            const T* at = src + row * stride + (i % (HD / V)) * V;
            x[n] = make_uint4(0u, 0u, 0u, 0u);
            if (row < seq && wide) {
                x[n] = *reinterpret_cast<const uint4*>(at);
            } else if (row < seq) {
                T* e = reinterpret_cast<T*>(&x[n]);
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    e[v] = at[v];
                }
            }
        }
    }

    __device__ __forceinline__ void store(T* dst) const {
        const int P = HD + GraftCatMma<T>::PAD;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const unsigned int i = threadIdx.x + n * 128u;
            *reinterpret_cast<uint4*>(dst + (i / (HD / V)) * P + (i % (HD / V)) * V) = x[n];
        }
    }
};

// Rows first .. first + ROWS of `src` (as `GraftCatTile` takes them) into `dst`, at once.
template <typename T, int HD, int ROWS>
__device__ __forceinline__ void graft_cat_stage(T* dst, const T* src, unsigned long long stride,
                                                unsigned int first, unsigned int seq) {
    GraftCatTile<T, HD, ROWS> tile;
    tile.load(src, stride, first, seq);
    tile.store(dst);
}

// One block of the forward and dq kernels: 64 query rows of head h of sequence b (grid x
// reversed: the longest rows first), this warp's 16 and this lane's two (g and g + 8); `q0`
// and `kv0` are the offsets of the head's row 0 in q-shaped and k-shaped tensors.
template <int HD>
struct GraftCatRows {
    unsigned int h, row0, wrow0, rows[2];
    unsigned long long bh, q0, kv0, qstride, kstride;
    __device__ GraftCatRows(unsigned int seq, unsigned int heads, unsigned int kv_heads) {
        const unsigned int lane = threadIdx.x & 31u;
        const unsigned long long b = blockIdx.z;
        h = blockIdx.y;
        row0 = (gridDim.x - 1u - blockIdx.x) * GRAFT_CAT_ROWS;
        wrow0 = row0 + (threadIdx.x >> 5) * 16u;
        rows[0] = wrow0 + (lane >> 2);
        rows[1] = rows[0] + 8u;
        bh = b * heads + h;
        qstride = (unsigned long long)heads * HD;
        kstride = (unsigned long long)kv_heads * HD;
        q0 = (b * seq * heads + h) * HD;
        kv0 = (b * seq * kv_heads + h / (heads / kv_heads)) * HD;
    }
};

// The keys and values of the block's KV head, KT at a time: `next` issues the loads of the
// tile at key0 into registers; `stage` (once the previous tile's readers are done) writes them
// to ks and vs, issues the loads of the tile after it up to `last`, and says whether any of
// this warp's rows sees a key of the staged tile.
template <typename T, int HD, int KT>
struct GraftCatKeys {
    GraftCatTile<T, HD, KT> k_tile;
    GraftCatTile<T, HD, KT> v_tile;

    __device__ __forceinline__ void next(const T* k, const T* v, const GraftCatRows<HD>& r,
                                         unsigned int key0, unsigned int seq) {
        k_tile.load(k + r.kv0, r.kstride, key0, seq);
        v_tile.load(v + r.kv0, r.kstride, key0, seq);
    }

    __device__ __forceinline__ bool stage(T* ks, T* vs, const T* k, const T* v,
                                          const GraftCatRows<HD>& r, unsigned int key0,
                                          unsigned int last, unsigned int seq) {
        __syncthreads();
        k_tile.store(ks);
        v_tile.store(vs);
        __syncthreads();
        if (key0 + KT <= last) {
            next(k, v, r, key0 + KT, seq);
        }
        return r.wrow0 < seq && r.wrow0 + 15u >= key0;
    }
};

// log2(e) and ln(2): the kernels' exponentials are exp2 of scores scaled by log2(e).
#define GRAFT_CAT_LOG2E 1.4426950408889634f
#define GRAFT_CAT_LN2 0.6931471805599453f

// The forward's scores of one key tile, times scale2, and each row's running max; with MASK
// the keys past a row (and rows at or past seq) as -inf. Without MASK the caller knows that
// every row of the warp sees every key of the tile.
template <bool MASK, int NT>
__device__ __forceinline__ void graft_cat_scores(float (*s)[4], float* m_new,
                                                 const unsigned int* rows, unsigned int key0,
                                                 unsigned int t, unsigned int seq,
                                                 float scale2) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int row = rows[e >> 1];
            const unsigned int key = key0 + n * 8u + 2u * t + (e & 1);
            const bool seen = !MASK || (key <= row && row < seq);
            s[n][e] = seen ? s[n][e] * scale2 : GRAFT_NEG_INF;
            m_new[e >> 1] = fmaxf(m_new[e >> 1], s[n][e]);
        }
    }
}

// The backward's dS = P (dP - delta) in place of the scores `s` of one tile (P = exp2(S *
// scale2 - lse2), lse2 in log2 units), a warp's rows against a tile's keys (ROWS: the dq
// kernel's layout, row i of element e is rows[e >> 1], key base + column) or a warp's keys
// against a tile's rows (the dk/dv kernel's, transposed: key keys[e >> 1], row base + column);
// with MASK, zero where the key is past the row or the row at or past seq; P kept in `p` if
// given. `lse2` and `delta` per row: by element pair (ROWS) or by column (from shared memory).
template <bool MASK, bool ROWS, int NT>
__device__ __forceinline__ void graft_cat_ds(float (*s)[4], const float (*dp)[4], float (*p)[4],
                                             const unsigned int* fixed, unsigned int base,
                                             unsigned int t, unsigned int seq, float scale2,
                                             const float* lse2, const float* delta) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int j = n * 8u + 2u * t + (e & 1);
            const unsigned int row = ROWS ? fixed[e >> 1] : base + j;
            const unsigned int key = ROWS ? base + j : fixed[e >> 1];
            const int at = ROWS ? (e >> 1) : (int)j;
            const bool seen = !MASK || (key <= row && row < seq);
            const float pe = seen ? exp2f(s[n][e] * scale2 - lse2[at]) : 0.0f;
            s[n][e] = pe * (dp[n][e] - delta[at]);
            if (p != nullptr) {
                p[n][e] = pe;
            }
        }
    }
}

// The output rows of one (64-row tile, head, sequence), KT keys a tile: per key tile, each
// warp's S = Q K^T (scaled, masked above the diagonal), the online softmax's max and sum per
// row, and O += P V; then O / sum and lse = max + log(sum) per row.
template <typename T, int HD, int KT>
__device__ void graft_cat_forward(const T* q, const T* k, const T* v, T* out, float* lse,
                                  unsigned int seq, unsigned int heads, unsigned int kv_heads,
                                  float scale) {
    const int P = HD + GraftCatMma<T>::PAD;
    const int NT = KT / 8;
    const int DT = HD / 8;
    __shared__ __align__(16) T qs[GRAFT_CAT_ROWS * P];
    __shared__ __align__(16) T ks[KT * P];
    __shared__ __align__(16) T vs[KT * P];

    const GraftCatRows<HD> r(seq, heads, kv_heads);
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int t = threadIdx.x & 3u;

    graft_cat_stage<T, HD, GRAFT_CAT_ROWS>(qs, q + r.q0, r.qstride, r.row0, seq);
    __syncthreads();
    typename GraftCatMma<T>::template Rows<HD> qf;
    qf.load(qs + warp * 16 * P, P);
    // Scores in log2 units: exp(x * scale) = exp2(x * scale * log2(e)).
    const float scale2 = scale * GRAFT_CAT_LOG2E;
    float m[2] = {GRAFT_NEG_INF, GRAFT_NEG_INF};
    float l[2] = {0.0f, 0.0f};
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    const unsigned int last = min(r.row0 + GRAFT_CAT_ROWS, seq) - 1u;
    GraftCatKeys<T, HD, KT> keys;
    keys.next(k, v, r, 0u, seq);
    for (unsigned int key0 = 0; key0 <= last; key0 += KT) {
        if (!keys.stage(ks, vs, k, v, r, key0, last, seq)) {
            continue;  // no row of this warp sees a key of the tile
        }
        float s[NT][4];
        GraftCatMma<T>::template abt<HD, NT>(s, qf, ks, P);
        // Scale (and mask where the tile reaches the diagonal or the sequence's end); each
        // row's new max over its quad's lanes.
        const bool whole = key0 + KT <= r.wrow0 + 1u && r.wrow0 + 16u <= seq;
        float m_new[2] = {m[0], m[1]};
        if (whole) {
            graft_cat_scores<false, NT>(s, m_new, r.rows, key0, t, seq, scale2);
        } else {
            graft_cat_scores<true, NT>(s, m_new, r.rows, key0, t, seq, scale2);
        }
        float keep[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffffu, m_new[i], 1));
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffffu, m_new[i], 2));
            // What the earlier tiles' sums are worth at the new max (1 while the row has
            // seen nothing).
            keep[i] = m_new[i] == GRAFT_NEG_INF ? 1.0f : exp2f(m[i] - m_new[i]);
            m[i] = m_new[i];
        }
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // A row that has seen no key yet (m still -inf) has only -inf scores.
                const float p = s[n][e] == GRAFT_NEG_INF ? 0.0f : exp2f(s[n][e] - m[e >> 1]);
                s[n][e] = p;
                sum[e >> 1] += p;
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
            l[i] = l[i] * keep[i] + sum[i];
        }
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            o[n][0] *= keep[0];
            o[n][1] *= keep[0];
            o[n][2] *= keep[1];
            o[n][3] *= keep[1];
        }
        GraftCatMma<T>::template cb<HD, NT>(o, s, vs, P);  // O += P V
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int row = r.rows[i];
        if (row < seq) {
            const float inv = 1.0f / l[i];
            T* dst = out + r.q0 + row * r.qstride + 2u * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                graft_cat_store2(dst + n * 8, o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
            }
            if (t == 0u) {
                lse[r.bh * seq + row] = m[i] * GRAFT_CAT_LN2 + logf(l[i]);
            }
        }
    }
}

// The query gradient of one (64-row tile, head, sequence), KT keys a tile: first each row's
// delta = rowsum(dO * O) (kept for the key and value kernel), then per key tile S = Q K^T
// and dP = dO V^T, P = exp(S * scale - lse), dS = P * (dP - delta) and dQ += dS K; dQ is
// scaled once at the end.
template <typename T, int HD, int KT>
__device__ void graft_cat_dq(const T* q, const T* k, const T* v, const T* o, const T* dout,
                             const float* lse, float* delta, T* dq, unsigned int seq,
                             unsigned int heads, unsigned int kv_heads, float scale) {
    const int P = HD + GraftCatMma<T>::PAD;
    const int NT = KT / 8;
    const int DT = HD / 8;
    __shared__ __align__(16) T qs[GRAFT_CAT_ROWS * P];
    __shared__ __align__(16) T gs[GRAFT_CAT_ROWS * P];
    __shared__ __align__(16) T ks[KT * P];
    __shared__ __align__(16) T vs[KT * P];

    const GraftCatRows<HD> r(seq, heads, kv_heads);
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int t = threadIdx.x & 3u;

    graft_cat_stage<T, HD, GRAFT_CAT_ROWS>(qs, q + r.q0, r.qstride, r.row0, seq);
    graft_cat_stage<T, HD, GRAFT_CAT_ROWS>(gs, dout + r.q0, r.qstride, r.row0, seq);
    __syncthreads();
    // Each row's delta: its quad's lanes take dims 2t, 2t + 1 of every 8, then sum.
    float dl[2];
    float lr[2];  // lse in log2 units
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int row = r.rows[i];
        float part = 0.0f;
        if (row < seq) {
            const T* orow = o + r.q0 + row * r.qstride;
            const T* grow = gs + (row - r.row0) * P;
#pragma unroll
            for (int d = 2 * t; d < HD; d += 8) {
                part = fmaf(graft_to_f32(grow[d]), graft_to_f32(orow[d]), part);
                part = fmaf(graft_to_f32(grow[d + 1]), graft_to_f32(orow[d + 1]), part);
            }
        }
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        dl[i] = part;
        lr[i] = row < seq ? lse[r.bh * seq + row] * GRAFT_CAT_LOG2E : 0.0f;
        if (row < seq && t == 0u) {
            delta[r.bh * seq + row] = part;
        }
    }
    float acc[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
    typename GraftCatMma<T>::template Rows<HD> qf;
    typename GraftCatMma<T>::template Rows<HD> gf;
    qf.load(qs + warp * 16 * P, P);
    gf.load(gs + warp * 16 * P, P);
    const float scale2 = scale * GRAFT_CAT_LOG2E;
    const unsigned int last = min(r.row0 + GRAFT_CAT_ROWS, seq) - 1u;
    GraftCatKeys<T, HD, KT> keys;
    keys.next(k, v, r, 0u, seq);
    for (unsigned int key0 = 0; key0 <= last; key0 += KT) {
        if (!keys.stage(ks, vs, k, v, r, key0, last, seq)) {
            continue;  // no row of this warp sees a key of the tile
        }
        float s[NT][4];
        float dp[NT][4];
        GraftCatMma<T>::template abt<HD, NT>(s, qf, ks, P);   // S = Q K^T
        GraftCatMma<T>::template abt<HD, NT>(dp, gf, vs, P);  // dP = dO V^T
        // dS, in s.
        if (key0 + KT <= r.wrow0 + 1u && r.wrow0 + 16u <= seq) {
            graft_cat_ds<false, true, NT>(s, dp, nullptr, r.rows, key0, t, seq, scale2, lr, dl);
        } else {
            graft_cat_ds<true, true, NT>(s, dp, nullptr, r.rows, key0, t, seq, scale2, lr, dl);
        }
        GraftCatMma<T>::template cb<HD, NT>(acc, s, ks, P);  // dQ += dS K
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int row = r.rows[i];
        if (row < seq) {
            T* dst = dq + r.q0 + row * r.qstride + 2u * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                graft_cat_store2(dst + n * 8, acc[n][2 * i] * scale, acc[n][2 * i + 1] * scale);
            }
        }
    }
}

// The key and value gradients of one (64-key tile, KV head, sequence), QT query rows a tile:
// for each query head of the group and each query tile at or after the keys, S^T = K Q^T and
// dP^T = V dO^T, P^T = exp(S^T * scale - lse), dS^T = P^T * (dP^T - delta), dV += P^T dO and
// dK += dS^T Q; dK is scaled once at the end. dkv holds dk ([batch, seq, kv_heads * HD]) and
// then dv.
template <typename T, int HD, int QT>
__device__ void graft_cat_dkv(const T* q, const T* k, const T* v, const T* dout,
                              const float* lse, const float* delta, T* dkv, unsigned int batch,
                              unsigned int seq, unsigned int heads, unsigned int kv_heads,
                              float scale) {
    const int P = HD + GraftCatMma<T>::PAD;
    const int NT = QT / 8;
    const int DT = HD / 8;
    __shared__ __align__(16) T ks[GRAFT_CAT_ROWS * P];
    __shared__ __align__(16) T vs[GRAFT_CAT_ROWS * P];
    __shared__ __align__(16) T qs[QT * P];
    __shared__ __align__(16) T gs[QT * P];
    __shared__ float ls[QT];
    __shared__ float ds_of[QT];

    const unsigned int kvh = blockIdx.y;  // blockIdx.x 0, the longest columns, first
    const unsigned int b = blockIdx.z;
    const unsigned int group = heads / kv_heads;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int t = lane & 3u;
    const unsigned int key0 = blockIdx.x * GRAFT_CAT_ROWS;
    const unsigned int wkey0 = key0 + warp * 16u;
    const unsigned int keys[2] = {wkey0 + (lane >> 2), wkey0 + (lane >> 2) + 8u};
    const unsigned long long qstride = (unsigned long long)heads * HD;
    const unsigned long long kstride = (unsigned long long)kv_heads * HD;
    const unsigned long long bs = (unsigned long long)b * seq;
    const float scale2 = scale * GRAFT_CAT_LOG2E;

    graft_cat_stage<T, HD, GRAFT_CAT_ROWS>(ks, k + (bs * kv_heads + kvh) * HD, kstride, key0,
                                           seq);
    graft_cat_stage<T, HD, GRAFT_CAT_ROWS>(vs, v + (bs * kv_heads + kvh) * HD, kstride, key0,
                                           seq);
    float dk[DT][4];
    float dv[DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
        dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    }
    // The query tiles, head by head: (gi, i0) from (0, key0). Each tile's loads (q, dO, and
    // for thread i < QT row i's lse and delta) are issued while the block computes on the
    // tile before.
    GraftCatTile<T, HD, QT> q_tile;
    GraftCatTile<T, HD, QT> g_tile;
    float l_next = 0.0f;
    float d_next = 0.0f;
    const auto issue = [&](unsigned int gi, unsigned int i0) {
        const unsigned int h = kvh * group + gi;
        const unsigned long long bh = (unsigned long long)b * heads + h;
        q_tile.load(q + (bs * heads + h) * HD, qstride, i0, seq);
        g_tile.load(dout + (bs * heads + h) * HD, qstride, i0, seq);
        const unsigned int row = i0 + threadIdx.x;
        const bool in = threadIdx.x < QT && row < seq;
        l_next = in ? lse[bh * seq + row] : 0.0f;
        d_next = in ? delta[bh * seq + row] : 0.0f;
    };
    unsigned int gi = 0;
    unsigned int next = key0;
    issue(gi, next);
    while (gi < group) {
        __syncthreads();  // the previous tile's readers are done (or ks, vs staged)
        q_tile.store(qs);
        g_tile.store(gs);
        if (threadIdx.x < QT) {
            ls[threadIdx.x] = l_next * GRAFT_CAT_LOG2E;  // lse in log2 units
            ds_of[threadIdx.x] = d_next;
        }
        __syncthreads();
        const unsigned int i0 = next;
        next += QT;
        if (next >= seq) {
            next = key0;
            ++gi;
        }
        if (gi < group) {
            issue(gi, next);
        }
        if (wkey0 >= seq || wkey0 > i0 + QT - 1u) {
            continue;  // no row of the tile sees a key of this warp
        }
        float s[NT][4];
        float dp[NT][4];
        GraftCatMma<T>::template abt<HD, NT>(s, ks + warp * 16 * P, qs, P);   // S^T = K Q^T
        GraftCatMma<T>::template abt<HD, NT>(dp, vs + warp * 16 * P, gs, P);  // dP^T = V dO^T
        // dS^T in s, P^T in dp.
        if (wkey0 + 16u <= i0 + 1u && i0 + QT <= seq) {
            graft_cat_ds<false, false, NT>(s, dp, dp, keys, i0, t, seq, scale2, ls, ds_of);
        } else {
            graft_cat_ds<true, false, NT>(s, dp, dp, keys, i0, t, seq, scale2, ls, ds_of);
        }
        GraftCatMma<T>::template cb<HD, NT>(dv, dp, gs, P);  // dV += P^T dO
        GraftCatMma<T>::template cb<HD, NT>(dk, s, qs, P);   // dK += dS^T Q
    }
    const unsigned long long half = (unsigned long long)batch * seq * kstride;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned int key = keys[i];
        if (key < seq) {
            T* gk = dkv + ((bs + key) * kv_heads + kvh) * HD + 2u * t;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                graft_cat_store2(gk + n * 8, dk[n][2 * i] * scale, dk[n][2 * i + 1] * scale);
                graft_cat_store2(gk + half + n * 8, dv[n][2 * i], dv[n][2 * i + 1]);
            }
        }
    }
}

// Each kernel at head dim 64 and 128 for bf16 and f16, and at 64 for f32, with KT keys a
// forward tile and BT keys (dq) or query rows (dk/dv) a backward tile: 32 and 32 at head dim
// 64 in bf16 and f16, 32 and 16 otherwise. Every block's static shared memory stays under 48
// KiB (f32 at head dim 128 would not). FB and QB are the least blocks a multiprocessor must
// hold of the forward and of the backward kernels (`__launch_bounds__`; 0: ptxas chooses):
// four keeps 128 registers a thread or fewer, three 168, which these fit without spilling
// (thanks to the 32-row tiles at head dim 64; the backward at four blocks would need tiles of
// 16 and was slower).
#define GRAFT_CAT(suffix, T, HD, KT, BT, FB, QB)                                             \
    extern "C" __global__ void __launch_bounds__(128, FB)                                    \
        graft_causal_attention_tc_forward_##suffix##_##HD(                                   \
            const T* q, const T* k, const T* v, T* out, float* lse, unsigned int seq,        \
            unsigned int heads, unsigned int kv_heads, float scale) {                        \
        graft_cat_forward<T, HD, KT>(q, k, v, out, lse, seq, heads, kv_heads, scale);        \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, QB)                                    \
        graft_causal_attention_tc_dq_##suffix##_##HD(                                        \
            const T* q, const T* k, const T* v, const T* o, const T* dout, const float* lse, \
            float* delta, T* dq, unsigned int seq, unsigned int heads,                       \
            unsigned int kv_heads, float scale) {                                            \
        graft_cat_dq<T, HD, BT>(q, k, v, o, dout, lse, delta, dq, seq, heads, kv_heads,      \
                                scale);                                                      \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, QB)                                    \
        graft_causal_attention_tc_dkv_##suffix##_##HD(                                       \
            const T* q, const T* k, const T* v, const T* dout, const float* lse,             \
            const float* delta, T* dkv, unsigned int batch, unsigned int seq,                \
            unsigned int heads, unsigned int kv_heads, float scale) {                        \
        graft_cat_dkv<T, HD, BT>(q, k, v, dout, lse, delta, dkv, batch, seq, heads,          \
                                 kv_heads, scale);                                           \
    }
GRAFT_CAT(bf16, GraftBf16, 64, 32, 32, 4, 3)
GRAFT_CAT(bf16, GraftBf16, 128, 32, 16, 3, 0)
GRAFT_CAT(f16, GraftF16, 64, 32, 32, 4, 3)
GRAFT_CAT(f16, GraftF16, 128, 32, 16, 3, 0)
GRAFT_CAT(f32, float, 64, 32, 16, 3, 0)
