// The few-rows projection on tensor cores (after the prelude of nvrtc.rs), for bf16 and f16:
// 1 to 16 input rows through up to three weights side by side, or SwiGLU of a gate and an up
// weight, with matvec.cu's arguments and options but the norm (a bias per part, a sigmoid gate
// per row, a residual add; `norm` must be null), each output summed in f32 and rounded once.
//
// Each warp computes a tile of 8 outputs for every row with `mma.sync.m16n8k16`: the weight
// tile is the B operand (8 outputs x 16 k), the input rows the A operand (16 rows x 16 k).
// Lane (g, t) (g = lane / 4, t = lane % 4) loads 16
// bytes of weight row g of the tile at column 32c + 8t of chunk c, and 16 bytes of input rows
// g and g + 8 at the same columns; those 8 columns feed the lane's 4 k-slots of two mmas
// (columns 8t..8t+3 the first, 8t+4..8t+7 the second). A dot product does not depend on the
// order of its k, so the permutation, the same for both operands, needs no shuffle: every load
// is 16 bytes straight from global memory, and no weight element is converted or unpacked.
// Each row's output is computed the same way whatever the number of rows (an mma's rows do
// not interact), so a row gets the same bits at every row count the kernel takes.
//
// `split` warps share a tile, each taking a contiguous run of rounds of U chunks (32 columns
// each) of the rows; the tile's first warp adds the others' sums through shared memory in a
// fixed order and writes the outputs. A warp first asks L2 for its whole run of each weight
// row (one bulk prefetch per row on compute capability 9.0), then loads its first round; both
// come before the programmatic wait (no kernel of the step writes the weights), so they
// overlap the kernel before.

// Input row r's 16 bytes at column `col`, zero past the rows or the row's end.
template <typename T>
__device__ __forceinline__ uint4 graft_rows_x(const T* x, unsigned int r, unsigned int rows,
                                              unsigned int k, unsigned int col) {
    if (r >= rows || col >= k) {
        return make_uint4(0u, 0u, 0u, 0u);
    }
    return __ldg(reinterpret_cast<const uint4*>(x + (unsigned long long)r * k + col));
}

template <typename T, bool PAIR>
__device__ void graft_rows(const T* x, const T* w0, const T* w1, const T* w2, const T* b0,
                           const T* b1, const T* b2, const T* gate, T* y, unsigned int rows,
                           unsigned int k, unsigned int n0, unsigned int n1, unsigned int n2,
                           unsigned int bias_mask, unsigned int split, unsigned int residual) {
    // Chunks (of 32 columns) a lane loads per round: 16 bytes of one weight row each (two
    // rows with PAIR).
    const int U = PAIR ? 4 : 8;
    const int S = PAIR ? 2 : 1;
    graft_pdl_trigger();
    // Each warp's sums: [part][row][output of the tile].
    __shared__ float sums[8][S][16 * 8];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int g = lane >> 2;
    const unsigned int t = lane & 3u;
    const unsigned int tile = blockIdx.x * ((blockDim.x >> 5) / split) + warp / split;
    const unsigned int part = warp % split;
    const unsigned int n = PAIR ? n0 : n0 + n1 + n2;
    const unsigned int chunks = (k + 31u) / 32u;
    const unsigned int rounds = (chunks + U - 1) / U;
    // This warp's run of rounds: [first, last).
    const unsigned int per = (rounds + split - 1) / split;
    const unsigned int first = part * per;
    const unsigned int last = min(rounds, first + per);
    // This lane's weight row(s): output j = 8 tile + g (none past n).
    const unsigned int j = tile * 8u + g;
    const T* wa = 0;
    const T* wb = 0;
    if (j < n) {
        if (PAIR || j < n0) {
            wa = w0 + (unsigned long long)j * k;
            wb = PAIR ? w1 + (unsigned long long)j * k : 0;
        } else if (j < n0 + n1) {
            wa = w1 + (unsigned long long)(j - n0) * k;
        } else {
            wa = w2 + (unsigned long long)(j - n0 - n1) * k;
        }
    }
    // One round in registers: its weights, and rows g and g + 8 of x at the same columns, all
    // loads issued before the first mma (x comes from L2: loaded chunk by chunk, its latency
    // was paid once per chunk and the projections ran at half the bandwidth).
    uint4 w[U][S];
    uint4 xa[U];
    uint4 xb[U];
    // Round `round`'s weights of this lane, zero past the row's end (or for no row).
    auto load = [&](unsigned int round) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned int col = (round * U + u) * 32u + 8u * t;
            const bool in = wa != 0 && col < k;
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            w[u][0] = in ? __ldg(reinterpret_cast<const uint4*>(wa + col)) : zero;
            if (PAIR) {
                w[u][S - 1] = in ? __ldg(reinterpret_cast<const uint4*>(wb + col)) : zero;
            }
        }
    };
    float acc[S][4];
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[s][i] = 0.0f;
        }
    }
    // The run's weights asked of L2 and the first round's loaded before the wait: nothing the
    // step writes. Lane t = 0 of each row prefetches the row's run.
    if (first < last && wa != 0 && t == 0) {
        const unsigned int from = first * U * 32u;
        const unsigned int to = min(k, last * U * 32u);
        graft_prefetch_l2(wa + from, (to - from) * 2u);
        if (PAIR) {
            graft_prefetch_l2(wb + from, (to - from) * 2u);
        }
    }
    if (first < last) {
        load(first);
    }
    graft_pdl_wait();
    for (unsigned int round = first; round < last; ++round) {
        if (round != first) {
            load(round);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned int col = (round * U + u) * 32u + 8u * t;
            xa[u] = graft_rows_x<T>(x, g, rows, k, col);
            xb[u] = graft_rows_x<T>(x, g + 8u, rows, k, col);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                graft_mma_16816<T>(acc[s], xa[u].x, xb[u].x, xa[u].y, xb[u].y, w[u][s].x,
                                  w[u][s].y);
                graft_mma_16816<T>(acc[s], xa[u].z, xb[u].z, xa[u].w, xb[u].w, w[u][s].z,
                                  w[u][s].w);
            }
        }
    }
    // acc[s]: row g (0, 1) and row g + 8 (2, 3), outputs 2t and 2t + 1.
#pragma unroll
    for (int s = 0; s < S; ++s) {
        float* out = sums[warp][s];
        out[g * 8 + 2 * t] = acc[s][0];
        out[g * 8 + 2 * t + 1] = acc[s][1];
        out[(g + 8) * 8 + 2 * t] = acc[s][2];
        out[(g + 8) * 8 + 2 * t + 1] = acc[s][3];
    }
    __syncthreads();
    if (part != 0) {
        return;
    }
    // The tile's first warp: each (row, output) pair summed over the tile's warps in order.
    for (unsigned int at = lane; at < rows * 8u; at += 32u) {
        const unsigned int r = at >> 3;
        const unsigned int o = tile * 8u + (at & 7u);
        if (o >= n) {
            continue;
        }
        float s0 = 0.0f;
        float s1 = 0.0f;
        for (unsigned int q = 0; q < split; ++q) {
            s0 += sums[warp + q][0][at];
            if (PAIR) {
                s1 += sums[warp + q][S - 1][at];
            }
        }
        float v = s0;
        if (PAIR) {
            v = s0 / (1.0f + expf(-s0)) * s1;
        } else if (o < n0) {
            v += (bias_mask & 1u) ? graft_to_f32(b0[o]) : 0.0f;
        } else if (o < n0 + n1) {
            v += (bias_mask & 2u) ? graft_to_f32(b1[o - n0]) : 0.0f;
        } else {
            v += (bias_mask & 4u) ? graft_to_f32(b2[o - n0 - n1]) : 0.0f;
        }
        if (gate) {
            v = v / (1.0f + expf(-graft_to_f32(gate[r])));
        }
        const unsigned long long dst = (unsigned long long)r * n + o;
        if (residual) {
            v = graft_to_f32(y[dst]) + graft_to_f32(graft_from_f32<T>(v));
        }
        y[dst] = graft_from_f32<T>(v);
    }
}

#define GRAFT_ROWS_ONE(suffix, T, name, PAIR)                                                \
    extern "C" __global__ void __launch_bounds__(256, 2)                                      \
        graft_rows_##name##_##suffix(const T* x, const T* w0, const T* w1, const T* w2,      \
                                     const T* b0, const T* b1, const T* b2, const T* gate,   \
                                     const T* norm, float eps, T* y, unsigned int rows,      \
                                     unsigned int k, unsigned int n0, unsigned int n1,       \
                                     unsigned int n2, unsigned int bias_mask,                \
                                     unsigned int split, unsigned int residual) {            \
        graft_rows<T, PAIR>(x, w0, w1, w2, b0, b1, b2, gate, y, rows, k, n0, n1, n2,         \
                            bias_mask, split, residual);                                     \
    }
#define GRAFT_ROWS(suffix, T)                                                                \
    GRAFT_ROWS_ONE(suffix, T, plain, false)                                                  \
    GRAFT_ROWS_ONE(suffix, T, swiglu, true)
GRAFT_ROWS(bf16, GraftBf16)
GRAFT_ROWS(f16, GraftF16)
