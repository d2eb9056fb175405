
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

// 16-byte loads of a key stretch a thread issues before using any: a bf16 or f16 stretch of
// 32 elements (head_dim 64, two threads a row) in one round.
#define GRAFT_ATTN_U 4

// Copies 16 bytes from global memory to shared memory without waiting for them (cp.async,
// compute capability 8.0+; a plain copy before); graft_copy_wait waits for every copy the thread
// issued (a barrier then makes them visible to the block).
__device__ __forceinline__ void graft_copy16_async(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    unsigned int s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(s)
                 : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void graft_copy_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// G floats at p (16-byte aligned when G >= 4) into v.
template <int G>
__device__ __forceinline__ void graft_load_g(const float* p, float* v) {
    if (G >= 4) {
#pragma unroll
        for (int i = 0; i < G; i += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + i);
            v[i] = f.x;
            v[i + 1] = f.y;
            v[i + 2] = f.z;
            v[i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < G; ++i) {
            v[i] = p[i];
        }
    }
}

// The partial of query heads first .. first + group (first = b * heads + kvh * group) over the
// visible positions start .. end of chunk `split`, at index (head * splits + split). Position
// j of sequence b is read where graft_cache_place puts it: through the sequence's row of the
// block table (max_blocks ids of blocks of block_size positions; max_seq = max_blocks *
// block_size; a static cache's rows are one block each), or without a table in cache block b
// (then block_size = max_seq).
//
// The group's heads are taken G at a time (G a power of two up to 8; the group padded with
// zero queries to gs, a multiple of G), so that each shared-memory load of the queries or the
// scores serves 4 (G >= 4) of the multiply-adds: with one load per multiply-add, a batch-32
// step at position 1,000 was 1.34x slower (H200). A chunk costs little memory time (a few KiB of
// keys and values), so the loads are issued in as few rounds as possible: the queries and the
// chunk's block ids, then every key a thread scores (16 bytes at a time, into registers)
// together with the values of the first `stage` positions (cp.async into shared memory, used
// after the softmax).
template <typename T, int G>
__device__ void graft_decode_attention_partial(
    const T* q, const T* k, const T* v, const unsigned int* positions,
    const unsigned int* table, unsigned int max_blocks, unsigned int blocks,
    unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,
    unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,
    unsigned int reach, float scale, unsigned int stage) {
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
    const unsigned int gs = (group + G - 1u) / G * G;
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

    // [gs][hd] queries, [chunk][gs] scores, then the first cache row of each cache block the
    // chunk's visible positions are in, at the next 8-byte boundary, then `stage` value rows
    // of hd elements at the next 16-byte boundary.
    const unsigned int nb = (chunk + block_size - 1u) / block_size + 1u;
    float* qs = graft_smem;
    float* ps = graft_smem + gs * hd;
    const unsigned int words = (gs * (hd + chunk) + 1u) & ~1u;
    unsigned long long* bases = reinterpret_cast<unsigned long long*>(graft_smem + words);
    T* vs = reinterpret_cast<T*>(graft_smem + ((words + 2u * nb + 3u) & ~3u));
    const T* qg = q + first * hd;
    for (unsigned int i = threadIdx.x; i < gs * hd; i += blockDim.x) {
        qs[i] = i < group * hd ? graft_to_f32(qg[i]) : 0.0f;
    }
    // Position j is in entry j / block_size of query b's block-table row (entry 0 of a
    // static cache's: no division; a shift for a power-of-two block size); the chunk's blocks
    // are looked up once, here (a few entries: the loops below read a place per key row and
    // per value row).
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

    // `tpr` threads per key row (the block's threads over the chunk's rows, a power of two up
    // to 32), thread r of a row dotting its stretch r of hd / tpr elements with every query
    // head of the group. With 16-byte rows and caches (every cache is an allocation of its
    // own), the stretches and the value rows move 16 bytes at a time.
    unsigned int tpr = 1u;
    while (tpr < 32u && 2u * tpr * chunk <= blockDim.x) {
        tpr *= 2u;
    }
    const unsigned int E = GraftVec<T>::E;
    const unsigned int per = hd / tpr;
    const bool vec = (hd * (unsigned int)sizeof(T)) % 16u == 0u &&
                     (((unsigned long long)k | (unsigned long long)v) & 15ull) == 0ull;
    const bool vec_k = vec && hd % tpr == 0u && per % E == 0u;
    const unsigned int row_vecs = hd * (unsigned int)sizeof(T) / 16u;

    // The values of positions p0 .. p1 (at most `stage`) into vs: issued without waiting
    // with 16-byte rows, else copied element by element.
    auto copy_values = [&](unsigned int p0, unsigned int p1) {
        if (vec) {
            uint4* vs4 = reinterpret_cast<uint4*>(vs);
            for (unsigned int i = threadIdx.x; i < (p1 - p0) * row_vecs; i += blockDim.x) {
                const unsigned int r = i / row_vecs;
                const uint4* src = reinterpret_cast<const uint4*>(v + place(p0 + r) * hd);
                graft_copy16_async(vs4 + i, src + (i - r * row_vecs));
            }
        } else {
            for (unsigned int i = threadIdx.x; i < (p1 - p0) * hd; i += blockDim.x) {
                const unsigned int r = i / hd;
                vs[i] = v[place(p0 + r) * hd + (i - r * hd)];
            }
        }
    };
    copy_values(start, min(end, start + stage));

    // Scores, G query heads at a time; the row's shares are summed across its threads in a
    // fixed order (adjacent lanes of one warp: tpr divides 32).
    for (unsigned int j0 = start; j0 < end; j0 += blockDim.x / tpr) {
        const unsigned int j = j0 + threadIdx.x / tpr;
        const unsigned int d0 = threadIdx.x % tpr;
        for (unsigned int g0 = 0; g0 < gs; g0 += G) {
            float s[G];
#pragma unroll
            for (int i = 0; i < G; ++i) {
                s[i] = 0.0f;
            }
            if (j < end && vec_k) {
                const uint4* kr4 = reinterpret_cast<const uint4*>(k + place(j) * hd + d0 * per);
                const float* qd = qs + g0 * hd + d0 * per;
                // GRAFT_ATTN_U loads of 16 bytes in flight, then used: the queries 4 elements
                // a load.
                for (unsigned int e0 = 0; e0 < per; e0 += GRAFT_ATTN_U * E) {
                    uint4 raw[GRAFT_ATTN_U];
#pragma unroll
                    for (int u = 0; u < GRAFT_ATTN_U; ++u) {
                        raw[u] = e0 + u * E < per ? __ldg(kr4 + e0 / E + u)
                                                  : make_uint4(0u, 0u, 0u, 0u);
                    }
#pragma unroll
                    for (int u = 0; u < GRAFT_ATTN_U; ++u) {
                        if (e0 + u * E < per) {
                            float x[GraftVec<T>::E];
                            GraftVec<T>::unpack(raw[u], x);
#pragma unroll
                            for (unsigned int e = 0; e < E; e += 4u) {
                                const unsigned int d = e0 + u * E + e;
#pragma unroll
                                for (int i = 0; i < G; ++i) {
                                    const float4 qv =
                                        *reinterpret_cast<const float4*>(qd + i * hd + d);
                                    s[i] += qv.x * x[e] + qv.y * x[e + 1] + qv.z * x[e + 2] +
                                            qv.w * x[e + 3];
                                }
                            }
                        }
                    }
                }
            } else if (j < end) {
                const T* kr = k + place(j) * hd;
#pragma unroll 8
                for (unsigned int d = d0; d < hd; d += tpr) {
                    const float x = graft_to_f32(kr[d]);
#pragma unroll
                    for (int i = 0; i < G; ++i) {
                        s[i] += qs[(g0 + i) * hd + d] * x;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < G; ++i) {
                for (unsigned int o = 1u; o < tpr; o *= 2u) {
                    s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
                }
            }
            if (j < end && threadIdx.x % tpr == 0u) {
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    ps[(j - c0) * gs + g0 + i] = s[i] * scale;
                }
            }
        }
    }
    __syncthreads();

    // Softmax partial: one warp per query head; scores become exp(score - max).
    for (unsigned int g = warp; g < group; g += warps) {
        float m = GRAFT_NEG_INF;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            m = fmaxf(m, ps[(j - c0) * gs + g]);
        }
        m = graft_warp_max(m);
        float l = 0.0f;
        for (unsigned int j = start + lane; j < end; j += 32u) {
            const float e = expf(ps[(j - c0) * gs + g] - m);
            ps[(j - c0) * gs + g] = e;
            l += e;
        }
        l = graft_warp_sum(l);
        if (lane == 0) {
            const unsigned long long p = (first + g) * splits + split;
            part_ml[2 * p] = m;
            part_ml[2 * p + 1] = l;
        }
    }

    // Values, G query heads at a time, `stage` positions at a time from shared memory: thread
    // t = part * hd + d sums head-dim element d over positions p0 + part, p0 + part + parts,
    // ... (the stage's rows; a position's G scores in one load), where `parts` threads share
    // an element when the block has them to spare; the parts' sums are then added in part
    // order through shared memory (the queries' slot, free after the scores). Every thread
    // reaches every barrier: with parts > 1 the t0 loop runs once.
    const unsigned int parts = blockDim.x >= 2u * hd ? blockDim.x / hd : 1u;
    unsigned int held = start;  // the first position the stage holds
    for (unsigned int g0 = 0; g0 < gs; g0 += G) {
        for (unsigned int t0 = 0; t0 < hd * parts; t0 += blockDim.x) {
            const unsigned int t = t0 + threadIdx.x;
            const bool active = t < hd * parts;
            const unsigned int d = t % hd;
            const unsigned int part = t / hd;
            float acc[G];
#pragma unroll
            for (int i = 0; i < G; ++i) {
                acc[i] = 0.0f;
            }
            for (unsigned int p0 = start; p0 < end; p0 += stage) {
                const unsigned int p1 = min(end, p0 + stage);
                if (p0 != held) {
                    // The stage holds other positions: copy these in.
                    __syncthreads();
                    copy_values(p0, p1);
                    held = p0;
                }
                graft_copy_wait();
                __syncthreads();
                if (active) {
#pragma unroll 4
                    for (unsigned int j = p0 + part; j < p1; j += parts) {
                        const float x = graft_to_f32(vs[(j - p0) * hd + d]);
                        float pv[G];
                        graft_load_g<G>(ps + (j - c0) * gs + g0, pv);
#pragma unroll
                        for (int i = 0; i < G; ++i) {
                            acc[i] += pv[i] * x;
                        }
                    }
                }
            }
            for (unsigned int p = 1; p < parts; ++p) {
                __syncthreads();
                if (active && part == p) {
#pragma unroll
                    for (int i = 0; i < G; ++i) {
                        qs[i * hd + d] = acc[i];
                    }
                }
                __syncthreads();
                if (active && part == 0) {
#pragma unroll
                    for (int i = 0; i < G; ++i) {
                        acc[i] += qs[i * hd + d];
                    }
                }
            }
            if (active && part == 0) {
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    if (g0 + i < group) {
                        part_o[((first + g0 + i) * splits + split) * hd + d] = acc[i];
                    }
                }
            }
        }
    }
}

// out[(b * heads + h) * hd + d]: the partials of (b, h) merged, each weighted by exp(its max -
// the largest max); empty ones (max -inf) left out by a select (their outputs, never written,
// are loaded but not used). The partials' maxes are loaded by the block's threads side by
// side and reduced, and no load depends on a partial's max, so none waits for the one before
// (merged online, split by split, a 1,024-position row's 16 splits cost 16 load latencies).
template <typename T>
__device__ void graft_decode_attention_combine(
    const float* part_o, const float* part_ml, T* out, unsigned int heads, unsigned int hd,
    unsigned int splits) {
    graft_pdl_trigger();
    graft_pdl_wait();
    __shared__ float scratch[32];
    const unsigned int d = threadIdx.x;
    const unsigned long long bh = (unsigned long long)blockIdx.y * heads + blockIdx.x;
    const float* ml = part_ml + 2ull * bh * splits;
    float m_all = GRAFT_NEG_INF;
    for (unsigned int s = d; s < splits; s += blockDim.x) {
        m_all = fmaxf(m_all, ml[2 * s]);
    }
    m_all = graft_block_max(m_all, scratch);
    if (d >= hd) {
        return;
    }
    float l_all = 0.0f;
    float acc = 0.0f;
    const float* o = part_o + bh * splits * hd + d;
#pragma unroll 8
    for (unsigned int s = 0; s < splits; ++s) {
        const float m = ml[2 * s];
        const float l = ml[2 * s + 1];
        const float x = o[(unsigned long long)s * hd];
        const bool empty = m == GRAFT_NEG_INF;
        const float w = empty ? 0.0f : expf(m - m_all);
        l_all += empty ? 0.0f : l * w;
        acc += empty ? 0.0f : x * w;
    }
    out[bh * hd + d] = graft_from_f32<T>(acc / l_all);
}

#define GRAFT_DECODE_ATTENTION_G(suffix, T, G)                                              \
    extern "C" __global__ void graft_decode_attention_partial_g##G##_##suffix(               \
        const T* q, const T* k, const T* v, const unsigned int* positions,                   \
        const unsigned int* table, unsigned int max_blocks, unsigned int blocks,             \
        unsigned int block_size, float* part_o, float* part_ml, unsigned int heads,          \
        unsigned int kv_heads, unsigned int max_seq, unsigned int hd, unsigned int chunk,    \
        unsigned int reach, float scale, unsigned int stage) {                               \
        graft_decode_attention_partial<T, G>(q, k, v, positions, table, max_blocks, blocks,  \
                                             block_size, part_o, part_ml, heads, kv_heads,   \
                                             max_seq, hd, chunk, reach, scale, stage);       \
    }
#define GRAFT_DECODE_ATTENTION(suffix, T)                                                    \
    GRAFT_DECODE_ATTENTION_G(suffix, T, 1)                                                   \
    GRAFT_DECODE_ATTENTION_G(suffix, T, 2)                                                   \
    GRAFT_DECODE_ATTENTION_G(suffix, T, 4)                                                   \
    GRAFT_DECODE_ATTENTION_G(suffix, T, 8)                                                   \
    extern "C" __global__ void graft_decode_attention_combine_##suffix(                      \
        const float* part_o, const float* part_ml, T* out, unsigned int heads,               \
        unsigned int hd, unsigned int splits) {                                              \
        graft_decode_attention_combine<T>(part_o, part_ml, out, heads, hd, splits);          \
    }
GRAFT_FOR_DTYPES(GRAFT_DECODE_ATTENTION)
