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
//! order: the kernel is never launched as a programmatic dependent; it lets one launched
//! after it start early, at its own start, but every such kernel of graft's waits for its
//! predecessor's end before it ends, so the next plain launch still follows this call's
//! end). So when A overwrites P's
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

/// The kernel's source: the layout's constants, the 16-bit floats' conversions
/// ([`crate::HALF_CU`]), the kernels.
pub(crate) fn source() -> String {
    format!(
        "#define GRAFT_SLICE {SLICE}ull\n#define GRAFT_SLOT {CAPACITY}ull\n#define GRAFT_MAX_BLOCKS {MAX_BLOCKS}ull\n#define GRAFT_MAX_WORLD {MAX_WORLD}\n{}{BODY}",
        crate::HALF_CU
    )
}

/// The kernels (no headers: the memory-model instructions as inline PTX, compute capability
/// 7.0 or later).
const BODY: &str = include_str!("one_shot.cu");

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
