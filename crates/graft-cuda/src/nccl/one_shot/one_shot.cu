// The one-shot all-reduce kernels, one per dtype; kernel.rs gives the protocol and why two
// parities of receive slots suffice, and prepends the layout constants (GRAFT_SLICE ...) and
// the 16-bit floats' conversions (half.cu).
typedef unsigned long long u64;
typedef unsigned int u32;

// Loads that bypass L1 (the slots are written by peers over NVLink), and the flag's release
// store and acquire load at system scope.
__device__ __forceinline__ uint4 os_ld_cg_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 os_ld_cg_u32(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float os_ld_cg(const float* p) {
    return __uint_as_float(os_ld_cg_u32(p));
}
__device__ __forceinline__ unsigned short os_ld_cg_u16(const void* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float os_ld_cg(const GraftBf16* p) {
    GraftBf16 x;
    x.bits = os_ld_cg_u16(p);
    return graft_to_f32(x);
}
__device__ __forceinline__ float os_ld_cg(const GraftF16* p) {
    GraftF16 x;
    x.bits = os_ld_cg_u16(p);
    return graft_to_f32(x);
}
__device__ __forceinline__ void os_st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 os_ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// 16 bytes of T: E elements.
template <typename T> struct OsLanes {
    static const u32 E = 16u / sizeof(T);
    union U { uint4 v; T e[16u / sizeof(T)]; };
};

template <typename T>
__device__ __forceinline__ void os_add(float* acc, uint4 v, bool first) {
    typename OsLanes<T>::U u;
    u.v = v;
#pragma unroll
    for (u32 k = 0; k < OsLanes<T>::E; ++k) {
        const float f = graft_to_f32(u.e[k]);
        acc[k] = first ? f : acc[k] + f;
    }
}

template <typename T>
__device__ __forceinline__ uint4 os_pack(const float* acc) {
    typename OsLanes<T>::U u;
#pragma unroll
    for (u32 k = 0; k < OsLanes<T>::E; ++k) {
        u.e[k] = graft_from_f32<T>(acc[k]);
    }
    return u.v;
}

template <typename T>
__device__ __forceinline__ void os_all_reduce(
    T* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    // 0. A programmatic dependent launched after this kernel (decode_step's next projection)
    // may start now and ask L2 for its weights while the ranks exchange; it waits for this
    // kernel's end before it reads the sum. A plain launch after it (the next call of this
    // kernel among them) still waits for the whole kernel, as the protocol needs.
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    __shared__ unsigned char* s_base[GRAFT_MAX_WORLD];
    __shared__ u32 s_epoch;
    __shared__ u32 s_aborted;
    const u64 b = blockIdx.x;
    const u64 flags_at = 2ull * world * GRAFT_SLOT;
    const u64 counters_at = flags_at + 4ull * GRAFT_MAX_BLOCKS * world;
    const u64 table_at = counters_at + 4ull * GRAFT_MAX_BLOCKS;
    u32* counter = (u32*)(mine + counters_at) + b;
    if (threadIdx.x < world) {
        s_base[threadIdx.x] = (unsigned char*)((const u64*)(mine + table_at))[threadIdx.x];
    }
    if (threadIdx.x == 0) {
        s_epoch = os_ld_cg_u32(counter) + 1u;
        s_aborted = 0u;
    }
    __syncthreads();
    const u32 epoch = s_epoch;
    const u64 parity = epoch & 1u;
    const u32 E = OsLanes<T>::E;
    const u64 per = GRAFT_SLICE / sizeof(T);
    const u64 start = b * per;
    const u64 end = start + per < count ? start + per : count;
    const bool aligned = (((u64)data) & 15ull) == 0;
    const u64 vectors = aligned ? (end - start) / E : 0;
    const u64 tail = start + vectors * E;
    // This rank's slot in every rank's receive buffer of this parity.
    const u64 slot = (parity * world + rank) * GRAFT_SLOT;

    // 1. This rank's slice into every peer's slot.
    for (u64 i = threadIdx.x; i < vectors; i += blockDim.x) {
        const u64 e = start + i * E;
        const uint4 v = *(const uint4*)(data + e);
        for (u32 p = 0; p < world; ++p) {
            if (p != rank) {
                *(uint4*)(s_base[p] + slot + e * sizeof(T)) = v;
            }
        }
    }
    for (u64 e = tail + threadIdx.x; e < end; e += blockDim.x) {
        const T v = data[e];
        for (u32 p = 0; p < world; ++p) {
            if (p != rank) {
                *(T*)(s_base[p] + slot + e * sizeof(T)) = v;
            }
        }
    }

    // 2. and 3. Flags out, once every thread's stores are made; then the peers' flags in.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        for (u32 p = 0; p < world; ++p) {
            if (p != rank) {
                os_st_release_sys((u32*)(s_base[p] + flags_at) + b * world + rank, epoch);
            }
        }
        const u32* flags = (const u32*)(mine + flags_at) + b * world;
        u32 polls = 0;
        for (u32 p = 0; p < world && s_aborted == 0u; ++p) {
            if (p == rank) {
                continue;
            }
            while ((int)(os_ld_acquire_sys(flags + p) - epoch) < 0) {
                if ((++polls & 1023u) == 0u && *(const volatile u32*)abort_word != 0u) {
                    s_aborted = 1u;
                    break;
                }
            }
        }
    }
    __syncthreads();
    if (s_aborted != 0u) {
        return;
    }

    // 4. The sum in rank order, in f32, rounded once, in place.
    for (u64 i = threadIdx.x; i < vectors; i += blockDim.x) {
        const u64 e = start + i * E;
        float acc[OsLanes<T>::E];
        for (u32 p = 0; p < world; ++p) {
            const uint4 v = p == rank
                ? *(const uint4*)(data + e)
                : os_ld_cg_v4(mine + (parity * world + p) * GRAFT_SLOT + e * sizeof(T));
            os_add<T>(acc, v, p == 0);
        }
        *(uint4*)(data + e) = os_pack<T>(acc);
    }
    for (u64 e = tail + threadIdx.x; e < end; e += blockDim.x) {
        float acc = 0.0f;
        for (u32 p = 0; p < world; ++p) {
            const float f = p == rank
                ? graft_to_f32(data[e])
                : os_ld_cg((const T*)(mine + (parity * world + p) * GRAFT_SLOT + e * sizeof(T)));
            acc = p == 0 ? f : acc + f;
        }
        data[e] = graft_from_f32<T>(acc);
    }

    // 5. This block's epoch, for its next call.
    if (threadIdx.x == 0) {
        *counter = epoch;
    }
}

extern "C" __global__ void graft_one_shot_f32(
    float* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    os_all_reduce<float>(data, count, mine, abort_word, rank, world);
}
extern "C" __global__ void graft_one_shot_bf16(
    GraftBf16* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    os_all_reduce<GraftBf16>(data, count, mine, abort_word, rank, world);
}
extern "C" __global__ void graft_one_shot_f16(
    GraftF16* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    os_all_reduce<GraftF16>(data, count, mine, abort_word, rank, world);
}
