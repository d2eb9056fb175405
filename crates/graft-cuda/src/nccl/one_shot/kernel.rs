//! The one-shot all-reduce's CUDA C++ source (compiled with NVRTC once per communicator, for
//! its device's architecture) and the workspace layout it shares with the host.
//!
//! One block per slice of [`SLICE`] bytes of the message; block `b` owns bytes
//! `b * SLICE ..` of every call, so a slice is only ever touched by the blocks `b` of all
//! ranks, whatever the message's size. Per block, with `epoch = counters[b] + 1` and
//! `parity = epoch & 1`:
//!
//! 1. every thread stores its elements of the slice into every peer's
//!    `recv[parity][my rank]` (16-byte stores where the data is 16-byte aligned);
//! 2. `__syncthreads()`; thread 0 fences at system scope (`__threadfence_system`) and stores
//!    `epoch` into every peer's `flags[b][my rank]` with `st.release.sys`;
//! 3. thread 0 spins until its own `flags[b][p]` reaches `epoch` for every peer `p`
//!    (`ld.acquire.sys`, compared modulo 2^32), reading the host-mapped abort word every 1,024
//!    polls; once it is set the block returns (the data is then undefined);
//! 4. `__syncthreads()`; every thread sums its elements over ranks in rank order (its own
//!    from the input, the peers' from its `recv[parity][p]` with L1-bypassing `ld.global.cg`),
//!    in f32, rounds once to the dtype and writes them back in place (only elements it read
//!    itself: no other thread touches them);
//! 5. thread 0 stores `counters[b] = epoch`.
//!
//! Why two parities suffice: rank A's block `b` at epoch `e + 2` can only start once its
//! block `b` at epoch `e + 1` saw every peer's flag `e + 1`; a peer P stores that flag in
//! its own call of epoch `e + 1`, which starts only after P's call of epoch `e` ended (stream
//! order: the kernel is never a programmatic dependent). So when A overwrites P's
//! `recv[e & 1][A]` slice `b` again, P has finished reading it. A can be one epoch ahead of P
//! (it writes the other parity then, and its flag `e + 1` satisfies P's wait for `e`, which
//! compares `>=`), never two. Every rank makes the same calls with the same sizes, so
//! `counters[b]` is the same on every rank at every call, eagerly and in replays alike.

/// Bytes of the message one block owns.
pub(crate) const SLICE: usize = 4096;
/// Most blocks of a launch (one per slice).
pub(crate) const MAX_BLOCKS: usize = 64;
/// The largest message the workspace holds: every block's slice.
pub(crate) const CAPACITY: usize = SLICE * MAX_BLOCKS;
/// Most ranks the kernel serves (an NVLink domain of one host).
pub(crate) const MAX_WORLD: usize = 8;
/// Threads per block: a slice is one 16-byte vector per thread.
pub(crate) const THREADS: u32 = 256;

/// The kernels, one per dtype: f32, bf16, f16 (`OneShot::launch` picks by index).
pub(crate) const KERNELS: [&str; 3] = [
    "graft_one_shot_f32",
    "graft_one_shot_bf16",
    "graft_one_shot_f16",
];

/// Where each part of a rank's workspace (one `cuMemAlloc`) lies, for `world` ranks: the
/// receive slots `recv[2][world][CAPACITY]`, the flags `flags[MAX_BLOCKS][world]` (u32), the
/// counters `counters[MAX_BLOCKS]` (u32), and the table of every rank's workspace address
/// in this process (u64 each). The kernel computes the same offsets from `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) world: usize,
}

impl Layout {
    /// Offset of the flags.
    pub(crate) fn flags_at(self) -> usize {
        2 * self.world * CAPACITY
    }

    /// Offset of the counters.
    pub(crate) fn counters_at(self) -> usize {
        self.flags_at() + 4 * MAX_BLOCKS * self.world
    }

    /// Offset of the table of workspace addresses.
    pub(crate) fn table_at(self) -> usize {
        self.counters_at() + 4 * MAX_BLOCKS
    }

    /// The workspace's bytes.
    pub(crate) fn bytes(self) -> usize {
        self.table_at() + 8 * self.world
    }
}

/// The blocks of a launch for a message of `bytes` (at most [`CAPACITY`]): one per slice.
pub(crate) fn blocks(bytes: usize) -> u32 {
    // At most MAX_BLOCKS (64) for bytes <= CAPACITY: the caller checked.
    bytes.div_ceil(SLICE) as u32
}

/// The kernel's source, the layout's constants first.
pub(crate) fn source() -> String {
    format!(
        "#define GRAFT_SLICE {SLICE}ull\n#define GRAFT_SLOT {CAPACITY}ull\n#define GRAFT_MAX_BLOCKS {MAX_BLOCKS}ull\n#define GRAFT_MAX_WORLD {MAX_WORLD}\n{BODY}"
    )
}

/// The kernel (no headers: 16-bit floats as structs of their bits, converted by hand as
/// graft-candle-kernels does; the memory-model instructions as inline PTX, compute
/// capability 7.0 or later).
const BODY: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

struct OsBf16 { unsigned short bits; };
struct OsF16 { unsigned short bits; };

__device__ __forceinline__ float os_f32(float x) { return x; }
__device__ __forceinline__ float os_f32(OsBf16 x) {
    return __uint_as_float(((u32)x.bits) << 16);
}
__device__ __forceinline__ float os_f32(OsF16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T os_from(float x);
template <> __device__ __forceinline__ float os_from<float>(float x) { return x; }
template <> __device__ __forceinline__ OsBf16 os_from<OsBf16>(float x) {
    u32 u = __float_as_uint(x);
    OsBf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ OsF16 os_from<OsF16>(float x) {
    OsF16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

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
__device__ __forceinline__ float os_ld_cg(const OsBf16* p) {
    OsBf16 x;
    x.bits = os_ld_cg_u16(p);
    return os_f32(x);
}
__device__ __forceinline__ float os_ld_cg(const OsF16* p) {
    OsF16 x;
    x.bits = os_ld_cg_u16(p);
    return os_f32(x);
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
        const float f = os_f32(u.e[k]);
        acc[k] = first ? f : acc[k] + f;
    }
}

template <typename T>
__device__ __forceinline__ uint4 os_pack(const float* acc) {
    typename OsLanes<T>::U u;
#pragma unroll
    for (u32 k = 0; k < OsLanes<T>::E; ++k) {
        u.e[k] = os_from<T>(acc[k]);
    }
    return u.v;
}

template <typename T>
__device__ __forceinline__ void os_all_reduce(
    T* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
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
                ? os_f32(data[e])
                : os_ld_cg((const T*)(mine + (parity * world + p) * GRAFT_SLOT + e * sizeof(T)));
            acc = p == 0 ? f : acc + f;
        }
        data[e] = os_from<T>(acc);
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
    OsBf16* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    os_all_reduce<OsBf16>(data, count, mine, abort_word, rank, world);
}
extern "C" __global__ void graft_one_shot_f16(
    OsF16* data, u64 count, unsigned char* mine, const u32* abort_word, u32 rank, u32 world) {
    os_all_reduce<OsF16>(data, count, mine, abort_word, rank, world);
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_is_aligned_and_the_capacity_is_every_blocks_slice() {
        for world in 1..=MAX_WORLD {
            let l = Layout { world };
            assert_eq!(l.flags_at() % 256, 0);
            assert_eq!(l.table_at() % 8, 0, "the table holds u64s");
            assert_eq!(l.bytes(), l.table_at() + 8 * world);
        }
        assert_eq!(CAPACITY, 256 << 10);
        assert_eq!(SLICE % 16, 0, "a slice is whole 16-byte vectors");
        assert_eq!(SLICE / 16, THREADS as usize, "one vector per thread");
    }

    #[test]
    fn blocks_come_from_the_size_alone() {
        assert_eq!(blocks(2), 1);
        assert_eq!(blocks(4096), 1);
        assert_eq!(blocks(4097), 2);
        assert_eq!(blocks(128 << 10), 32);
        assert_eq!(blocks(CAPACITY), MAX_BLOCKS as u32);
    }

    #[test]
    fn the_source_defines_the_layout_and_every_kernel() {
        let s = source();
        assert!(s.starts_with("#define GRAFT_SLICE 4096ull\n#define GRAFT_SLOT 262144ull\n"));
        for k in KERNELS {
            assert!(s.contains(&format!("__global__ void {k}(")), "{k}");
            assert!(
                !k.contains("nccl"),
                "graft's patcher takes NCCL's kernels as opaque"
            );
        }
    }
}
