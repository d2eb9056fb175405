
// The entry of a block-table row (of max_blocks entries of block_size positions) that holds
// position j: entry 0 of a static cache's row (one block: no division), a shift for a
// power-of-two block size, else a division.
struct GraftEntry {
    bool one;
    bool pow2;
    unsigned int shift;
    unsigned int block_size;
    __device__ GraftEntry(unsigned int max_blocks, unsigned int size)
        : one(max_blocks == 1u), pow2((size & (size - 1u)) == 0u), shift(__ffs(size) - 1u),
          block_size(size) {}
    __device__ unsigned int operator()(unsigned int j) const {
        return one ? 0u : pow2 ? j >> shift : j / block_size;
    }
};

// The partial of query heads first .. first + group (first = b * heads + kvh * group) over the
// visible positions start .. end of chunk `split`, at index (head * splits + split). Position
// j of sequence b is read where graft_cache_place puts it: through the sequence's row of the
// block table (max_blocks ids of blocks of block_size positions; max_seq = max_blocks *
// block_size; a static cache's rows are one block each), or without a table in cache block b
// (then block_size = max_seq).
template <typename T>
__device__ void graft_decode_attention_partial(
    const T* q, const T* k, const T* v, const unsigned int* positions,
    const unsigned int* table, unsigned int max_blocks, unsigned int blocks,
    unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,
    unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,
    unsigned int reach, float scale) {
    // As a programmatic dependent: nothing to do before the wait (q and the newest key and
    // value are the kernel before's).
    graft_pdl_trigger();
    graft_pdl_wait();
    extern __shared__ float graft_smem[];
    const unsigned int split = blockIdx.x;
    const unsigned int kvh = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int splits = gridDim.x;
    const unsigned int group = heads / kv_heads;
    const unsigned long long first =
        (unsigned long long)b * heads + (unsigned long long)kvh * group;

    unsigned int pos = positions[b];
    if (pos >= max_seq) {
        pos = max_seq - 1u;  // never read outside the cache row
    }
    const unsigned int lo = pos > reach ? pos - reach : 0u;
    const unsigned int c0 = split * chunk;
    const unsigned int start = lo > c0 ? lo : c0;
    const unsigned int end = pos + 1u < c0 + chunk ? pos + 1u : c0 + chunk;
    if (start >= end) {
        // Nothing visible in this chunk: an empty partial, and no K/V read.
        for (unsigned int g = threadIdx.x; g < group; g += blockDim.x) {
            const unsigned long long p = (first + g) * splits + split;
            part_ml[2 * p] = GRAFT_NEG_INF;
            part_ml[2 * p + 1] = 0.0f;
        }
        return;
    }

    // [group][hd] queries, [group][chunk] scores, then the first cache row of each cache block
    // the chunk's visible positions are in, at the next 8-byte boundary.
    float* qs = graft_smem;
    float* ps = graft_smem + group * hd;
    unsigned long long* bases = reinterpret_cast<unsigned long long*>(
        graft_smem + ((group * (hd + chunk) + 1u) & ~1u));
    const T* qg = q + first * hd;
    for (unsigned int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        qs[i] = graft_to_f32(qg[i]);
    }
    // Position j is in entry j / block_size of query b's block-table row (entry 0 of a
    // static cache's: no division; a shift for a power-of-two block size); the chunk's blocks
    // are looked up once, here (a few entries: the loops below read a place per key row and
    // per value part).
    const GraftEntry entry(max_blocks, block_size);
    const unsigned int blk0 = entry(start);
    {
        const unsigned int* tb = table ? table + (unsigned long long)b * max_blocks : 0;
        for (unsigned int i = threadIdx.x; blk0 + i <= entry(end - 1u); i += blockDim.x) {
            unsigned int blk = tb ? tb[blk0 + i] : b;
            blk = blk < blocks ? blk : blocks - 1u;
            bases[i] = ((unsigned long long)blk * kv_heads + kvh) * block_size;
        }
    }
    __syncthreads();

    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = blockDim.x >> 5;
    // The cache row (of hd elements) of position j.
    auto place = [&](unsigned int j) -> unsigned long long {
        const unsigned int e = entry(j);
        return bases[e - blk0] + (j - e * block_size);
    };

    // Scores: `tpr` threads per key row (the block's threads over the chunk's rows, a power
    // of two up to 32), thread r of a row dotting elements r, r + tpr, ... with every query
    // head of the group (the queries from shared memory, the row's threads on adjacent
    // banks), then the shares summed across the row's threads in a fixed order: no
    // warp-wide reduction per row, and every thread's loads independent of each other.
    unsigned int tpr = 1u;
    while (tpr < 32u && 2u * tpr * chunk <= blockDim.x) {
        tpr *= 2u;
    }
    for (unsigned int j0 = start; j0 < end; j0 += blockDim.x / tpr) {
        const unsigned int j = j0 + threadIdx.x / tpr;
        const unsigned int d0 = threadIdx.x % tpr;
        float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (unsigned int g0 = 0; g0 < group; g0 += 8u) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                s[i] = 0.0f;
            }
            if (j < end) {
                const T* kr = k + place(j) * hd;
#pragma unroll 8
                for (unsigned int d = d0; d < hd; d += tpr) {
                    const float x = graft_to_f32(kr[d]);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (g0 + i < group) {
                            s[i] += qs[(g0 + i) * hd + d] * x;
                        }
                    }
                }
            }
            // The row's threads are adjacent lanes of one warp (tpr divides 32).
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                for (unsigned int o = 1u; o < tpr; o *= 2u) {
                    s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
                }
            }
            if (j < end && threadIdx.x % tpr == 0u) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (g0 + i < group) {
                        ps[(g0 + i) * chunk + (j - c0)] = s[i] * scale;
                    }
                }
            }
        }
    }
    __syncthreads();

    // Softmax partial: one warp per query head; scores become exp(score - max).
    for (unsigned int g = warp; g < group; g += warps) {
        float* pg = ps + g * chunk;
        float m = GRAFT_NEG_INF;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            m = fmaxf(m, pg[j - c0]);
        }
        m = graft_warp_max(m);
        float l = 0.0f;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            const float e = expf(pg[j - c0] - m);
            pg[j - c0] = e;
            l += e;
        }
        l = graft_warp_sum(l);
        if (lane == 0) {
            const unsigned long long p = (first + g) * splits + split;
            part_ml[2 * p] = m;
            part_ml[2 * p + 1] = l;
        }
    }
    __syncthreads();

    // Values, 8 query heads at a time: thread t = part * hd + d sums head-dim element d over
    // positions start + part, start + part + parts, ... (eight loads in flight), where `parts`
    // threads share an element when the block has them to spare; the parts' sums are then
    // added in part order through shared memory (the queries' slot, free after the scores).
    // Every thread reaches every barrier: with parts > 1 the t0 loop runs once.
    const unsigned int parts = blockDim.x >= 2u * hd ? blockDim.x / hd : 1u;
    for (unsigned int g0 = 0; g0 < group; g0 += 8u) {
        for (unsigned int t0 = 0; t0 < hd * parts; t0 += blockDim.x) {
            const unsigned int t = t0 + threadIdx.x;
            const bool active = t < hd * parts;
            const unsigned int d = t % hd;
            const unsigned int part = t / hd;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (active) {
                unsigned int j = start + part;
                for (; j + 7u * parts < end; j += 8u * parts) {
                    float x[8];
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        x[u] = graft_to_f32(v[place(j + (unsigned int)u * parts) * hd + d]);
                    }
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        const unsigned int at = j + (unsigned int)u * parts - c0;
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            if (g0 + i < group) {
                                acc[i] += ps[(g0 + i) * chunk + at] * x[u];
                            }
                        }
                    }
                }
                for (; j < end; j += parts) {
                    const float x = graft_to_f32(v[place(j) * hd + d]);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (g0 + i < group) {
                            acc[i] += ps[(g0 + i) * chunk + (j - c0)] * x;
                        }
                    }
                }
            }
            for (unsigned int p = 1; p < parts; ++p) {
                __syncthreads();
                if (active && part == p) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (g0 + i < group) {
                            qs[(g0 + i) * hd + d] = acc[i];
                        }
                    }
                }
                __syncthreads();
                if (active && part == 0) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (g0 + i < group) {
                            acc[i] += qs[(g0 + i) * hd + d];
                        }
                    }
                }
            }
            if (active && part == 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (g0 + i < group) {
                        part_o[((first + g0 + i) * splits + split) * hd + d] = acc[i];
                    }
                }
            }
        }
    }
}

// out[(b * heads + h) * hd + d]: the partials of (b, h) merged; empty ones (max -inf) skipped
// (their outputs were never written).
template <typename T>
__device__ void graft_decode_attention_combine(
    const float* part_o, const float* part_ml, T* out, unsigned int heads, unsigned int hd,
    unsigned int splits) {
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int d = threadIdx.x;
    if (d >= hd) {
        return;
    }
    const unsigned long long bh = (unsigned long long)blockIdx.y * heads + blockIdx.x;
    float m_all = GRAFT_NEG_INF;
    float l_all = 0.0f;
    float acc = 0.0f;
    for (unsigned int s = 0; s < splits; ++s) {
        const unsigned long long p = bh * splits + s;
        const float m = part_ml[2 * p];
        if (m == GRAFT_NEG_INF) {
            continue;
        }
        const float m_new = fmaxf(m_all, m);
        const float old_scale = expf(m_all - m_new);
        const float new_scale = expf(m - m_new);
        l_all = l_all * old_scale + part_ml[2 * p + 1] * new_scale;
        acc = acc * old_scale + part_o[p * hd + d] * new_scale;
        m_all = m_new;
    }
    out[bh * hd + d] = graft_from_f32<T>(acc / l_all);
}

#define GRAFT_DECODE_ATTENTION(suffix, T)                                                    \
    extern "C" __global__ void graft_decode_attention_partial_##suffix(                      \
        const T* q, const T* k, const T* v, const unsigned int* positions,                   \
        const unsigned int* table, unsigned int max_blocks, unsigned int blocks,             \
        unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,          \
        unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,    \
        unsigned int reach, float scale) {                                                   \
        graft_decode_attention_partial<T>(q, k, v, positions, table, max_blocks, blocks,     \
                                          block_size, part_o, part_ml, heads, kv_heads,      \
                                          max_seq, hd, chunk, reach, scale);                 \
    }                                                                                        \
    extern "C" __global__ void graft_decode_attention_combine_##suffix(                      \
        const float* part_o, const float* part_ml, T* out, unsigned int heads,               \
        unsigned int hd, unsigned int splits) {                                              \
        graft_decode_attention_combine<T>(part_o, part_ml, out, heads, hd, splits);          \
    }
GRAFT_FOR_DTYPES(GRAFT_DECODE_ATTENTION)
