
// The split kernel of `prefill_attention` on tensor cores (bf16 and f16, head_dim a multiple
// of 16 up to 128): the partials of decode_attention.cu's split kernel, in its scratch layout
// (its combine kernel merges them), for queries that come in runs of one sequence's
// consecutive positions (a prefill chunk).
//
// A block takes `per` consecutive chunks of `chunk` (64) cache positions (its split) of one KV
// head for a tile of `tile` consecutive queries: 64 query rows (query t0 + r / group, head
// kvh * group + r % group), 16 a warp (one m16 tile). In each chunk the tile's queries are
// taken in runs whose block-table entries for the chunk are the same (one sequence, or
// sequences sharing the chunk's blocks): a run's keys and values are loaded once into shared
// memory, and each warp computes S = Q K^T (m16n8k16, 8 key columns a tile), masks each row to
// its query's visible positions, and folds the chunk into the row's running max, sum and
// output (the flash-attention scheme: sums in f32, P rounded to T for O += P V); rows of
// queries outside the run keep their state. At the end each live row writes its split's
// partial (max, sum and, where it saw a position, its unnormalised output) once. The host
// picks `per` from max_seq alone (so a query's result does not depend on the queries beside
// it); chunks past the tile's last position, or before its first visible one, are skipped.
//
// Fragments (lane = 4 g + t): A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..),
// a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); B (16 x 8, column-major): b0 = (2t..2t+1, g),
// b1 = (2t + 8.., g); C (16 x 8): c0, c1 = (g, 2t), (g, 2t + 1), c2, c3 = the same at g + 8.
// K's rows are B's columns as they are stored (two adjacent elements a load); V's (k = key,
// n = dim) takes two keys' elements of one dim, packed.

template <typename T>
__device__ void graft_prefill_attention_partial(
    const T* q, const T* k, const T* v, const unsigned int* positions,
    const unsigned int* table, unsigned int max_blocks, unsigned int blocks,
    unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,
    unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,
    unsigned int reach, float scale, unsigned int batch, unsigned int tile, unsigned int per) {
    graft_pdl_trigger();
    graft_pdl_wait();
    // Keys then values, [chunk][hd + 8] each (the padding spreads a fragment's loads over
    // the banks), then each query's position and window start, whether its entries equal
    // the query before's, the run's bounds, and the first cache row of each block the run's
    // positions are in.
    extern __shared__ float graft_smem[];
    const unsigned int stride = hd + 8u;
    T* ks = reinterpret_cast<T*>(graft_smem);
    T* vs = ks + chunk * stride;
    unsigned int* pos_of = reinterpret_cast<unsigned int*>(vs + chunk * stride);
    unsigned int* lo_of = pos_of + tile;
    unsigned int* same = lo_of + tile;  // whether query i's entries equal query i - 1's
    unsigned int* run = same + tile;    // [0] the run's end, [1] its start, [2] its end
    const unsigned int words = 3u * tile + 3u;
    unsigned long long* bases =
        reinterpret_cast<unsigned long long*>(pos_of + words + (words & 1u));

    const unsigned int split = blockIdx.x;
    const unsigned int kvh = blockIdx.y;
    const unsigned int t0 = blockIdx.z * tile;
    const unsigned int splits = gridDim.x;
    const unsigned int group = heads / kv_heads;
    const unsigned int count = min(tile, batch - t0);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int g = lane >> 2;
    const unsigned int t = lane & 3u;
    const GraftEntry entry(max_blocks, block_size);

    // Each query's position (clamped: never read outside the cache row) and window start.
    for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
        unsigned int pos = positions[t0 + i];
        pos = pos < max_seq ? pos : max_seq - 1u;
        pos_of[i] = pos;
        lo_of[i] = pos > reach ? pos - reach : 0u;
    }

    // This warp's rows g and g + 8 of its 16: their queries (`live` within the tile), heads
    // and partials' slots; their running max, sum and unnormalised output over the chunks.
    unsigned int qi[2];
    bool live[2];
    unsigned long long slot[2];
    for (int h = 0; h < 2; ++h) {
        const unsigned int row = warp * 16u + g + 8u * h;
        qi[h] = row / group;
        live[h] = qi[h] < count;
        const unsigned int qq = live[h] ? qi[h] : 0u;
        const unsigned int head = kvh * group + row % group;
        slot[h] = ((unsigned long long)(t0 + qq) * heads + head) * splits + split;
    }
    const T* qa = q + (slot[0] / splits) * hd;
    const T* qb = q + (slot[1] / splits) * hd;
    float m[2] = {GRAFT_NEG_INF, GRAFT_NEG_INF};
    float l[2] = {0.0f, 0.0f};
    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    __syncthreads();

    // The tile's chunks: from its first visible position's to its last position's.
    if (threadIdx.x == 0) {
        unsigned int lo = max_seq;
        unsigned int hi = 0u;
        for (unsigned int i = 0; i < count; ++i) {
            lo = min(lo, lo_of[i]);
            hi = max(hi, pos_of[i]);
        }
        run[1] = lo / chunk;
        run[2] = hi / chunk + 1u;
    }
    __syncthreads();
    const unsigned int c_begin = max(split * per, run[1]);
    const unsigned int c_end = min((split + 1u) * per, run[2]);
    __syncthreads();
    for (unsigned int c = c_begin; c < c_end; ++c) {
        const unsigned int c0 = c * chunk;
        // The chunk's table entries: those a run must agree on (without a table each query
        // reads its own row: runs of one).
        const unsigned int e0 = entry(c0);
        const unsigned int e1 = entry(min(c0 + chunk, max_seq) - 1u);
        for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
            bool equal = table && i > 0u;
            if (equal) {
                const unsigned int* ta = table + (unsigned long long)(t0 + i - 1u) * max_blocks;
                const unsigned int* tb = ta + max_blocks;
                for (unsigned int e = e0; e <= e1 && equal; ++e) {
                    equal = ta[e] == tb[e];
                }
            }
            same[i] = equal ? 1u : 0u;
        }
        __syncthreads();

        for (unsigned int a = 0; a < count;) {
            if (threadIdx.x == 0) {
                // The run: the queries from a on whose entries equal a's, and the union of
                // their visible positions in the chunk.
                unsigned int b = a + 1u;
                while (b < count && same[b]) {
                    ++b;
                }
                unsigned int start = c0 + chunk;
                unsigned int end = c0;
                for (unsigned int i = a; i < b; ++i) {
                    const unsigned int lo = max(lo_of[i], c0);
                    const unsigned int hi = min(pos_of[i] + 1u, c0 + chunk);
                    if (lo < hi) {
                        start = min(start, lo);
                        end = max(end, hi);
                    }
                }
                run[0] = b;
                run[1] = start;
                run[2] = end;
            }
            __syncthreads();
            const unsigned int b = run[0];
            const unsigned int start = run[1];
            const unsigned int end = run[2];
            if (start < end) {
                // The run's blocks, looked up once.
                const unsigned int blk0 = entry(start);
                const unsigned int* ta =
                    table ? table + (unsigned long long)(t0 + a) * max_blocks : 0;
                for (unsigned int i = threadIdx.x; blk0 + i <= entry(end - 1u);
                     i += blockDim.x) {
                    unsigned int blk = ta ? ta[blk0 + i] : t0 + a;
                    blk = blk < blocks ? blk : blocks - 1u;
                    bases[i] = ((unsigned long long)blk * kv_heads + kvh) * block_size;
                }
                __syncthreads();
                // Keys and values of positions start..end (zero elsewhere: a masked score's
                // value must be 0, not whatever the memory held), two elements a load.
                const unsigned int pairs = hd / 2u;
                for (unsigned int i = threadIdx.x; i < chunk * pairs; i += blockDim.x) {
                    const unsigned int r = i / pairs;
                    const unsigned int d = 2u * (i % pairs);
                    const unsigned int j = c0 + r;
                    unsigned int kw = 0u;
                    unsigned int vw = 0u;
                    if (j >= start && j < end) {
                        const unsigned int e = entry(j);
                        const unsigned long long at =
                            (bases[e - blk0] + (j - e * block_size)) * hd + d;
                        kw = *reinterpret_cast<const unsigned int*>(k + at);
                        vw = *reinterpret_cast<const unsigned int*>(v + at);
                    }
                    *reinterpret_cast<unsigned int*>(ks + r * stride + d) = kw;
                    *reinterpret_cast<unsigned int*>(vs + r * stride + d) = vw;
                }
                __syncthreads();

                // The rows of the run's queries see [lo, hi) of the chunk; the others
                // nothing (their state stays).
                unsigned int lo[2];
                unsigned int hi[2];
                bool in[2];
                for (int h = 0; h < 2; ++h) {
                    in[h] = live[h] && qi[h] >= a && qi[h] < b;
                    lo[h] = in[h] ? max(lo_of[qi[h]], c0) : 1u;
                    hi[h] = in[h] ? min(pos_of[qi[h]] + 1u, c0 + chunk) : 0u;
                }
                if (__any_sync(0xffffffffu, in[0] || in[1])) {
                    // S = Q K^T over the chunk's 64 keys: 8 column tiles.
                    float s[8][4];
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
                        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                    }
                    for (unsigned int kk = 0; kk < hd; kk += 16u) {
                        const unsigned int col = kk + 2u * t;
                        const unsigned int a0 =
                            in[0] ? *reinterpret_cast<const unsigned int*>(qa + col) : 0u;
                        const unsigned int a1 =
                            in[1] ? *reinterpret_cast<const unsigned int*>(qb + col) : 0u;
                        const unsigned int a2 =
                            in[0] ? *reinterpret_cast<const unsigned int*>(qa + col + 8u) : 0u;
                        const unsigned int a3 =
                            in[1] ? *reinterpret_cast<const unsigned int*>(qb + col + 8u) : 0u;
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
                            const T* kr = ks + (n * 8u + g) * stride + col;
                            const unsigned int b0 = *reinterpret_cast<const unsigned int*>(kr);
                            const unsigned int b1 =
                                *reinterpret_cast<const unsigned int*>(kr + 8u);
                            graft_mma_16816<T>(s[n], a0, a1, a2, a3, b0, b1);
                        }
                    }
                    // Mask and scale; each row's new max over the quad's lanes.
                    float m_new[2] = {m[0], m[1]};
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int h = e >> 1;
                            const unsigned int j = c0 + n * 8u + 2u * t + (e & 1);
                            const bool seen = j >= lo[h] && j < hi[h];
                            s[n][e] = seen ? s[n][e] * scale : GRAFT_NEG_INF;
                            m_new[h] = fmaxf(m_new[h], s[n][e]);
                        }
                    }
                    float keep[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(0xffffffffu, m_new[h], 1));
                        m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(0xffffffffu, m_new[h], 2));
                        // What the earlier chunks' sums are worth at the new max (1 while
                        // the row has seen nothing).
                        keep[h] = m_new[h] == GRAFT_NEG_INF ? 1.0f : expf(m[h] - m_new[h]);
                        m[h] = m_new[h];
                    }
                    // P = exp(S - max), 0 where masked.
                    float sum[2] = {0.0f, 0.0f};
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int h = e >> 1;
                            const float p =
                                s[n][e] == GRAFT_NEG_INF ? 0.0f : expf(s[n][e] - m[h]);
                            s[n][e] = p;
                            sum[h] += p;
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
                        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
                        l[h] = l[h] * keep[h] + sum[h];
                    }
                    // O = O keep + P V: P as A (two column tiles of S make one k16 step).
                    unsigned int pa[4][4];
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        const float* sa = s[2 * kk];
                        const float* sb = s[2 * kk + 1];
                        pa[kk][0] = graft_pack2(graft_from_f32<T>(sa[0]), graft_from_f32<T>(sa[1]));
                        pa[kk][1] = graft_pack2(graft_from_f32<T>(sa[2]), graft_from_f32<T>(sa[3]));
                        pa[kk][2] = graft_pack2(graft_from_f32<T>(sb[0]), graft_from_f32<T>(sb[1]));
                        pa[kk][3] = graft_pack2(graft_from_f32<T>(sb[2]), graft_from_f32<T>(sb[3]));
                    }
#pragma unroll
                    for (int n = 0; n < 16; ++n) {
                        if (n * 8u < hd) {
                            o[n][0] *= keep[0];
                            o[n][1] *= keep[0];
                            o[n][2] *= keep[1];
                            o[n][3] *= keep[1];
#pragma unroll
                            for (int kk = 0; kk < 4; ++kk) {
                                const T* vc = vs + (kk * 16u + 2u * t) * stride + n * 8u + g;
                                const unsigned int b0 = graft_pack2(vc[0], vc[stride]);
                                const unsigned int b1 =
                                    graft_pack2(vc[8u * stride], vc[9u * stride]);
                                graft_mma_16816<T>(o[n], pa[kk][0], pa[kk][1], pa[kk][2],
                                                   pa[kk][3], b0, b1);
                            }
                        }
                    }
                }
            }
            __syncthreads();
            a = b;
        }
    }

    // This split's partial of each live row: its max and sum, and where it saw a position,
    // its unnormalised output.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (live[h] && t == 0u) {
            part_ml[2 * slot[h]] = m[h];
            part_ml[2 * slot[h] + 1] = l[h];
        }
        if (live[h] && m[h] != GRAFT_NEG_INF) {
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                if (n * 8u < hd) {
                    float* out = part_o + slot[h] * hd + n * 8u + 2u * t;
                    out[0] = o[n][2 * h];
                    out[1] = o[n][2 * h + 1];
                }
            }
        }
    }
}

#define GRAFT_PREFILL_ATTENTION(suffix, T)                                                   \
    extern "C" __global__ void graft_prefill_attention_partial_##suffix(                     \
        const T* q, const T* k, const T* v, const unsigned int* positions,                   \
        const unsigned int* table, unsigned int max_blocks, unsigned int blocks,             \
        unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,          \
        unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,    \
        unsigned int reach, float scale, unsigned int batch, unsigned int tile,              \
        unsigned int per) {                                                                  \
        graft_prefill_attention_partial<T>(q, k, v, positions, table, max_blocks, blocks,    \
                                           block_size, part_o, part_ml, heads, kv_heads,     \
                                           max_seq, hd, chunk, reach, scale, batch, tile,    \
                                           per);                                             \
    }
GRAFT_PREFILL_ATTENTION(bf16, GraftBf16)
GRAFT_PREFILL_ATTENTION(f16, GraftF16)
