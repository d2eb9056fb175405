// The embedding of a decode step's tokens (after the prelude of nvrtc.rs): grid (batch), row b
// of the output is row tokens[b] of the table (a token past the table reads its last row: the
// kernel cannot report it; the CPU's index_select fails instead).
template <typename T>
__device__ void graft_step_embed(const unsigned int* tokens, const T* table, T* out,
                                 unsigned int hidden, unsigned int vocab) {
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int b = blockIdx.x;
    unsigned int t = tokens[b];
    if (t >= vocab) {
        t = vocab - 1u;
    }
    const T* src = table + (unsigned long long)t * hidden;
    T* dst = out + (unsigned long long)b * hidden;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = src[i];
    }
}

#define GRAFT_STEP_EMBED(suffix, T)                                                          \
    extern "C" __global__ void graft_step_embed_##suffix(                                    \
        const unsigned int* tokens, const T* table, T* out, unsigned int hidden,             \
        unsigned int vocab) {                                                                \
        graft_step_embed<T>(tokens, table, out, hidden, vocab);                              \
    }
GRAFT_FOR_DTYPES(GRAFT_STEP_EMBED)
