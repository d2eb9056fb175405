// The per-row sampling kernel (after the prelude of nvrtc.rs and graft-philox's generator):
// one block of 1,024 threads per row, which reads its row's parameters from the params tensor
// and leaves one token. The semantics are the host's (sample.rs); everything the token depends
// on is computed in integers or in IEEE operations that are never fused (__fmul_rn and friends),
// so the CPU implementation finds the same weights bit for bit and, the sums being integers,
// the same token.
//
// 1. The first largest logit (argmax_last's loop and reduction). A greedy row stops here.
// 2. No top-k or top-p cut: the draw over the row (graft_draw_row: one pass summing each
//    warp's contiguous chunk, then a pass over the chosen chunk split into 1,024 pieces).
// 3. A cut: one pass counts the candidates (x = (l - max) * log2(e) / T >= -40, the only tokens
//    of nonzero weight) in 512 bins of x. When the tokens that decide the cut fit in shared
//    memory (4,096), a second pass copies their keys and indices there, and the thresholds and
//    the draw are radix selections over them (graft_select); otherwise the same selections run
//    over the row itself, each 8-bit digit a pass.

#define GRAFT_SAMPLE_CAP 4096u
#define GRAFT_SAMPLE_BINS 512u
// Bins per unit of x (so x in [-40, 0] fills bins 0 to 480).
#define GRAFT_SAMPLE_BIN_SCALE 12.0f
// Weights are fixed point: 1 (the largest logit's weight) is 2^40.
#define GRAFT_SAMPLE_ONE 1099511627776.0f
#define GRAFT_SAMPLE_NONE 0xffffffffu

enum { GRAFT_BY_COUNT = 0, GRAFT_BY_MASS = 1, GRAFT_BY_INDEX = 2 };

struct GraftSampleShared {
    unsigned long long hist[256];
    unsigned long long sums[32];
    unsigned int bins[GRAFT_SAMPLE_BINS];
    unsigned int keys[GRAFT_SAMPLE_CAP];
    unsigned int idxs[GRAFT_SAMPLE_CAP];
    unsigned int count;
    unsigned int word[4];
    unsigned long long wide[2];
    float value;
};

// The order-preserving u32 image of a non-NaN float (-0 as +0), and back.
__device__ __forceinline__ unsigned int graft_key(float v) {
    unsigned int b = __float_as_uint(v);
    if (b == 0x80000000u) {
        b = 0u;
    }
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float graft_key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// 2^x for x in [-40, 0], 0 below (and for NaN): Cephes' exp2f polynomial on the fraction, each
// operation rounded on its own (never fused), as the host's `exp2_neg`.
__device__ __forceinline__ float graft_exp2_neg(float x) {
    if (!(x >= -40.0f)) {
        return 0.0f;
    }
    const float i = floorf(__fadd_rn(x, 0.5f));
    const float f = __fsub_rn(x, i);
    float p = __uint_as_float(0x3920fddeu);
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3aaf9f29u));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3c1d96a6u));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3d635774u));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3e75fdeeu));
    p = __fadd_rn(__fmul_rn(p, f), __uint_as_float(0x3f317218u));
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    return __fmul_rn(p, __int_as_float((127 + (int)i) << 23));
}

// x of a non-NaN logit: 0 for the largest, (l - max) * scale below it (-inf far below).
__device__ __forceinline__ float graft_sample_x(float l, float m, float scale) {
    return l == m ? 0.0f : __fmul_rn(__fsub_rn(l, m), scale);
}

// A non-NaN logit's fixed-point weight: floor(2^x * 2^40).
__device__ __forceinline__ unsigned long long graft_weight(float l, float m, float scale) {
    if (l == m) {
        return 1ull << 40;
    }
    const float w = graft_exp2_neg(graft_sample_x(l, m, scale));
    return (unsigned long long)__fmul_rn(w, GRAFT_SAMPLE_ONE);
}

// The smallest weight that top-p's kept set must reach: ceil(p * mass), at least 1, at most
// the mass (in f64, as the host).
__device__ __forceinline__ unsigned long long graft_need(float p, unsigned long long mass) {
    const double want = ceil(__dmul_rn((double)p, (double)mass));
    if (!(want >= 1.0)) {
        return 1ull;
    }
    const unsigned long long need = (unsigned long long)want;
    return need < mass ? need : mass;
}

// floor(mass * u24 / 2^24), exactly (below the mass when it is not 0).
__device__ __forceinline__ unsigned long long graft_scale(unsigned long long mass,
                                                          unsigned int u24) {
    return (mass >> 24) * u24 + (((mass & 0xffffffull) * u24) >> 24);
}

__device__ __forceinline__ unsigned long long graft_warp_sum_u64(unsigned long long v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The sum of v over the block, to every thread (`scratch`: 32 words of shared memory).
__device__ unsigned long long graft_block_sum_u64(unsigned long long v,
                                                  unsigned long long* scratch) {
    v = graft_warp_sum_u64(v);
    const unsigned int lane = threadIdx.x & 31u;
    __syncthreads();
    if (lane == 0) {
        scratch[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    return graft_warp_sum_u64(lane < (blockDim.x >> 5) ? scratch[lane] : 0ull);
}

// The sum of v over the threads before this one.
__device__ unsigned long long graft_block_exclusive_u64(unsigned long long v,
                                                        unsigned long long* scratch) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    unsigned long long inclusive = v;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= (unsigned int)offset) {
            inclusive += t;
        }
    }
    __syncthreads();
    if (lane == 31u) {
        scratch[warp] = inclusive;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned long long total = lane < (blockDim.x >> 5) ? scratch[lane] : 0ull;
        unsigned long long before = total;
        for (int offset = 1; offset < 32; offset <<= 1) {
            const unsigned long long t = __shfl_up_sync(0xffffffffu, before, offset);
            if (lane >= (unsigned int)offset) {
                before += t;
            }
        }
        scratch[lane] = before - total;
    }
    __syncthreads();
    return scratch[warp] + inclusive - v;
}

// A row of logits as the selections' source: element i is logit i (NaN: none).
template <typename T> struct GraftRowSource {
    const T* row;
    unsigned int n;
    __device__ unsigned int count() const { return n; }
    __device__ bool get(unsigned int i, unsigned int& key, unsigned int& index) const {
        const float v = graft_to_f32(row[i]);
        if (v != v) {
            return false;
        }
        key = graft_key(v);
        index = i;
        return true;
    }
};

// The candidates copied into shared memory, in no particular order.
struct GraftCandidateSource {
    const unsigned int* keys;
    const unsigned int* idxs;
    unsigned int n;
    __device__ unsigned int count() const { return n; }
    __device__ bool get(unsigned int i, unsigned int& key, unsigned int& index) const {
        key = keys[i];
        index = idxs[i];
        return true;
    }
};

// The total weight of the source's elements with key >= floor.
template <typename Src>
__device__ unsigned long long graft_mass(const Src& src, unsigned int floor, float m,
                                         float scale, GraftSampleShared& sh) {
    unsigned long long acc = 0ull;
    for (unsigned int i = threadIdx.x; i < src.count(); i += blockDim.x) {
        unsigned int key, index;
        if (src.get(i, key, index) && key >= floor) {
            acc += graft_weight(graft_key_value(key), m, scale);
        }
    }
    return graft_block_sum_u64(acc, sh.sums);
}

// The largest value v such that the elements with key >= floor and value >= v weigh at least
// `need` (>= 1; the caller knows that all of them together do). BY_COUNT: value the key,
// weight 1; BY_MASS: value the key, weight the element's; BY_INDEX: value 0xffffff - index
// (so v is the first index at which the running weight reaches `need`), weight the element's.
// A radix descent, 8 bits a pass over the source, each pass a histogram of integer sums in
// shared memory (the same whatever order the threads add in).
template <typename Src>
__device__ unsigned int graft_select(const Src& src, int mode, unsigned int floor,
                                     unsigned long long need, float m, float scale,
                                     GraftSampleShared& sh) {
    unsigned int prefix = 0u;
    unsigned int mask = 0u;
    unsigned long long above = 0ull;
    for (int shift = mode == GRAFT_BY_INDEX ? 16 : 24; shift >= 0; shift -= 8) {
        for (unsigned int b = threadIdx.x; b < 256u; b += blockDim.x) {
            sh.hist[b] = 0ull;
        }
        __syncthreads();
        // Runs of one digit are added at once (rows of equal logits would otherwise queue on
        // one counter).
        unsigned int run = 0u;
        unsigned long long acc = 0ull;
        for (unsigned int i = threadIdx.x; i < src.count(); i += blockDim.x) {
            unsigned int key, index;
            if (!src.get(i, key, index) || key < floor) {
                continue;
            }
            const unsigned int value = mode == GRAFT_BY_INDEX ? 0xffffffu - index : key;
            if ((value & mask) != prefix) {
                continue;
            }
            const unsigned int digit = (value >> shift) & 255u;
            if (digit != run) {
                if (acc != 0ull) {
                    atomicAdd(&sh.hist[run], acc);
                }
                run = digit;
                acc = 0ull;
            }
            acc += mode == GRAFT_BY_COUNT ? 1ull : graft_weight(graft_key_value(key), m, scale);
        }
        if (acc != 0ull) {
            atomicAdd(&sh.hist[run], acc);
        }
        __syncthreads();
        if (threadIdx.x < 32u) {
            // Lane l holds digits 8l .. 8l + 7; the largest digit d whose weight from d up
            // (with `above`) reaches `need` is in the highest lane that finds one.
            const unsigned int lane = threadIdx.x;
            const unsigned long long* mine = sh.hist + lane * 8u;
            unsigned long long sum = 0ull;
            for (int j = 0; j < 8; ++j) {
                sum += mine[j];
            }
            unsigned long long from = sum;
            for (int offset = 1; offset < 32; offset <<= 1) {
                const unsigned long long t = __shfl_down_sync(0xffffffffu, from, offset);
                if (lane + offset < 32u) {
                    from += t;
                }
            }
            unsigned long long at = above + (from - sum);
            unsigned long long before = at;
            int found = -1;
            for (int j = 7; j >= 0 && found < 0; --j) {
                before = at;
                at += mine[j];
                if (at >= need) {
                    found = j;
                }
            }
            const unsigned int lanes = __ballot_sync(0xffffffffu, found >= 0);
            // None (never, by the caller's bound): digit 0, so the result stays in range.
            const unsigned int winner = lanes != 0u ? 31u - __clz(lanes) : 0u;
            if (lane == winner) {
                sh.word[0] = lanes != 0u ? lane * 8u + (unsigned int)found : 0u;
                sh.wide[0] = lanes != 0u ? before : above;
            }
        }
        __syncthreads();
        prefix |= sh.word[0] << shift;
        mask |= 255u << shift;
        above = sh.wide[0];
    }
    return prefix;
}

// The draw over the row: the first index at which the running weight of the logits with key
// >= floor exceeds floor(u24 / 2^24 of their total); `n` if they weigh nothing. Warp w sums
// the w-th of the block's (32) contiguous chunks (its lanes strided, loads coalesced); the chunk holding the
// target is split into contiguous pieces, one a thread, and the thread whose piece holds it
// walks it.
template <typename T>
__device__ unsigned int graft_draw_row(const GraftRowSource<T>& src, unsigned int floor,
                                       unsigned int u24, float m, float scale,
                                       GraftSampleShared& sh) {
    const unsigned int n = src.n;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = blockDim.x >> 5;
    const unsigned int chunk = (n + warps - 1u) / warps;
    unsigned long long acc = 0ull;
    {
        const unsigned int start = min(n, warp * chunk);
        const unsigned int end = min(n, start + chunk);
        for (unsigned int i = start + lane; i < end; i += 32u) {
            unsigned int key, index;
            if (src.get(i, key, index) && key >= floor) {
                acc += graft_weight(graft_key_value(key), m, scale);
            }
        }
    }
    acc = graft_warp_sum_u64(acc);
    __syncthreads();
    if (lane == 0u) {
        sh.sums[warp] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0u) {
        // One thread, in loops kept rolled (unrolled, the 32 running sums spilled).
        unsigned long long total = 0ull;
#pragma unroll 1
        for (unsigned int w = 0; w < warps; ++w) {
            total += sh.sums[w];
        }
        const unsigned long long target = graft_scale(total, u24);
        unsigned long long before = 0ull;
        unsigned int w = 0u;
#pragma unroll 1
        while (w < warps && before + sh.sums[w] <= target) {
            before += sh.sums[w];
            ++w;
        }
        sh.word[0] = w;
        sh.wide[0] = target - before;
        sh.word[1] = n;
    }
    __syncthreads();
    const unsigned int w = sh.word[0];
    const unsigned long long rest = sh.wide[0];
    if (w >= warps) {
        return n;
    }
    const unsigned int start = min(n, w * chunk);
    const unsigned int end = min(n, start + chunk);
    const unsigned int piece = (end - start + blockDim.x - 1u) / blockDim.x;
    const unsigned int from = min(end, start + threadIdx.x * piece);
    const unsigned int to = min(end, from + piece);
    unsigned long long mine = 0ull;
    for (unsigned int i = from; i < to; ++i) {
        unsigned int key, index;
        if (src.get(i, key, index) && key >= floor) {
            mine += graft_weight(graft_key_value(key), m, scale);
        }
    }
    const unsigned long long before = graft_block_exclusive_u64(mine, sh.sums);
    if (before <= rest && rest - before < mine) {
        unsigned long long run = before;
        for (unsigned int i = from; i < to; ++i) {
            unsigned int key, index;
            if (src.get(i, key, index) && key >= floor) {
                run += graft_weight(graft_key_value(key), m, scale);
                if (run > rest) {
                    sh.word[1] = i;
                    break;
                }
            }
        }
    }
    __syncthreads();
    return sh.word[1];
}

// The cuts over a source: the smallest key kept (top-k's threshold, then top-p's among what
// top-k keeps), or false when `check_held` and the source (the candidates in shared memory,
// without top-k) does not reach top-p's share of `all_mass`, all the candidates' weight.
template <typename Src>
__device__ bool graft_cuts(const Src& src, bool cut_k, unsigned int top_k, bool cut_p,
                           float top_p, unsigned long long all_mass, bool check_held, float m,
                           float scale, GraftSampleShared& sh, unsigned int& floor) {
    floor = 0u;
    if (cut_k) {
        floor = graft_select(src, GRAFT_BY_COUNT, 0u, top_k, m, scale, sh);
    }
    if (cut_p) {
        const unsigned long long kept = cut_k ? graft_mass(src, floor, m, scale, sh) : all_mass;
        const unsigned long long need = graft_need(top_p, kept);
        if (check_held && graft_mass(src, 0u, m, scale, sh) < need) {
            return false;
        }
        floor = graft_select(src, GRAFT_BY_MASS, floor, need, m, scale, sh);
    }
    return true;
}

template <typename T>
__device__ void graft_sample(const T* logits, const unsigned int* params, unsigned int* out,
                             unsigned int n) {
    __shared__ GraftSampleShared sh;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const T* row = logits + (unsigned long long)blockIdx.x * n;
    const unsigned int* words = params + (unsigned long long)blockIdx.x * 6u;
    const float temperature = __uint_as_float(words[0]);
    const float top_p = __uint_as_float(words[1]);
    const unsigned int top_k = words[2];

    // 1. The first largest logit: argmax_last's loop and reduction (checking the parameters
    // only after it, so that their load overlaps the row's).
    float v = GRAFT_NEG_INF;
    unsigned int best = 0xffffffffu;
    for (unsigned int c = threadIdx.x; c < n; c += blockDim.x) {
        const float f = graft_to_f32(row[c]);
        if (f > v || (f == v && c < best)) {
            v = f;
            best = c;
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, offset);
        const unsigned int j = __shfl_xor_sync(0xffffffffu, best, offset);
        if (w > v || (w == v && j < best)) {
            v = w;
            best = j;
        }
    }
    if (lane == 0u) {
        sh.hist[warp] = ((unsigned long long)__float_as_uint(v) << 32) | best;
    }
    __syncthreads();
    // A NaN or infinite temperature or a NaN top-p: the invalid token.
    const bool invalid =
        !(fabsf(temperature) <= __uint_as_float(0x7f7fffffu)) || top_p != top_p;
    if (warp == 0u) {
        const bool has = lane < (blockDim.x >> 5);
        const unsigned long long packed = has ? sh.hist[lane] : 0ull;
        v = has ? __uint_as_float((unsigned int)(packed >> 32)) : GRAFT_NEG_INF;
        best = has ? (unsigned int)packed : 0xffffffffu;
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float w = __shfl_xor_sync(0xffffffffu, v, offset);
            const unsigned int j = __shfl_xor_sync(0xffffffffu, best, offset);
            if (w > v || (w == v && j < best)) {
                v = w;
                best = j;
            }
        }
        if (lane == 0u) {
            sh.value = v;
            sh.word[2] = best;
            if (invalid) {
                out[blockIdx.x] = GRAFT_SAMPLE_NONE;
            } else if (!(temperature > 0.0f)) {
                // Greedy (a row of NaN only: index 0).
                out[blockIdx.x] = best < n ? best : 0u;
            }
        }
    }
    if (invalid || !(temperature > 0.0f)) {
        return;
    }
    __syncthreads();
    const float m = sh.value;
    best = sh.word[2];
    if (best >= n) {
        // Nothing but NaN: index 0, as greedy.
        if (threadIdx.x == 0u) {
            out[blockIdx.x] = 0u;
        }
        return;
    }
    const float scale = __fdiv_rn(__uint_as_float(0x3fb8aa3bu), temperature);
    unsigned int counter[4] = {words[5], 0u, 0u, 0u};
    graft_philox4x32_10(counter, words[3], words[4]);
    const unsigned int u24 = counter[0] >> 8;
    const GraftRowSource<T> source = {row, n};
    const bool cut_p = top_p < 1.0f;
    bool cut_k = top_k != 0u && top_k < n;
    unsigned int token;
    if (!cut_k && !cut_p) {
        // 2. Every token kept.
        token = graft_draw_row(source, 0u, u24, m, scale, sh);
    } else {
        // 3. The candidates per bin of x (and their total weight, for top-p).
        for (unsigned int b = threadIdx.x; b < GRAFT_SAMPLE_BINS; b += blockDim.x) {
            sh.bins[b] = 0u;
        }
        if (threadIdx.x == 0u) {
            sh.count = 0u;
        }
        __syncthreads();
        unsigned long long mass = 0ull;
        unsigned int run = 0u;
        unsigned int tally = 0u;
        for (unsigned int c = threadIdx.x; c < n; c += blockDim.x) {
            const float f = graft_to_f32(row[c]);
            const float x = graft_sample_x(f, m, scale);
            if (!(x >= -40.0f)) {
                continue;
            }
            const unsigned int bin = (unsigned int)__fmul_rn(-x, GRAFT_SAMPLE_BIN_SCALE);
            if (bin != run) {
                if (tally != 0u) {
                    atomicAdd(&sh.bins[run], tally);
                }
                run = bin;
                tally = 0u;
            }
            ++tally;
            if (cut_p) {
                mass += graft_weight(f, m, scale);
            }
        }
        if (tally != 0u) {
            atomicAdd(&sh.bins[run], tally);
        }
        mass = graft_block_sum_u64(mass, sh.sums);
        // Warp 0 finds the last bin to copy: top-k's bin (where the count reaches k), or
        // without top-k the last bin that fits.
        if (warp == 0u) {
            unsigned int sum = 0u;
            for (unsigned int j = 0; j < 16u; ++j) {
                sum += sh.bins[lane * 16u + j];
            }
            unsigned int upto = sum;
            for (int offset = 1; offset < 32; offset <<= 1) {
                const unsigned int t = __shfl_up_sync(0xffffffffu, upto, offset);
                if (lane >= (unsigned int)offset) {
                    upto += t;
                }
            }
            const unsigned int total = __shfl_sync(0xffffffffu, upto, 31);
            const bool by_k = cut_k && total >= top_k;
            unsigned int at = upto - sum;
            unsigned int last = GRAFT_SAMPLE_NONE;
            unsigned int held = 0u;
            for (unsigned int j = 0; j < 16u; ++j) {
                const unsigned int before = at;
                at += sh.bins[lane * 16u + j];
                if (by_k ? before < top_k && at >= top_k : at <= GRAFT_SAMPLE_CAP) {
                    last = lane * 16u + j;
                    held = at;
                }
            }
            const unsigned int lanes = __ballot_sync(0xffffffffu, last != GRAFT_SAMPLE_NONE);
            if (lane == 0u) {
                sh.word[0] = by_k;
                sh.word[1] = GRAFT_SAMPLE_NONE;
            }
            __syncwarp();
            if (lanes != 0u && lane == 31u - __clz(lanes) && held <= GRAFT_SAMPLE_CAP) {
                sh.word[1] = last;
            }
        }
        __syncthreads();
        cut_k = sh.word[0] != 0u;
        const unsigned int last = sh.word[1];
        token = GRAFT_SAMPLE_NONE;
        if (!cut_k && !cut_p) {
            // Fewer candidates than top-k and no top-p: every token kept.
            token = graft_draw_row(source, 0u, u24, m, scale, sh);
        } else if (last != GRAFT_SAMPLE_NONE) {
            // The candidates of bins 0 ..= last into shared memory, then the cuts there.
            for (unsigned int base = 0; base < n; base += blockDim.x) {
                const unsigned int c = base + threadIdx.x;
                bool take = false;
                float f = 0.0f;
                if (c < n) {
                    f = graft_to_f32(row[c]);
                    const float x = graft_sample_x(f, m, scale);
                    take = x >= -40.0f &&
                           (unsigned int)__fmul_rn(-x, GRAFT_SAMPLE_BIN_SCALE) <= last;
                }
                const unsigned int takers = __ballot_sync(0xffffffffu, take);
                if (takers == 0u) {
                    continue;
                }
                unsigned int slot = 0u;
                if (lane == 0u) {
                    slot = atomicAdd(&sh.count, (unsigned int)__popc(takers));
                }
                slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(takers & ((1u << lane) - 1u));
                if (take && slot < GRAFT_SAMPLE_CAP) {
                    sh.keys[slot] = graft_key(f);
                    sh.idxs[slot] = c;
                }
            }
            __syncthreads();
            const GraftCandidateSource held = {sh.keys, sh.idxs, min(sh.count, GRAFT_SAMPLE_CAP)};
            unsigned int floor;
            if (graft_cuts(held, cut_k, top_k, cut_p, top_p, mass, !cut_k, m, scale, sh, floor)) {
                // The draw: the first index where the running weight exceeds the target.
                const unsigned long long target =
                    graft_scale(graft_mass(held, floor, m, scale, sh), u24);
                token = 0xffffffu - graft_select(held, GRAFT_BY_INDEX, floor, target + 1ull, m,
                                                 scale, sh);
            }
        }
        if (token == GRAFT_SAMPLE_NONE) {
            // Too many candidates for shared memory: the same cuts over the row.
            unsigned int floor;
            graft_cuts(source, cut_k, top_k, cut_p, top_p, mass, false, m, scale, sh, floor);
            token = graft_draw_row(source, floor, u24, m, scale, sh);
        }
    }
    if (threadIdx.x == 0u) {
        out[blockIdx.x] = token < n ? token : best;
    }
}

#define GRAFT_SAMPLE(suffix, T)                                                              \
    extern "C" __global__ void __launch_bounds__(1024, 1)                                       \
        graft_sample_##suffix(const T* logits, const unsigned int* params,                   \
                              unsigned int* out, unsigned int n) {                           \
        graft_sample<T>(logits, params, out, n);                                             \
    }
GRAFT_FOR_DTYPES(GRAFT_SAMPLE)
