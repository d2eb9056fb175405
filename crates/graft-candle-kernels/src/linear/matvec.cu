// The matrix-vector kernel (after the prelude of nvrtc.rs). Output j of row r:
// x[r] . (row j of the weights side by side) + its bias; with PAIR, silu(x[r] . gate[j]) *
// (x[r] . up[j]) (gate = w0, up = w1). `split` warps per j (a block's 8 warps serve
// 8 / split outputs), each summing every split-th 32-chunk stretch of the row; the first warp
// of each output adds the others' sums from shared memory. ROWS >= rows.
//
// As a decode stage it also takes `norm` (non-null: x is RMS-normed first, in the same pass:
// the weight rows are scaled by the norm's weight as they are loaded, the warps of an output
// sum the row's squares beside its dot product, and the sum is scaled by 1 / rms at the end;
// the normed x is never rounded to T) and `residual` (1: the output is added to
// what y holds, rounded once before the add and once after, as a residual add of the rounded
// projection). Launched as a programmatic dependent, it lets its dependents start at once,
// asks L2 for each output's whole weight row(s) (static: no kernel of the step writes them;
// with 16-byte loads only) and then waits for its predecessor before it reads x or y.

// 16-byte chunks of a weight row each lane loads before using any.
#define GRAFT_MATVEC_U 4


// The round of chunks starting at `base` of the weight row(s), zero past the row's end.
template <typename T, bool PAIR>
__device__ __forceinline__ void graft_matvec_load(const uint4* wa4, const uint4* wb4,
                                                  unsigned int base, unsigned int stride,
                                                  unsigned int chunks, uint4* raw0,
                                                  uint4* raw1) {
#pragma unroll
    for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
        const unsigned int c = base + stride * u;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        raw0[u] = c < chunks ? __ldg(wa4 + c) : zero;
        raw1[u] = PAIR && c < chunks ? __ldg(wb4 + c) : zero;
    }
}

template <typename T, int ROWS, bool VEC, bool PAIR, bool NORM>
__device__ void graft_matvec(const T* x, const T* w0, const T* w1, const T* w2,
                             const T* b0, const T* b1, const T* b2, const T* gate,
                             const T* norm, float eps, T* y, unsigned int rows,
                             unsigned int k, unsigned int n0, unsigned int n1, unsigned int n2,
                             unsigned int bias_mask, unsigned int split,
                             unsigned int residual) {
    graft_pdl_trigger();
    __shared__ float partial[8][3 * ROWS];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int j = blockIdx.x * ((blockDim.x >> 5) / split) + warp / split;
    const unsigned int part = warp % split;
    const unsigned int n = PAIR ? n0 : n0 + n1 + n2;
    const bool active = j < n;
    // The weight row (and bias) of output j: uniform over the warp.
    const T* wa = w0;
    const T* bias = 0;
    if (!active) {
    } else if (PAIR || j < n0) {
        wa = w0 + (unsigned long long)j * k;
        bias = (bias_mask & 1u) ? b0 + j : 0;
    } else if (j < n0 + n1) {
        wa = w1 + (unsigned long long)(j - n0) * k;
        bias = (bias_mask & 2u) ? b1 + (j - n0) : 0;
    } else {
        wa = w2 + (unsigned long long)(j - n0 - n1) * k;
        bias = (bias_mask & 4u) ? b2 + (j - n0 - n1) : 0;
    }
    const T* wb = PAIR && active ? w1 + (unsigned long long)j * k : wa;
    const unsigned int E = GraftVec<T>::E;
    const unsigned int chunks = VEC ? k / E : 0u;
    const unsigned int stride = 32u * split;
    const unsigned int first = 32u * part + lane;
    const uint4* wa4 = reinterpret_cast<const uint4*>(wa);
    const uint4* wb4 = reinterpret_cast<const uint4*>(wb);
    // Before the wait: the output's whole weight row(s) asked of L2 by its first warp's first
    // lane, one bulk prefetch each (nothing the step writes), so that the rows stream in
    // while the kernel before still runs; after the wait the loads find them in L2.
    if (VEC && active && part == 0 && lane == 0) {
        const unsigned int bytes = k * (unsigned int)sizeof(T);
        graft_prefetch_l2(wa, bytes);
        if (PAIR) {
            graft_prefetch_l2(wb, bytes);
        }
    }
    graft_pdl_wait();
    float a0[ROWS];
    float a1[ROWS];
    // With a norm: each row's sum of squares, over the stretches this warp covers.
    float sq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        a0[r] = 0.0f;
        a1[r] = 0.0f;
        sq[r] = 0.0f;
    }
    if (!active) {
    } else if (VEC) {
        // GRAFT_MATVEC_U 16-byte chunks of the row per lane in flight: all loads of a round
        // are issued before any is used, then each chunk is unpacked in turn (so few floats
        // are live at once) and used for every input row.
        const uint4* g4 = reinterpret_cast<const uint4*>(norm);
        for (unsigned int base = first; base < chunks; base += stride * GRAFT_MATVEC_U) {
            uint4 raw0[GRAFT_MATVEC_U];
            uint4 raw1[GRAFT_MATVEC_U];
            graft_matvec_load<T, PAIR>(wa4, wb4, base, stride, chunks, raw0, raw1);
            // The round's x, every row's, loaded beside the weights: loaded chunk by chunk
            // inside the loop below, each L2 latency was paid in turn.
            uint4 xv[ROWS][GRAFT_MATVEC_U];
#pragma unroll
            for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
                const unsigned int c = base + stride * u;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const uint4* xr =
                        reinterpret_cast<const uint4*>(x + (unsigned long long)r * k);
                    xv[r][u] = c < chunks && r < rows ? __ldg(xr + c)
                                                      : make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < GRAFT_MATVEC_U; ++u) {
                const unsigned int c = base + stride * u;
                if (c >= chunks) {
                    continue;
                }
                float w0[GraftVec<T>::E];
                float w1[GraftVec<T>::E];
                GraftVec<T>::unpack(raw0[u], w0);
                if (PAIR) {
                    GraftVec<T>::unpack(raw1[u], w1);
                }
                if (NORM) {
                    // The norm's weight folded into the projection's: g_i * w_ji.
                    float fg[GraftVec<T>::E];
                    GraftVec<T>::unpack(__ldg(g4 + c), fg);
#pragma unroll
                    for (unsigned int e = 0; e < E; ++e) {
                        w0[e] *= fg[e];
                        if (PAIR) {
                            w1[e] *= fg[e];
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        float fx[GraftVec<T>::E];
                        GraftVec<T>::unpack(xv[r][u], fx);
#pragma unroll
                        for (unsigned int e = 0; e < E; ++e) {
                            if (NORM) {
                                sq[r] += fx[e] * fx[e];
                            }
                            a0[r] += fx[e] * w0[e];
                            if (PAIR) {
                                a1[r] += fx[e] * w1[e];
                            }
                        }
                    }
                }
            }
        }
    } else {
        for (unsigned int i = first; i < k; i += stride) {
            const float g = NORM ? graft_to_f32(norm[i]) : 1.0f;
            const float f0 = graft_to_f32(wa[i]) * g;
            const float f1 = PAIR ? graft_to_f32(wb[i]) * g : 0.0f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rows) {
                    const float fx = graft_to_f32(x[(unsigned long long)r * k + i]);
                    if (NORM) {
                        sq[r] += fx * fx;
                    }
                    a0[r] += fx * f0;
                    if (PAIR) {
                        a1[r] += fx * f1;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float s0 = graft_warp_sum(a0[r]);
        const float s1 = PAIR ? graft_warp_sum(a1[r]) : 0.0f;
        const float s2 = NORM ? graft_warp_sum(sq[r]) : 0.0f;
        if (lane == 0) {
            partial[warp][r] = s0;
            partial[warp][ROWS + r] = s1;
            partial[warp][2 * ROWS + r] = s2;
        }
    }
    __syncthreads();
    // Lane r of each output's first warp sums row r over the output's warps and writes it.
    if (active && part == 0 && lane < rows) {
        float s0 = 0.0f;
        float s1 = 0.0f;
        float s2 = 0.0f;
        for (unsigned int q = 0; q < split; ++q) {
            s0 += partial[warp + q][lane];
            s1 += partial[warp + q][ROWS + lane];
            s2 += partial[warp + q][2 * ROWS + lane];
        }
        if (NORM) {
            // x . (g * w) scaled by the row's 1 / rms: the norm's projection.
            const float scale = 1.0f / sqrtf(s2 / (float)k + eps);
            s0 *= scale;
            s1 *= scale;
        }
        float out = s0;
        if (PAIR) {
            out = s0 / (1.0f + expf(-s0)) * s1;
        } else if (bias) {
            out += graft_to_f32(*bias);
        }
        if (gate) {
            out = out / (1.0f + expf(-graft_to_f32(gate[lane])));
        }
        const unsigned long long at = (unsigned long long)lane * n + j;
        if (residual) {
            out = graft_to_f32(y[at]) + graft_to_f32(graft_from_f32<T>(out));
        }
        y[at] = graft_from_f32<T>(out);
    }
}

#define GRAFT_MATVEC_ONE(suffix, T, name, ROWS, VEC, PAIR, NORM)                             \
    extern "C" __global__ void graft_matvec_##name##_##suffix(                               \
        const T* x, const T* w0, const T* w1, const T* w2, const T* b0, const T* b1,         \
        const T* b2, const T* gate, const T* norm, float eps, T* y, unsigned int rows,       \
        unsigned int k, unsigned int n0, unsigned int n1, unsigned int n2,                   \
        unsigned int bias_mask, unsigned int split, unsigned int residual) {                 \
        graft_matvec<T, ROWS, VEC, PAIR, NORM>(x, w0, w1, w2, b0, b1, b2, gate, norm, eps,   \
                                               y, rows, k, n0, n1, n2, bias_mask, split,     \
                                               residual);                                    \
    }
// Each instantiation, and the same with the norm (`_norm`: `norm` must be non-null).
#define GRAFT_MATVEC_NORMS(suffix, T, name, ROWS, VEC, PAIR)                                 \
    GRAFT_MATVEC_ONE(suffix, T, name, ROWS, VEC, PAIR, false)                                \
    GRAFT_MATVEC_ONE(suffix, T, name##_norm, ROWS, VEC, PAIR, true)
#define GRAFT_MATVEC(suffix, T)                                                              \
    GRAFT_MATVEC_NORMS(suffix, T, vec1, 1, true, false)                                      \
    GRAFT_MATVEC_NORMS(suffix, T, vec2, 2, true, false)                                      \
    GRAFT_MATVEC_NORMS(suffix, T, scalar2, 2, false, false)                                  \
    GRAFT_MATVEC_NORMS(suffix, T, vec1_swiglu, 1, true, true)                                \
    GRAFT_MATVEC_NORMS(suffix, T, vec2_swiglu, 2, true, true)                                \
    GRAFT_MATVEC_NORMS(suffix, T, scalar2_swiglu, 2, false, true)
GRAFT_FOR_DTYPES(GRAFT_MATVEC)
