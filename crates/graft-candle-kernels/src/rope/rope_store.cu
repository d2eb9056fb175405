
template <typename T, bool INTERLEAVED>
__device__ void graft_rope_store(
    const T* qkv, const T* cos, const T* sin, const unsigned int* positions,
    const unsigned int* blocks_of, unsigned int max_blocks, unsigned int blocks,
    unsigned int block_size, const T* q_norm, const T* k_norm, T* q_out, T* k_cache,
    T* v_cache, unsigned int heads, unsigned int kv_heads, unsigned int hd, unsigned int max_seq,
    unsigned int table, unsigned int has_norm, float eps) {
    // As a programmatic dependent: nothing to do before the wait (qkv is the kernel before's).
    graft_pdl_trigger();
    graft_pdl_wait();
    const unsigned int h = blockIdx.x;
    const unsigned int b = blockIdx.y;
    const unsigned int lane = threadIdx.x;
    // Token b's block-table row (null: its own cache block b, of max_seq positions).
    const unsigned int* tb = blocks_of ? blocks_of + (unsigned long long)b * max_blocks : 0;
    unsigned int p = positions[b];
    if (p >= max_seq) {
        p = max_seq - 1u;  // never write outside the cache
    }
    const unsigned int row = p < table ? p : table - 1u;
    const T* src = qkv + ((unsigned long long)b * (heads + 2u * kv_heads) + h) * hd;
    if (h >= heads + kv_heads) {
        const unsigned int kvh = h - heads - kv_heads;
        T* dst =
            v_cache + graft_cache_place(tb, b, blocks, kv_heads, kvh, block_size, p) * hd;
        for (unsigned int i = lane; i < hd; i += 32u) {
            dst[i] = src[i];
        }
        return;
    }
    const bool query = h < heads;
    T* dst = query ? q_out + ((unsigned long long)b * heads + h) * hd
                   : k_cache + graft_cache_place(tb, b, blocks, kv_heads, h - heads, block_size,
                                                 p) * hd;
    float inv = 1.0f;
    const T* w = query ? q_norm : k_norm;
    if (has_norm) {
        float squares = 0.0f;
        for (unsigned int i = lane; i < hd; i += 32u) {
            const float x = graft_to_f32(src[i]);
            squares += x * x;
        }
        inv = 1.0f / sqrtf(graft_warp_sum(squares) / (float)hd + eps);
    }
    const unsigned int half = hd / 2u;
    for (unsigned int i = lane; i < half; i += 32u) {
        const unsigned int i1 = INTERLEAVED ? 2u * i : i;
        const unsigned int i2 = INTERLEAVED ? 2u * i + 1u : i + half;
        float x1 = graft_to_f32(src[i1]);
        float x2 = graft_to_f32(src[i2]);
        if (has_norm) {
            // Rounded to T, as the unfused norm leaves it.
            x1 = graft_to_f32(graft_from_f32<T>(x1 * inv * graft_to_f32(w[i1])));
            x2 = graft_to_f32(graft_from_f32<T>(x2 * inv * graft_to_f32(w[i2])));
        }
        const float c = graft_to_f32(cos[(unsigned long long)row * half + i]);
        const float s = graft_to_f32(sin[(unsigned long long)row * half + i]);
        dst[i1] = graft_from_f32<T>(x1 * c - x2 * s);
        dst[i2] = graft_from_f32<T>(x1 * s + x2 * c);
    }
}

#define GRAFT_ROPE_ONE(suffix, T, name, INTERLEAVED)                                         \
    extern "C" __global__ void graft_rope_store_##name##_##suffix(                           \
        const T* qkv, const T* cos, const T* sin, const unsigned int* positions,             \
        const unsigned int* blocks_of, unsigned int max_blocks, unsigned int blocks,         \
        unsigned int block_size, const T* q_norm, const T* k_norm, T* q_out, T* k_cache,     \
        T* v_cache, unsigned int heads, unsigned int kv_heads, unsigned int hd,              \
        unsigned int max_seq, unsigned int table, unsigned int has_norm, float eps) {        \
        graft_rope_store<T, INTERLEAVED>(qkv, cos, sin, positions, blocks_of, max_blocks,    \
                                         blocks, block_size, q_norm, k_norm, q_out, k_cache, \
                                         v_cache, heads, kv_heads, hd, max_seq, table,       \
                                         has_norm, eps);                                     \
    }
#define GRAFT_ROPE(suffix, T)                                                                \
    GRAFT_ROPE_ONE(suffix, T, half, false)                                                   \
    GRAFT_ROPE_ONE(suffix, T, interleaved, true)
GRAFT_FOR_DTYPES(GRAFT_ROPE)
